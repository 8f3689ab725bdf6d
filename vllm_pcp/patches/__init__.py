"""Runtime patches of vLLM 0.33.0: one upstream symbol per module.

Each module's docstring says Why / How / Upstream status / Removal plan; the index,
with the vLLM internals the subclasses rely on, is ``README.md`` here. Every process
applies them (:func:`vllm_pcp.register`).
"""
from __future__ import annotations

from vllm_pcp.patches import model_config_dcp, platform_config

PATCHES = (platform_config, model_config_dcp)


def apply_all() -> None:
    """Apply every patch in this process (each is idempotent)."""
    for patch in PATCHES:
        patch.apply()


def refuse_pcp(reason: str) -> None:
    """On a vLLM the plugin does not run on: refuse ``-pcp`` at start-up with ``reason``
    (:func:`vllm_pcp.patches.platform_config.apply` with a refusal in place of the
    plugin's checks); where even that hook is missing, nothing is patched."""
    try:
        platform_config.apply(refusal=reason)
    except (ImportError, AttributeError):
        pass
