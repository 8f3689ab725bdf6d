"""vllm-pcp: prefill context parallelism for GQA models on FlashInfer, as a vLLM plugin.

Data flow of one engine step with ``--prefill-context-parallel-size N``::

    scheduler output (same on every rank)
      -> partition.build_pcp_metadata      split prefills into 2N chunks,
                                           rank r keeps chunks r and 2N-1-r
      -> runner.PCPModelRunner             local input ids / positions, local
                                           attention rows, gathered slot mapping
      -> backend plan (FlashInfer builder) one plan per step, on local rows
      -> attention, every layer            exchange.gather_kv -> cache write of
                                           all ranks' K/V -> causal attention of
                                           the local chunks over the paged cache
      -> exchange.restore_hidden_states    all-gather, scheduler order again
      -> sampler                           identical logits on every rank

``register`` is the ``vllm.general_plugins`` entry point; vLLM calls it in every
process (front end, engine core, each worker, Ray workers), possibly more than
once.
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
