"""Patch of ``vllm.config.vllm.VllmConfig._get_v2_model_runner_unsupported_features``.

Why
    vllm-pcp's worker runs a V1 ``GPUModelRunner`` subclass. vLLM 0.26.0 picks
    Model Runner V2 for dense models unless a feature it lists here is missing
    from V2; PCP > 1 on a GQA model is listed, DCP inside TP (PCP = 1) is not.
    So ``-tp 2 -dcp 2 --attention-backend FLASHINFER``, which the plugin takes
    over because vLLM's own FlashInfer DCP gives wrong tokens, chose V2, which
    the plugin's worker refuses when it starts (on 2 x H200 every such engine
    failed while its workers started).
How
    Wrap the method: vLLM's own list, plus "vllm-pcp's DCP on FLASHINFER" when
    :func:`vllm_pcp.config.takes_over` says the plugin runs the config at
    PCP = 1. vLLM then logs that V2 lacks it and uses V1, in every process
    (front end, engine core, workers read the same property), so the scheduler
    and the workers agree. ``VLLM_USE_V2_MODEL_RUNNER=1`` still wins, and the
    worker then refuses with a message.
Upstream status
    None found for a model-runner choice a plugin can make. Upstream moves PCP
    onto Model Runner V2 (#46570, MLA, merged; #50034 selects V2 when PCP is
    on, merged; #53183 makes V2 the default, merged): in 0.26.0 the list still
    names PCP for non-MLA models, and an upgrade that carries those changes
    must revisit this patch and the V1 runner subclass. Pinned by the tests
    the index (``README.md`` here) names.
Removal plan
    Drop this file once vllm-pcp runs on Model Runner V2, or once vLLM's own
    FlashInfer DCP is exact and the plugin no longer takes over PCP = 1.
"""
from __future__ import annotations

import functools

PATCHED_ATTR = "_vllm_pcp_patched"
FEATURE = "vllm-pcp's DCP on FLASHINFER (-dcp > 1 at PCP = 1)"


def wrap(vllm_config_cls: type) -> bool:
    """Wrap the method once; True if wrapped now."""
    original = vllm_config_cls._get_v2_model_runner_unsupported_features
    if getattr(original, PATCHED_ATTR, False):
        return False

    @functools.wraps(original)
    def _get_v2_model_runner_unsupported_features(self) -> list[str]:
        unsupported = original(self)
        from vllm_pcp.config import takes_over

        if self.parallel_config.prefill_context_parallel_size == 1 and takes_over(self):
            unsupported.append(FEATURE)
        return unsupported

    setattr(_get_v2_model_runner_unsupported_features, PATCHED_ATTR, True)
    vllm_config_cls._get_v2_model_runner_unsupported_features = \
        _get_v2_model_runner_unsupported_features
    return True


def apply() -> bool:
    from vllm.config.vllm import VllmConfig

    return wrap(VllmConfig)
