"""Runtime patches of vLLM 0.33.0, one upstream symbol per module (Why / How / Upstream
status / Removal plan in each); the index is ``README.md`` here."""
from __future__ import annotations

from vllm_pcp.patches import model_config_dcp, platform_config

PATCHES = (platform_config, model_config_dcp)


def apply_all() -> None:
    """Apply every patch in this process (each is idempotent)."""
    for patch in PATCHES:
        patch.apply()


def refuse_pcp(reason: str) -> None:
    """Refuse ``-pcp`` with ``reason`` (a vLLM the plugin does not run on), if it can."""
    try:
        platform_config.apply(refusal=reason)
    except (ImportError, AttributeError):
        pass
