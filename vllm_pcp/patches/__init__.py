"""Runtime patches of vLLM 0.26.0: one upstream symbol per module.

Each module's docstring says Why / How / Upstream status / Removal plan; the
index, with the vLLM internals the subclasses rely on, is ``README.md`` here.
Every process applies them (:func:`vllm_pcp.register`).
"""
from __future__ import annotations

from vllm_pcp.patches import (flashinfer_backend, model_config_dcp, platform_config,
                              v2_model_runner)

PATCHES = (flashinfer_backend, platform_config, model_config_dcp, v2_model_runner)


def apply_all() -> None:
    """Apply every patch in this process (each is idempotent)."""
    for patch in PATCHES:
        patch.apply()
