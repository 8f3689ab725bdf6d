"""Attention plan for PCP with the KV cache sharded over the same ranks (DCP == PCP).

Rank d stores only the KV tokens it owns (:mod:`.layout`); a local row of a request with C
tokens computed before this step attends two pieces of keys::

    keys of a row   [ context 0 .. C: sharded, earlier steps ][ new C .. row end: gathered ]
    new part        causal over the gathered new K/V, on every rank
    context part    non-causal over each rank's shard -> N partials merged by LSE (base 2)
      split rows      all-gather Q; every rank attends all ranks' split queries;
                      all-to-all sends each partial to its owner
      replicated      every rank attends its own copy; all-gather the partials
    result          merge(context, new)

Split rows may instead fetch their context (``context_exchange="keys"``): each rank sends
the context K/V it stores in the all-gather of its new K/V (``[P new | Pc context]`` rows),
and the row attends causally to ``context + new``, nothing to merge: ``N * Pc`` K/V rows
instead of ``N * P`` queries out and partials back; ``"auto"`` picks by those sizes. The
context is read before the cache write, so a request whose context the step may write
(:func:`context_maybe_written_in_step`) sends its queries instead.

A pure decode step (one token per request, every rank storing a token of each) needs no
K/V exchange: after the cache write each rank attends its shard once, then one all-gather
of the partials and one merge. Every collective size is the same on every rank.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from vllm_pcp.dcp.layout import (dcp_local_offset, dcp_local_seq_len,
                                 dcp_local_seq_lens_all_ranks, dcp_owner)
from vllm_pcp.knobs import CONTEXT_EXCHANGES
from vllm_pcp.pcp.partition import PrefillContextParallelMetadata, expand_ranges, indptr_of


@dataclass(frozen=True)
class AttentionRows:
    """One kernel call: rows of queries read from a query buffer."""

    query_index: torch.Tensor  # [M] int64, buffer row of each query token, row after row
    qo_indptr: torch.Tensor  # [R + 1] int32, cumulative query counts
    req: torch.Tensor  # [R] int32, batch index of each row's request (its block table)
    kv_len: torch.Tensor  # [R] int32, keys the row attends to (0: contributes nothing)


@dataclass(frozen=True)
class ContextGather:
    """The context K/V of the split requests, all-gathered (``context_exchange="keys"``)."""

    req: torch.Tensor  # [G] int32, the split requests with context, in batch order
    local_len: torch.Tensor  # [G] int32, context tokens of each this rank stores and sends
    num_padded: int  # Pc, rows every rank sends: the most that any rank stores


@dataclass(frozen=True)
class DCPAttentionPlan:
    """One step of PCP x DCP attention, seen from ``dcp_rank``; ``pcp`` is the step's PCP
    plan. Local row j's new part reads, causally, rows
    ``new_kv_token_index[new_kv_indptr[j]:new_kv_indptr[j + 1]]`` of ``[step K/V (T);
    gathered context K/V (N * Pc), with ctx_gather]``; ``new_kv_gathered_index`` names them
    in the K/V exchange's buffer (:func:`gathered_kv_index`). ``ctx_split`` reads the
    gathered queries ``[N * P]``, ``ctx_replicated`` local ones in an order alike on every
    rank. On a pure decode step (:func:`is_folded_decode`) only ``decode`` is built: row i
    is request i, query step token i, ``kv_len`` its shard's tokens with the new one."""

    pcp: PrefillContextParallelMetadata | None
    dcp_world_size: int
    dcp_rank: int
    interleave: int
    new_kv_token_index: torch.Tensor | None
    new_kv_indptr: torch.Tensor | None
    ctx_split: AttentionRows | None
    ctx_replicated: AttentionRows | None
    decode: AttentionRows | None = None
    ctx_gather: ContextGather | None = None
    new_kv_gathered_index: torch.Tensor | None = None

    @property
    def num_local_tokens(self) -> int:
        """Query tokens this rank attends: the step's tokens on a decode step."""
        return len(self.decode.req) if self.decode is not None else self.pcp.num_local_tokens


def _attention_rows(starts: np.ndarray, lens: np.ndarray, reqs: np.ndarray,
                    kv_lens: np.ndarray) -> AttentionRows:
    """Rows reading ``lens[r]`` consecutive buffer rows from ``starts[r]``."""
    return AttentionRows(query_index=torch.from_numpy(expand_ranges(starts, lens)),
                         qo_indptr=indptr_of(lens), req=torch.from_numpy(reqs.astype(np.int32)),
                         kv_len=torch.from_numpy(kv_lens.astype(np.int32)))


def _request_rows(meta: PrefillContextParallelMetadata, wanted: np.ndarray):
    """(request, first local token, length) of the rows whose request is ``wanted``."""
    req = meta.row_req_indices.numpy().astype(np.int64)
    qsl = meta.query_start_loc.numpy().astype(np.int64)
    keep = np.flatnonzero(wanted[req])
    return req[keep], qsl[:-1][keep], np.diff(qsl)[keep]


def _queried_split_rows(metas: Sequence[PrefillContextParallelMetadata],
                        queried: np.ndarray, local_kv: np.ndarray) -> AttentionRows:
    """Every rank's split rows of ``queried`` requests: they read the gathered queries
    ``[N * P]`` and attend this rank's shard (``local_kv [R]`` tokens a request)."""
    padded = metas[0].num_padded_tokens_per_rank
    parts = [_request_rows(meta, queried) for meta in metas]
    s_req = np.concatenate([p[0] for p in parts])
    s_start = np.concatenate([p[1] + q * padded for q, p in enumerate(parts)])
    s_len = np.concatenate([p[2] for p in parts])
    return _attention_rows(s_start, s_len, s_req, local_kv[s_req])


def _gather_context(computed: np.ndarray, wanted: np.ndarray, world_size: int, rank: int,
                    interleave: int, num_padded_queries: int, kv_to_q_heads: float,
                    context_exchange: str, max_context_rows: int | None = None):
    """``(ContextGather, {request: gathered row of each context token})`` of the
    ``wanted`` requests when their context K/V moves, else ``(None, {})``; ``"auto"``
    moves it when ``Pc * kv_to_q_heads <= P``. Only the first requests (batch order)
    whose rows fit ``max_context_rows`` on every rank move theirs: the memory reserve."""
    if context_exchange not in CONTEXT_EXCHANGES:
        raise ValueError(f"context_exchange {context_exchange!r} not in {CONTEXT_EXCHANGES}")
    reqs = np.flatnonzero(wanted)
    if context_exchange == "queries" or not len(reqs):
        return None, {}
    context = computed[reqs]
    stored = dcp_local_seq_lens_all_ranks(context, world_size, interleave).T  # [N, G]
    if max_context_rows is not None:  # a prefix: the running totals only grow
        fits = np.cumsum(stored, 1).max(0) <= max_context_rows
        reqs, context, stored = reqs[fits], context[fits], stored[:, fits]
        if not len(reqs):
            return None, {}
    num_padded = int(stored.sum(1).max())
    if context_exchange == "auto" and num_padded * kv_to_q_heads > num_padded_queries:
        return None, {}
    first = np.cumsum(stored, 1) - stored  # [N, G] a request's first row in a rank's block
    t = expand_ranges(np.zeros_like(context), context)  # each request's context tokens
    g = np.repeat(np.arange(len(reqs)), context)
    owner = dcp_owner(t, world_size, interleave)
    rows = owner * num_padded + first[owner, g] + dcp_local_offset(t, world_size, interleave)
    gather = ContextGather(torch.from_numpy(reqs.astype(np.int32)),
                           torch.from_numpy(stored[rank].astype(np.int32)), num_padded)
    return gather, dict(zip(reqs.tolist(), np.split(rows, np.cumsum(context)[:-1])))


def _new_part(rows_req: np.ndarray, token_start: np.ndarray, new_lens: np.ndarray,
              context_rows: dict, num_step_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Each local row's keys for the new-part call: its request's fetched context
    (rows past the step's ``T`` tokens), then its new tokens up to the row end."""
    if not context_rows:
        index = expand_ranges(token_start[rows_req], new_lens)
        lens = new_lens
    else:
        pieces, lens = [], new_lens.copy()
        for j, req in enumerate(rows_req):
            context = context_rows.get(int(req))
            if context is not None:
                pieces.append(context + num_step_tokens)
                lens[j] += len(context)
            pieces.append(np.arange(token_start[req], token_start[req] + new_lens[j]))
        index = np.concatenate(pieces) if pieces else np.zeros(0, dtype=np.int64)
    return torch.from_numpy(index.astype(np.int64)), indptr_of(lens)


def gathered_kv_index(new_kv_token_index: torch.Tensor, restore_indices: torch.Tensor,
                      num_padded_tokens_per_rank: int, num_context_rows: int) -> torch.Tensor:
    """``new_kv_token_index`` (``[K]``: ``t < T`` step token t, ``T + c`` context row c of
    rank ``c // Pc``) as ``[K]`` int64 rows of :func:`vllm_pcp.pcp.exchange.gather_kv`'s
    ``[N * (P + Pc)]`` buffer; ``restore_indices [T]`` gives each step token's row."""
    index = new_kv_token_index.numpy().astype(np.int64, copy=False)
    restore = restore_indices.numpy().astype(np.int64, copy=False)
    num_tokens, padded = len(restore), num_padded_tokens_per_rank
    block = padded + num_context_rows
    out = np.empty_like(index)
    is_new = index < num_tokens
    rank, row = np.divmod(restore[index[is_new]], max(padded, 1))
    out[is_new] = rank * block + row
    rank, row = np.divmod(index[~is_new] - num_tokens, max(num_context_rows, 1))
    out[~is_new] = rank * block + padded + row
    return torch.from_numpy(out)


def min_folded_seq_len(world_size: int, interleave: int) -> int:
    """The shortest sequence every one of ``world_size`` ranks stores a token of."""
    return interleave * (world_size - 1) + 1


def is_folded_decode(num_computed_tokens: np.ndarray, num_scheduled_tokens: np.ndarray,
                     world_size: int, interleave: int) -> bool:
    """Every request decodes one token and every rank stores one of its tokens."""
    seq_lens = num_computed_tokens + num_scheduled_tokens
    return (len(num_scheduled_tokens) > 0 and bool((num_scheduled_tokens == 1).all())
            and bool((seq_lens >= min_folded_seq_len(world_size, interleave)).all()))


def _decode_rows(computed: np.ndarray, rank: int, world_size: int,
                 interleave: int) -> AttentionRows:
    """Request i attends with step token i to its shard, the new token included."""
    num = len(computed)
    kv = dcp_local_seq_len(torch.from_numpy(computed + 1), rank, world_size, interleave)
    return AttentionRows(query_index=torch.arange(num),
                         qo_indptr=torch.arange(num + 1, dtype=torch.int32),
                         req=torch.arange(num, dtype=torch.int32),
                         kv_len=kv.to(torch.int32))


def context_maybe_written_in_step(num_computed_tokens: np.ndarray,
                                  num_scheduled_tokens: np.ndarray) -> np.ndarray:
    """``[R]`` bool: requests whose cached context another request of the step may write.

    vLLM caches blocks at allocation, so a request beside another (``n > 1``, a shared
    system prompt) can count as computed tokens the other computes in this step. Sharing is
    by whole blocks at the same positions: j writes ``[C_j, C_j + S_j)``, inside i's context
    ``[0, C_i)`` only if ``C_j < C_i``; every such i is flagged (a superset of real hits)."""
    computed = np.asarray(num_computed_tokens, dtype=np.int64)
    writes = np.asarray(num_scheduled_tokens, dtype=np.int64) > 0
    if not writes.any():
        return np.zeros(len(computed), dtype=bool)
    return computed > computed[writes].min()


def build_dcp_plan(step, interleave: int, *, context_exchange: str = "queries",
                   kv_to_q_heads: float = 1.0,
                   max_context_rows: int | None = None) -> DCPAttentionPlan:
    """Plan one step (:class:`vllm_pcp.manager.PCPStep`) for this rank of a group that is
    both the PCP and the DCP group. ``context_exchange``: one of :data:`CONTEXT_EXCHANGES`
    (module docstring); ``kv_to_q_heads``: KV heads per query head, for ``"auto"``;
    ``max_context_rows``: the most context rows a rank sends (the rest send queries)."""
    computed = np.asarray(step.num_computed_tokens, dtype=np.int64).reshape(-1)
    scheduled = np.asarray(step.num_scheduled_tokens, dtype=np.int64).reshape(-1)
    metas, rank = step.plans, step.pcp_rank
    world_size = len(metas)
    if is_folded_decode(computed, scheduled, world_size, interleave):
        return DCPAttentionPlan(
            pcp=None, dcp_world_size=world_size, dcp_rank=rank, interleave=interleave,
            new_kv_token_index=None, new_kv_indptr=None, ctx_split=None,
            ctx_replicated=None, decode=_decode_rows(computed, rank, world_size, interleave))
    mine, padded = metas[rank], metas[0].num_padded_tokens_per_rank
    token_start = np.cumsum(scheduled) - scheduled
    split = mine.split.numpy()
    local_kv = dcp_local_seq_len(torch.from_numpy(computed), rank, world_size,
                                 interleave).numpy()
    has_context = computed > 0
    # context that this step writes is in the cache only after the write: not fetched
    may_fetch = split & has_context & ~context_maybe_written_in_step(computed, scheduled)
    rows_req = mine.row_req_indices.numpy().astype(np.int64)
    new_lens = mine.seq_lens.numpy().astype(np.int64) - computed[rows_req]
    gather, context_rows = _gather_context(computed, may_fetch, world_size, rank,
                                           interleave, padded, kv_to_q_heads,
                                           context_exchange, max_context_rows)
    new_index, new_indptr = _new_part(rows_req, token_start, new_lens, context_rows,
                                      int(scheduled.sum()))
    # every split request with context either fetched it or sends its queries
    fetched = np.zeros_like(split)
    if gather is not None:
        fetched[gather.req.numpy()] = True
    # replicated rows with context, ordered by request: the same order everywhere
    r_req, r_start, r_len = _request_rows(mine, ~split & has_context)
    order = np.argsort(r_req, kind="stable")
    return DCPAttentionPlan(
        pcp=mine, dcp_world_size=world_size, dcp_rank=rank, interleave=interleave,
        new_kv_token_index=new_index, new_kv_indptr=new_indptr,
        ctx_split=_queried_split_rows(metas, split & has_context & ~fetched, local_kv),
        ctx_replicated=_attention_rows(r_start[order], r_len[order], r_req[order],
                                      local_kv[r_req[order]]),
        ctx_gather=gather,
        new_kv_gathered_index=gathered_kv_index(new_index, mine.restore_indices, padded,
                                                0 if gather is None else gather.num_padded))
