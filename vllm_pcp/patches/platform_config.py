"""Patch of ``vllm.platforms.cuda.CudaPlatformBase.check_and_update_config``.

Why
    vLLM 0.33.0 has no hook between parsing flags and spawning workers where a
    general plugin can check a PCP config or choose the worker class; the
    platform's ``check_and_update_config`` is where vLLM itself resolves
    ``worker_cls = "auto"``. Without this, ``vllm serve M -pcp 2`` would need
    ``--worker-cls`` and a refusal would come late, from every worker.
How
    Wrap the classmethod of the current platform's class when it is CUDA: run
    vLLM's own body first, then :func:`vllm_pcp.config.prepare_pcp_config`,
    which validates PCP > 1 on non-MLA models, sets ``parallel_config.worker_cls``
    to the plugin's worker and the CUDA graph mode it runs. PCP = 1 and MLA models
    pass through untouched. On another vLLM (``refusal``), the wrap refuses
    ``-pcp`` on a non-MLA model with that message instead.
Upstream status
    None found: no vLLM issue or PR for a plugin hook that finalises the config
    or chooses the worker. ``Worker._make_model_runner`` and
    ``GPUModelRunner.pcp_manager_cls`` (vLLM 0.28, 0.32) let a worker choose its
    runner and manager, but the worker class itself is still chosen here. Pinned
    by the tests the index (``README.md`` here) names.
Removal plan
    Drop this file once vLLM lets a general plugin choose the worker for PCP, or
    once vLLM runs GQA PCP itself.
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
