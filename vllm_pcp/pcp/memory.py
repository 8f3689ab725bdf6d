"""The memory a split step holds beyond what vLLM's profile run sees.

vLLM sizes the KV cache from a profile run (a dummy forward of ``max_num_batched_tokens``
tokens, stock attention), so the runner holds :func:`split_step_reserve_bytes` through it:
the widest step's buffers (``P`` reaches ``T`` with short prefills on every rank beside one
split chunk), per layer and for the restore of the hidden states, all counted live at once.
A DCP = 1 layer holds the K/V gather (``[N * P, 2, Hkv, D]``; ragged steps pick out at most
``2 * T`` rows' keys); a DCP = N layer too (with ``Pc`` context rows under "keys", up to
``max_model_len / N``), partials and merges, plus every rank's queries and their partials
under "queries". ``"keys"`` and ``"auto"`` may fetch context and send queries in one step:
held to both. A step fetches no more context rows than one context's
(:func:`reserved_context_rows`); the split requests past them send their queries.
"""
from __future__ import annotations

from dataclasses import dataclass

LSE_BYTES = 4  # float32 log-sum-exp per row and query head


@dataclass(frozen=True)
class StepShape:
    """What sizes a split step's buffers on one rank (heads after TP)."""

    tokens: int  # T, the step's tokens
    rows: int  # P, rows per rank
    context_rows: int  # Pc, context rows each rank sends under "keys"
    pcp: int
    dcp: int  # 1 or N
    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    hidden_size: int
    dtype_bytes: int
    exchange: str = "auto"  # pcp_dcp_context_exchange
    ragged: bool = False  # DCP = 1 fresh steps attend with the ragged kernel


def kv_gather_bytes(s: StepShape, context_rows: int = 0) -> int:
    """:func:`vllm_pcp.pcp.exchange.gather_kv`'s buffers and the context read from cache."""
    row = 2 * s.num_kv_heads * s.head_dim * s.dtype_bytes
    sent = s.rows + context_rows
    return row * (sent * (1 + s.pcp) + 2 * context_rows)


def ragged_layer_bytes(s: StepShape) -> int:
    """A DCP = 1 ragged layer: the K/V gather and at most ``2 * T`` rows' keys picked out."""
    return kv_gather_bytes(s) + 2 * s.num_kv_heads * s.head_dim * s.dtype_bytes * 2 * s.tokens


def restore_bytes(s: StepShape) -> int:
    """vLLM's ``PCPManager.restore_hidden_states``: local, gathered and restored rows."""
    return s.hidden_size * s.dtype_bytes * (s.rows * (1 + s.pcp) + s.tokens)


def _partials_bytes(s: StepShape, rows: int, blocks: int = 1) -> int:
    """Partial states of ``rows`` rows in ``blocks`` 128-byte aligned blocks."""
    return rows * s.num_q_heads * (s.head_dim * s.dtype_bytes + LSE_BYTES) + 128 * blocks


def dcp_layer_bytes(s: StepShape, exchange: str) -> int:
    """One DCP layer of a split step (``exchange``: ``queries``, ``keys`` or ``both``): the
    K/V gather (with context rows when fetching) and the rows picked out; the local output
    and LSE and their merge; replicated rows' partials, every rank's, merged; queries:
    every rank's (padded, gathered, picked out) and their partials sent, received, picked
    out and regrouped."""
    kv_row = s.num_kv_heads * s.head_dim * s.dtype_bytes
    q_row = s.num_q_heads * s.head_dim * s.dtype_bytes
    own = _partials_bytes(s, s.rows)
    replicated = (2 + s.pcp) * _partials_bytes(s, s.rows, s.pcp) + s.rows * q_row
    context_rows = s.context_rows if exchange in ("keys", "both") else 0
    picked = 2 * kv_row * s.pcp * (s.rows + context_rows)
    total = kv_gather_bytes(s, context_rows) + picked + 2 * own + replicated
    if exchange in ("queries", "both"):
        every = s.pcp * s.rows
        total += (1 + 2 * s.pcp) * s.rows * q_row + 5 * _partials_bytes(s, every, s.pcp)
    return total


def step_bytes(s: StepShape) -> int:
    """The most a split step holds at once: its widest layer or the restore (0 at PCP = 1)."""
    if s.pcp == 1:
        return 0
    if s.dcp == 1:
        layer = ragged_layer_bytes(s) if s.ragged else kv_gather_bytes(s)
    else:  # "keys" and "auto" may fetch some context and send other queries in one step
        layer = dcp_layer_bytes(s, "queries" if s.exchange == "queries" else "both")
    return max(layer, restore_bytes(s))


def widest_step(vllm_config) -> StepShape:
    """The widest split step ``vllm_config``'s scheduler can send, on one rank."""
    from vllm_pcp.knobs import PCPKnobs

    model, parallel = vllm_config.model_config, vllm_config.parallel_config
    pcp, dcp = parallel.prefill_context_parallel_size, parallel.decode_context_parallel_size
    tokens = vllm_config.scheduler_config.max_num_batched_tokens
    knobs = PCPKnobs.from_additional_config(vllm_config.additional_config)
    return StepShape(
        tokens=tokens, rows=tokens, context_rows=reserved_context_rows(vllm_config),
        pcp=pcp, dcp=dcp,
        num_q_heads=model.get_num_attention_heads(parallel),
        num_kv_heads=model.get_num_kv_heads(parallel), head_dim=model.get_head_size(),
        hidden_size=model.get_hidden_size(), dtype_bytes=model.dtype.itemsize,
        exchange=knobs.dcp_context_exchange,
        ragged=dcp == 1 and knobs.split_attention == "auto")


def reserved_context_rows(vllm_config) -> int:
    """``Pc`` the reserve holds under ``-dcp``: a shard's rows of one whole context, padded.
    A step fetches the context of split requests (in batch order) while their rows fit;
    the others send their queries (:func:`vllm_pcp.dcp.plan.build_dcp_plan`)."""
    parallel = vllm_config.parallel_config
    pcp, dcp = parallel.prefill_context_parallel_size, parallel.decode_context_parallel_size
    if pcp == 1 or dcp == 1:
        return 0
    return (-(-vllm_config.model_config.max_model_len // pcp)
            + parallel.cp_kv_cache_interleave_size)


def split_step_reserve_bytes(vllm_config) -> int:
    """What the runner holds through vLLM's profile run."""
    return step_bytes(widest_step(vllm_config))
