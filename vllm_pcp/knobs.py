"""The plugin's knobs, read from ``--additional-config`` (checked at start-up by
:func:`vllm_pcp.config.prepare_pcp_config`), and :class:`PCPSettings`, what they resolve to
for the manager and the attention."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from vllm_pcp.config import PCPConfigError

# the values of PCPKnobs' choices (decode policies: docs/design.md, "Decode steps")
SPLIT_ATTENTIONS = ("auto", "paged")
CONTEXT_EXCHANGES = ("auto", "queries", "keys")
DECODE_POLICIES = ("auto", "replicate", "shard")

# Split over 2 x H200 a fresh 4K prompt's first token came 1.12x later than on one GPU
# (within 1 % unsplit), 32K and 128K gained 1.85x and 1.92x (vLLM 0.26.0 code,
# benchmarks/results/README.md).
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
    """The ``pcp_*`` keys of ``--additional-config`` (``null``: the default)."""

    # prompts shorter than this are computed whole on every rank, every chunk of a longer
    # one is split; None: DEFAULT_MIN_SPLIT_TOKENS
    min_split_tokens: int | None = None
    # at DCP = 1: "auto" attends fresh split steps with FlashInfer's ragged kernel over the
    # gathered K/V (vllm_pcp.pcp.ragged), others paged; "paged" always paged, as one GPU
    split_attention: str = "auto"
    # with -dcp, how a split chunk reaches context stored on other ranks: "queries" sends
    # its queries and gets partials back, "keys" gathers the context K/V, "auto" the cheaper
    dcp_context_exchange: str = "auto"
    # at DCP = 1, which ranks compute a decode: "replicate" every rank (an unsplit step
    # runs no collective), "shard" one (K/V and hidden states gathered every step),
    # "auto" replicate, but shard for a mixture-of-experts model at -pcp > 2
    decode_policy: str = "auto"

    @classmethod
    def from_additional_config(cls, additional_config: Any) -> PCPKnobs:
        raw = additional_config if isinstance(additional_config, dict) else {}
        _refuse_unknown_knobs(raw)
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


def _refuse_unknown_knobs(raw: dict) -> None:
    """Refuse a key that names a knob otherwise spelled (case, dashes, no ``pcp_`` prefix)
    and a ``pcp_`` key that is no knob: either would leave a default silently."""
    for key in raw:
        if key in KNOBS:
            continue
        name = str(key).lower().replace("-", "_")
        knob = name if name.startswith("pcp_") else "pcp_" + name
        if knob in KNOBS:
            raise PCPConfigError(f"--additional-config {key}: did you mean {knob}?")
        if name.startswith("pcp_"):
            raise PCPConfigError(f"--additional-config {key}: not a vllm-pcp knob "
                                 f"(known: {', '.join(KNOBS)})")


def resolve_decode_policy(knobs: PCPKnobs, pcp: int, dcp: int, is_moe: bool) -> str:
    """``replicate`` or ``shard``; with ``-dcp`` every rank attends every query."""
    if dcp > 1:
        return "replicate"
    if knobs.decode_policy == "auto":
        return "shard" if is_moe and pcp > 2 else "replicate"
    return knobs.decode_policy


@dataclass(frozen=True)
class PCPSettings:
    """What one engine's knobs and flags resolve to."""

    pcp_world_size: int
    dcp_world_size: int
    min_split_tokens: int  # never below 2N
    # the shortest step part split: at DCP = 1 all 2N rows exceed decode_threshold (so a
    # row stays on the kernel one GPU uses, partition.min_chunk_tokens); with -dcp every
    # row has a token, so every request has a row on every rank
    min_chunk_tokens: int
    decode_threshold: int  # vLLM's FlashInfer decode threshold (no speculative decoding)
    decode_policy: str  # "replicate" or "shard"
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
