"""vllm-pcp: prefill context parallelism for GQA models on FlashInfer, as a vLLM plugin.

Data flow of one engine step with ``--prefill-context-parallel-size N``::

    scheduler output (same on every rank)
      -> runner.PCPModelRunner._prepare_inputs
           pcp.partition.build_pcp_metadata   split prefills into 2N chunks, rank r
                                              keeps chunks r and 2N-1-r, P rows each
           dcp.plan.build_dcp_plan            with -dcp N: the step's attention rows
                                              over the sharded cache (dcp.layout,
                                              dcp.prefix)            -> runner.PCPStep
      -> runner._build_attention_metadata     one metadata per KV cache group:
                                              backend.PCPSplitMetadata (FlashInfer's
                                              plan of the local rows) or
                                              backend.PCPDCPMetadata (dcp.attention
                                              planned once, dcp.index)
      -> runner._model_forward                the model on P rows per rank
           every attention layer              pcp.exchange.gather_kv -> cache write
             (backend.PCPFlashInferImpl)      of all ranks' K/V -> FlashInfer over the
                                              local chunks, or dcp.attention (shard
                                              partials merged by LSE)
           pcp.exchange.restore_hidden_states all-gather, scheduler order again
      -> sampler (stock)                      identical logits on every rank

``register`` is the ``vllm.general_plugins`` entry point; vLLM calls it in every
process (front end, engine core, each worker, Ray workers), possibly more than
once. It applies :mod:`vllm_pcp.patches` (the FLASHINFER backend override and
three config hooks); :mod:`vllm_pcp.config` checks a configuration at start-up
and selects :class:`vllm_pcp.worker.PCPWorker`, which runs the PCP model runner.
"""
from __future__ import annotations

__version__ = "0.1.0"

_registered = False


def register() -> None:
    """Install the PCP backend and config hook in this process (idempotent)."""
    global _registered
    if _registered:
        return
    _registered = True
    from vllm.logger import init_logger

    from vllm_pcp.patches import apply_all

    apply_all()
    init_logger("vllm.vllm_pcp").info(
        "vllm-pcp %s registered: FLASHINFER backend with PCP support", __version__)
