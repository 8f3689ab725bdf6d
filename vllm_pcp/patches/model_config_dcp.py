"""Patch of ``vllm.config.model.ModelConfig.verify_with_parallel_config``.

Why
    vLLM 0.33.0 asserts, for non-MLA models with DCP > 1, TP above the KV-head count and
    DCP within ``TP // kv_heads``: checks of DCP inside TP, where KV heads are replicated.
    With DCP == PCP the cache is sharded over the PCP ranks, each keeping all its KV heads,
    so they refuse valid configs (``-pcp 2 -dcp 2`` on any GQA model at TP 1).
How
    When PCP > 1 and DCP == PCP on a non-MLA model, run vLLM's body with
    ``decode_context_parallel_size`` shown as 1, then restore it; every other check runs.
Upstream status
    vLLM issue #51429 (open); PR #51490 (closed) and PR #55030 (open) scale the bound by
    the PCP size. Pinned by the tests the index (``README.md`` here) names.
Removal plan
    Drop once vLLM checks DCP against the axis it actually spans.
"""
from __future__ import annotations

import functools

PATCHED_ATTR = "_vllm_pcp_patched"


def _dcp_spans_pcp(model_config, parallel_config) -> bool:
    pcp = parallel_config.prefill_context_parallel_size
    return (pcp > 1 and parallel_config.decode_context_parallel_size == pcp
            and not model_config.use_mla)


def wrap(model_config_cls: type) -> bool:
    """Wrap ``verify_with_parallel_config`` once; True if wrapped now."""
    original = model_config_cls.verify_with_parallel_config
    if getattr(original, PATCHED_ATTR, False):
        return False

    @functools.wraps(original)
    def verify_with_parallel_config(self, parallel_config) -> None:
        if not _dcp_spans_pcp(self, parallel_config):
            return original(self, parallel_config)
        dcp = parallel_config.decode_context_parallel_size
        parallel_config.decode_context_parallel_size = 1
        try:
            return original(self, parallel_config)
        finally:
            parallel_config.decode_context_parallel_size = dcp

    setattr(verify_with_parallel_config, PATCHED_ATTR, True)
    model_config_cls.verify_with_parallel_config = verify_with_parallel_config
    return True


def apply() -> bool:
    from vllm.config.model import ModelConfig

    return wrap(ModelConfig)
