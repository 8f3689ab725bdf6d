"""The plugin's knobs, read from ``--additional-config``: each ``pcp_*`` key is checked at
start-up (:func:`vllm_pcp.config.prepare_pcp_config` reads them once, so a bad value stops
the engine before any worker starts)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from vllm_pcp.config import PCPConfigError


@dataclass(frozen=True)
class PCPKnobs:
    """Plugin knobs, read from ``--additional-config``.

    min_split_tokens : prompts shorter than this are computed whole on every rank;
        every chunk of a longer one is split (``pcp_min_split_tokens``). None (the
        default): :data:`DEFAULT_MIN_SPLIT_TOKENS` (see :func:`min_split_tokens`).
    dcp_context_exchange : with ``-dcp``, how a split chunk reaches the context that
        earlier steps stored on other ranks (``pcp_dcp_context_exchange``):
        ``"queries"`` all-gathers its queries and sends partial outputs back,
        ``"keys"`` all-gathers the context K/V, ``"auto"`` (default) whichever moves
        fewer bytes in that step (:mod:`vllm_pcp.dcp.plan`). A chunk whose context
        another request writes in the same step (a prefix hit on its blocks) sends
        its queries under every value (:mod:`vllm_pcp.dcp.prefix`).
    split_attention : at DCP = 1, the kernel a split step's rows attend with
        (``pcp_split_attention``): ``"auto"`` (default) takes FlashInfer's ragged
        kernel over the gathered K/V on steps without cached context (fresh prompts,
        :mod:`vllm_pcp.pcp.ragged`) and the paged kernel on the others; ``"paged"``
        the paged kernel on every step, which one GPU's FlashInfer prefill matches
        bit for bit.
    """

    min_split_tokens: int | None = None
    dcp_context_exchange: str = "auto"
    split_attention: str = "auto"

    @classmethod
    def from_additional_config(cls, additional_config: Any) -> PCPKnobs:
        raw = additional_config if isinstance(additional_config, dict) else {}
        unknown = sorted(k for k in raw if str(k).startswith("pcp_") and k not in _KNOBS)
        if unknown:
            raise PCPConfigError(f"--additional-config {', '.join(unknown)}: not a vllm-pcp "
                                 f"knob (known: {', '.join(_KNOBS)})")
        value = raw.get("pcp_min_split_tokens")
        if value is not None and (isinstance(value, bool) or not isinstance(value, int)
                                  or value < 0):
            raise PCPConfigError(
                f"--additional-config pcp_min_split_tokens must be a non-negative "
                f"integer, got {value!r}")
        exchange = raw.get("pcp_dcp_context_exchange", "auto")
        if exchange not in CONTEXT_EXCHANGES:
            raise PCPConfigError(
                f"--additional-config pcp_dcp_context_exchange must be one of "
                f"{', '.join(CONTEXT_EXCHANGES)}, got {exchange!r}")
        split_attention = raw.get("pcp_split_attention", "auto")
        if split_attention not in SPLIT_ATTENTIONS:
            raise PCPConfigError(
                f"--additional-config pcp_split_attention must be one of "
                f"{', '.join(SPLIT_ATTENTIONS)}, got {split_attention!r}")
        return cls(min_split_tokens=value, dcp_context_exchange=exchange,
                   split_attention=split_attention)


_KNOBS = ("pcp_min_split_tokens", "pcp_dcp_context_exchange", "pcp_split_attention")
# the kernel of a split step's rows at DCP = 1 (vllm_pcp.pcp.ragged)
SPLIT_ATTENTIONS = ("auto", "paged")
# how split chunks reach the context stored on other DCP ranks (vllm_pcp.dcp.plan)
CONTEXT_EXCHANGES = ("auto", "queries", "keys")

# A fresh 4K prompt split over 2 x H200 reached its first token 1.12x later than on one
# GPU, while 32K and 128K prompts gained 1.85x and 1.92x (benchmarks/results/run-45a125d/
# ttft.json); unsplit below 8192 tokens the 4K prompt is within 1 % of one GPU
# (run-94ba6c7/ttft.json, pcp2-min8k).
DEFAULT_MIN_SPLIT_TOKENS = 8192


def min_split_tokens(knobs: PCPKnobs, pcp_world_size: int) -> int:
    """Prompt length from which a prefill is split across the PCP ranks, every chunk
    of it (:func:`vllm_pcp.pcp.partition.split_requests`).

    The knob if set, else :data:`DEFAULT_MIN_SPLIT_TOKENS`. Never below
    ``2 * pcp_world_size``: every rank must get tokens of a split prefill.
    """
    value = DEFAULT_MIN_SPLIT_TOKENS if knobs.min_split_tokens is None else \
        knobs.min_split_tokens
    return max(value, 2 * pcp_world_size)
