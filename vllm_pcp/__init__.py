"""vllm-pcp: prefill context parallelism for GQA models on FlashInfer, as a vLLM plugin.

A step with ``--prefill-context-parallel-size N`` on vLLM's Model Runner V2:
:class:`~vllm_pcp.manager.GQAPCPManager` splits each long prompt into 2N chunks, rank r
keeping chunks r and 2N-1-r (:mod:`vllm_pcp.pcp.partition`); each KV cache group plans
the step once (:mod:`vllm_pcp.backend`); every attention layer all-gathers the new K/V,
writes it and attends (with ``-dcp``: each rank its shard, merged by LSE); vLLM restores
the hidden states and samples the same logits on every rank. ``register``, the
``vllm.general_plugins`` entry point, runs in every process, maybe more than once.
"""
from __future__ import annotations

__version__ = "0.2.0"

BACKEND = "vllm_pcp.backend.PCPFlashInferBackend"
_registered = False


def register() -> None:
    """Put the plugin's backend behind ``FLASHINFER`` and apply :mod:`vllm_pcp.patches`
    (idempotent); on another vLLM than :data:`vllm_pcp.config.VLLM_VERSION` only refuse
    ``-pcp``."""
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
