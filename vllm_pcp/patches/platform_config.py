"""Patch of ``vllm.platforms.cuda.CudaPlatformBase.check_and_update_config``.

Why
    vLLM 0.26.0 has no hook between parsing flags and spawning workers where a
    general plugin can check a PCP config or choose the worker class; the
    platform's ``check_and_update_config`` is where vLLM itself resolves
    ``worker_cls = "auto"``. Without this, ``vllm serve M -pcp 2`` would need
    ``--worker-cls`` and would fail late, inside the workers.
How
    Wrap the classmethod of the current platform's class when it is CUDA: run
    vLLM's own body first, then :func:`vllm_pcp.config.prepare_pcp_config`,
    which validates PCP > 1 on non-MLA models and sets
    ``parallel_config.worker_cls`` to the plugin's worker. PCP = 1 and MLA
    models pass through untouched.
Upstream status
    None found: no vLLM issue or PR for a plugin hook that finalises the config
    or chooses the model runner. A platform-independent hook (or a
    model-runner class option) would make this patch unnecessary. Pinned by
    the tests the index (``README.md`` here) names.
Removal plan
    Drop this file once vLLM lets a general plugin choose the model runner
    for PCP, or once vLLM runs GQA PCP itself.
"""
from __future__ import annotations

import functools

PATCHED_ATTR = "_vllm_pcp_patched"
SYMBOL = ("vllm.platforms.cuda", "CudaPlatformBase", "check_and_update_config")


def wrap(platform_cls: type) -> bool:
    """Wrap ``platform_cls.check_and_update_config`` once; True if wrapped now."""
    original = platform_cls.check_and_update_config.__func__
    if getattr(original, PATCHED_ATTR, False):
        return False

    @functools.wraps(original)
    def check_and_update_config(cls, vllm_config) -> None:
        original(cls, vllm_config)
        from vllm_pcp.config import prepare_pcp_config

        prepare_pcp_config(vllm_config)

    setattr(check_and_update_config, PATCHED_ATTR, True)
    platform_cls.check_and_update_config = classmethod(check_and_update_config)
    return True


def apply() -> bool:
    """Patch this process's platform if it is CUDA (a no-op elsewhere)."""
    from vllm.platforms import current_platform

    if not current_platform.is_cuda():
        return False
    from vllm.platforms.cuda import CudaPlatformBase

    return wrap(CudaPlatformBase)
