"""vllm-pcp: prefill context parallelism for GQA models on FlashInfer, as a vLLM plugin.

One engine step with ``--prefill-context-parallel-size N`` on vLLM's Model Runner V2::

    scheduler output (same on every rank)
      -> manager.GQAPCPManager.partition_batch   split long prompts into 2N chunks, rank r
                                                 keeps chunks r and 2N-1-r (pcp.partition);
                                                 vLLM's manager builds the local batch and
                                                 the gathered slot mapping -> manager.PCPStep
      -> runner.PCPModelState.prepare_attn       one FlashInfer plan per KV cache group,
                                                 with the step (backend, dcp.plan)
      -> every attention layer                   all-gather the new K/V, write it, attend the
           (backend.PCPFlashInferImpl)           local rows over the paged cache; with -dcp
                                                 each rank its shard, merged by LSE
      -> vLLM's restore and sampler              identical logits on every rank

``register`` is the ``vllm.general_plugins`` entry point; vLLM calls it in every
process (front end, engine core, each worker, Ray workers), possibly more than once.
It puts the plugin's backend behind ``FLASHINFER`` (vLLM's ``register_backend``) and
applies :mod:`vllm_pcp.patches`; :mod:`vllm_pcp.config` checks a configuration at
start-up and selects :class:`vllm_pcp.worker.PCPWorker`.
"""
from __future__ import annotations

__version__ = "0.2.0"

BACKEND = "vllm_pcp.backend.PCPFlashInferBackend"
_registered = False


def register() -> None:
    """Install the PCP backend and the config hook in this process (idempotent).

    On a vLLM other than :data:`vllm_pcp.config.VLLM_VERSION` it installs only the
    refusal of ``-pcp`` and logs which version it needs."""
    global _registered
    if _registered:
        return
    _registered = True
    import vllm
    from vllm.logger import init_logger

    from vllm_pcp.config import version_refusal
    from vllm_pcp.patches import apply_all, refuse_pcp

    logger = init_logger("vllm.vllm_pcp")
    refusal = version_refusal(vllm.__version__)
    if refusal is not None:
        logger.warning("vllm-pcp %s is inactive: %s", __version__, refusal)
        refuse_pcp(refusal)
        return
    from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend

    register_backend(AttentionBackendEnum.FLASHINFER, BACKEND)
    apply_all()
    logger.info("vllm-pcp %s registered: FLASHINFER backend with PCP support", __version__)
