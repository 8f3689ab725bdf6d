"""The memory a split step holds beyond what vLLM's profile run sees.

vLLM sizes the KV cache from a profile run: one dummy forward of
``max_num_batched_tokens`` tokens on each rank, stock attention. A split step
never runs there, so its transient buffers would come out of the KV cache's
margin. The runner holds :func:`split_step_reserve_bytes` allocated through the
profile run, so vLLM's measured peak includes them.

The bound takes the widest step the scheduler can send: ``P``, the rows each
rank runs, reaches the step's ``T`` tokens when most of them are short
prefills (computed whole on every rank) beside one split chunk. Per layer, one
at a time, and then once for the hidden states, every buffer counted as if all
were live at once:

    DCP = 1     the K/V gather: send [P, 2, Hkv, D], gathered [N * P, 2, Hkv, D];
                on fresh steps (the ragged kernel) each row's keys picked out of it,
                at most [2 * T, 2, Hkv, D] (a request's keys, read by at most two
                rows of a rank)
    DCP = N     the K/V gather (with Pc context rows under "keys": a chunk's whole
                context over N ranks, max_model_len / N), the new rows picked out,
                partial states and their merges; "queries" adds every rank's
                queries [N * P, Hq, D] and their partials to and from every rank
    restore     hidden states: [N * P, H] gathered, [T, H] in scheduler order

``"keys"`` and ``"auto"`` may fetch some split requests' context and send the queries of
others (whose context the step may write) in one step, so they are held to both at once. A
forced "keys" exchange in a step whose split chunks have several long contexts moves more
context rows than one max_model_len: the bound covers one.
"""
from __future__ import annotations

from dataclasses import dataclass

LSE_BYTES = 4  # float32 log-sum-exp per row and query head


@dataclass(frozen=True)
class StepShape:
    """What sizes a split step's buffers on one rank.

    tokens : T, the step's tokens (``max_num_batched_tokens`` for the bound).
    rows : P, rows per rank (identical on every rank).
    context_rows : Pc, context rows each rank sends under the "keys" exchange.
    pcp, dcp : N and DCP (1 or N).
    num_q_heads, num_kv_heads : this rank's heads (after TP).
    head_dim, hidden_size, dtype_bytes : the model's.
    exchange : ``pcp_dcp_context_exchange`` (``auto``, ``queries``, ``keys``).
    ragged : DCP = 1 fresh steps attend with the ragged kernel (``pcp_split_attention``
        ``auto``).
    """

    tokens: int
    rows: int
    context_rows: int
    pcp: int
    dcp: int
    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    hidden_size: int
    dtype_bytes: int
    exchange: str = "auto"
    ragged: bool = False


def kv_gather_bytes(s: StepShape, context_rows: int = 0) -> int:
    """:func:`vllm_pcp.pcp.exchange.gather_kv`: its send buffer and the gathered one,
    and the context rows read from the cache (stacked K and V)."""
    row = 2 * s.num_kv_heads * s.head_dim * s.dtype_bytes
    sent = s.rows + context_rows
    return row * (sent * (1 + s.pcp) + 2 * context_rows)


def ragged_layer_bytes(s: StepShape) -> int:
    """One layer of a fresh split step at DCP = 1 (:mod:`vllm_pcp.pcp.ragged`): the K/V
    gather, and the keys of every local row picked out of it, at most ``2 * T`` rows."""
    return kv_gather_bytes(s) + 2 * s.num_kv_heads * s.head_dim * s.dtype_bytes * 2 * s.tokens


def restore_bytes(s: StepShape) -> int:
    """vLLM's restore of the hidden states (``PCPManager.restore_hidden_states``): the
    local rows, every rank's rows gathered, and the step's rows in scheduler order."""
    return s.hidden_size * s.dtype_bytes * (s.rows * (1 + s.pcp) + s.tokens)


def _partials_bytes(s: StepShape, rows: int, blocks: int = 1) -> int:
    """Partial states (output and LSE) of ``rows`` rows, in ``blocks`` blocks of
    128-byte aligned buffers."""
    return rows * s.num_q_heads * (s.head_dim * s.dtype_bytes + LSE_BYTES) + 128 * blocks


def dcp_layer_bytes(s: StepShape, exchange: str) -> int:
    """One DCP layer of a split step, as :class:`vllm_pcp.dcp.attention.DCPAttention`
    runs it, every buffer counted as if all were live at once; ``exchange``:
    ``queries``, ``keys``, or ``both`` (a step that fetches some split requests' context
    and sends the queries of others, whose context the step may write):

    - the K/V gather (with the context rows when fetching) and the rows picked out of it
      for the new tokens' kernel;
    - the local output and LSE, and their merge;
    - replicated rows (short prefills with context): their partials, every rank's,
      merged;
    - queries: every rank's queries (padded, gathered, the shard's rows picked out),
      their partials sent, received, picked out and regrouped.
    """
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
    """The most a split step of shape ``s`` holds at once: its widest layer or the
    restore of its hidden states (nothing at PCP = 1)."""
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
    context_rows = (-(-model.max_model_len // pcp) + parallel.cp_kv_cache_interleave_size
                    if pcp > 1 and dcp > 1 else 0)  # a shard's rows of one context, padded
    return StepShape(
        tokens=tokens, rows=tokens, context_rows=context_rows, pcp=pcp, dcp=dcp,
        num_q_heads=model.get_num_attention_heads(parallel),
        num_kv_heads=model.get_num_kv_heads(parallel), head_dim=model.get_head_size(),
        hidden_size=model.get_hidden_size(), dtype_bytes=model.dtype.itemsize,
        exchange=knobs.dcp_context_exchange,
        ragged=dcp == 1 and knobs.split_attention == "auto")


def split_step_reserve_bytes(vllm_config) -> int:
    """What the runner holds through vLLM's profile run: :func:`step_bytes` of
    :func:`widest_step` (0 at PCP = DCP = 1)."""
    return step_bytes(widest_step(vllm_config))
