"""The plugin's knobs, read from ``--additional-config``, and what they resolve to.

Each ``pcp_*`` key is checked at start-up (:func:`vllm_pcp.config.prepare_pcp_config`
reads them once, so a bad value stops the engine before any worker starts);
:class:`PCPSettings` is what the manager and the attention read, per engine.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from vllm_pcp.config import PCPConfigError

# the kernel of a split step's rows at DCP = 1 (vllm_pcp.pcp.ragged)
SPLIT_ATTENTIONS = ("auto", "paged")
# how split chunks reach the context stored on other DCP ranks (vllm_pcp.dcp.plan)
CONTEXT_EXCHANGES = ("auto", "queries", "keys")
# which ranks compute a decode at DCP = 1 (docs/design.md, "Decode steps")
DECODE_POLICIES = ("auto", "replicate", "shard")

# A fresh 4K prompt split over 2 x H200 reached its first token 1.12x later than on one
# GPU, while 32K and 128K prompts gained 1.85x and 1.92x; unsplit below 8192 tokens the
# 4K prompt is within 1 % of one GPU (vLLM 0.26.0 code, benchmarks/results/README.md).
DEFAULT_MIN_SPLIT_TOKENS = 8192


def _choice(raw: dict, key: str, choices: tuple[str, ...]) -> str:
    value = raw.get(key)
    if value is None:
        return "auto"
    if value not in choices:
        raise PCPConfigError(f"--additional-config {key} must be one of "
                             f"{', '.join(choices)}, got {value!r}")
    return value


@dataclass(frozen=True)
class PCPKnobs:
    """Plugin knobs, read from ``--additional-config`` (``null`` means the default).

    min_split_tokens : prompts shorter than this are computed whole on every rank;
        every chunk of a longer one is split (``pcp_min_split_tokens``). None:
        :data:`DEFAULT_MIN_SPLIT_TOKENS`.
    split_attention : at DCP = 1, the kernel a split step's rows attend with
        (``pcp_split_attention``): ``auto`` takes FlashInfer's ragged kernel over the
        gathered K/V on steps without cached context (fresh prompts,
        :mod:`vllm_pcp.pcp.ragged`) and the paged kernel on the others; ``paged`` the
        paged kernel on every step, as one GPU's FlashInfer prefill.
    dcp_context_exchange : with ``-dcp``, how a split chunk reaches the context that
        earlier steps stored on other ranks (``pcp_dcp_context_exchange``): ``queries``
        all-gathers its queries and sends partial outputs back, ``keys`` all-gathers the
        context K/V, ``auto`` whichever moves fewer bytes in that step.
    decode_policy : at DCP = 1, which ranks compute a decode (``pcp_decode_policy``):
        ``replicate`` every rank, a step that splits nothing then runs no collective;
        ``shard`` one rank each, its K/V and hidden states all-gathered every step;
        ``auto`` replicate, but shard for a mixture-of-experts model at ``-pcp`` > 2.
    """

    min_split_tokens: int | None = None
    split_attention: str = "auto"
    dcp_context_exchange: str = "auto"
    decode_policy: str = "auto"

    @classmethod
    def from_additional_config(cls, additional_config: Any) -> PCPKnobs:
        raw = additional_config if isinstance(additional_config, dict) else {}
        unknown = sorted(k for k in raw if str(k).startswith("pcp_") and k not in KNOBS)
        if unknown:
            raise PCPConfigError(f"--additional-config {', '.join(unknown)}: not a vllm-pcp "
                                 f"knob (known: {', '.join(KNOBS)})")
        value = raw.get("pcp_min_split_tokens")
        if value is not None and (isinstance(value, bool) or not isinstance(value, int)
                                  or value < 0):
            raise PCPConfigError(
                f"--additional-config pcp_min_split_tokens must be a non-negative "
                f"integer, got {value!r}")
        return cls(min_split_tokens=value,
                   split_attention=_choice(raw, "pcp_split_attention", SPLIT_ATTENTIONS),
                   dcp_context_exchange=_choice(raw, "pcp_dcp_context_exchange",
                                                CONTEXT_EXCHANGES),
                   decode_policy=_choice(raw, "pcp_decode_policy", DECODE_POLICIES))


KNOBS = ("pcp_min_split_tokens", "pcp_split_attention", "pcp_dcp_context_exchange",
         "pcp_decode_policy")


def resolve_decode_policy(knobs: PCPKnobs, pcp: int, dcp: int, is_moe: bool) -> str:
    """``replicate`` or ``shard`` (``auto`` resolved); with ``-dcp`` every rank attends
    its shard for every query, so decodes are on every rank."""
    if dcp > 1:
        return "replicate"
    if knobs.decode_policy == "auto":
        return "shard" if is_moe and pcp > 2 else "replicate"
    return knobs.decode_policy


@dataclass(frozen=True)
class PCPSettings:
    """What one engine's knobs and flags resolve to, for the manager and the attention.

    min_split_tokens : prompt length from which a prefill is split, never below 2N.
    min_chunk_tokens : the shortest step part that is split. At DCP = 1 every one of
        the 2N rows has more than ``decode_threshold`` tokens, so a row one GPU attends
        with the prefill kernel stays on it (vLLM's FlashInfer attends rows of at most
        ``decode_threshold`` tokens with its decode kernel); with ``-dcp`` every row
        has a token, so every request has a row on every rank.
    decode_threshold : vLLM's FlashInfer decode threshold (no speculative decoding).
    decode_policy : ``replicate`` or ``shard`` (:func:`resolve_decode_policy`).
    """

    pcp_world_size: int
    dcp_world_size: int
    min_split_tokens: int
    min_chunk_tokens: int
    decode_threshold: int
    decode_policy: str
    split_attention: str
    dcp_context_exchange: str

    @property
    def shard_decodes(self) -> bool:
        return self.decode_policy == "shard"

    @property
    def unsplit_steps_local(self) -> bool:
        """A step that splits nothing runs every token on every rank, no collective."""
        return self.decode_policy == "replicate"

    @classmethod
    def from_vllm_config(cls, vllm_config) -> PCPSettings:
        parallel, model = vllm_config.parallel_config, vllm_config.model_config
        pcp, dcp = parallel.prefill_context_parallel_size, parallel.decode_context_parallel_size
        knobs = PCPKnobs.from_additional_config(vllm_config.additional_config)
        threshold = 1
        min_split = (DEFAULT_MIN_SPLIT_TOKENS if knobs.min_split_tokens is None
                     else knobs.min_split_tokens)
        return cls(
            pcp_world_size=pcp, dcp_world_size=dcp,
            min_split_tokens=max(min_split, 2 * pcp),
            min_chunk_tokens=2 * pcp * (threshold + 1) if dcp == 1 else 2 * pcp,
            decode_threshold=threshold,
            decode_policy=resolve_decode_policy(knobs, pcp, dcp,
                                                bool(getattr(model, "is_moe", False))),
            split_attention=knobs.split_attention,
            dcp_context_exchange=knobs.dcp_context_exchange)
