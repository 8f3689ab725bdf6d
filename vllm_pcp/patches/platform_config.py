"""Patch of ``vllm.platforms.cuda.CudaPlatformBase.check_and_update_config``.

Why
    vLLM 0.33.0 has no hook between parsing flags and spawning workers where a general
    plugin can check a PCP config or choose the worker class; this method is where vLLM
    resolves ``worker_cls = "auto"``. Without it, ``vllm serve M -pcp 2`` would need
    ``--worker-cls`` and refusals would come late, from every worker.
How
    Wrap the CUDA platform's classmethod: vLLM's body, then
    :func:`vllm_pcp.config.prepare_pcp_config` (PCP = 1 and MLA models pass untouched).
    On another vLLM the wrap refuses ``-pcp`` on a non-MLA model with ``refusal``.
Upstream status
    None found: no vLLM issue or PR for a plugin hook that finalises the config or
    chooses the worker (``Worker._make_model_runner`` and ``pcp_manager_cls`` choose the
    runner and manager). Pinned by the tests the index (``README.md`` here) names.
Removal plan
    Drop once vLLM lets a general plugin choose the worker for PCP, or runs GQA PCP itself.
"""
from __future__ import annotations

import functools

PATCHED_ATTR = "_vllm_pcp_patched"
SYMBOL = ("vllm.platforms.cuda", "CudaPlatformBase", "check_and_update_config")


def _refuse(refusal: str):
    def check(vllm_config) -> None:
        from vllm_pcp.config import PCPConfigError, takes_over

        if takes_over(vllm_config):
            raise PCPConfigError(refusal)
    return check


def wrap(platform_cls: type, refusal: str | None = None) -> bool:
    """Wrap ``platform_cls.check_and_update_config`` once; True if wrapped now."""
    original = platform_cls.check_and_update_config.__func__
    if getattr(original, PATCHED_ATTR, False):
        return False
    if refusal is None:
        from vllm_pcp.config import prepare_pcp_config as check
    else:
        check = _refuse(refusal)

    @functools.wraps(original)
    def check_and_update_config(cls, vllm_config) -> None:
        original(cls, vllm_config)
        check(vllm_config)

    setattr(check_and_update_config, PATCHED_ATTR, True)
    platform_cls.check_and_update_config = classmethod(check_and_update_config)
    return True


def apply(refusal: str | None = None) -> bool:
    """Patch this process's platform if it is CUDA (a no-op elsewhere)."""
    from vllm.platforms import current_platform

    if not current_platform.is_cuda():
        return False
    from vllm.platforms.cuda import CudaPlatformBase

    return wrap(CudaPlatformBase, refusal)
