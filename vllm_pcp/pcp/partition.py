"""Split one step's scheduled tokens across prefill-context-parallel ranks.

Pure functions of plain integers: no process group, no GPU. Every rank calls
:func:`build_pcp_metadata` with the same scheduler output and gets the same
plan; only ``pcp_rank`` selects which part of it is local.

DualChunkSwap. A split prefill of S scheduled tokens is cut into 2N chunks
(sizes differ by at most one token); rank r owns chunk r (the head) and chunk
2N-1-r (the tail), so each rank gets one cheap and one expensive slice of the
causal triangle::

    N = 2, one prompt         | c0 | c1 | c2 | c3 |      causal work
    rank 0  (head c0, tail c3)  ##             ####    1 + 4 = 5
    rank 1  (head c1, tail c2)       ###  ###          2 + 3 = 5

Rows that are not split -- decodes, and prefills shorter than
``min_split_tokens`` (see :func:`split_requests`) -- are replicated: every rank
computes them and rank 0's copy is the one that is kept (restored for sampling,
written to the KV cache). With ``shard_decodes`` each decode row is computed by
one owner rank instead (the i-th decode of the step by rank ``i % N``), whose
copy is the one kept.

Each local chunk is a *row* of its own: it attends to the first
``seq_lens[row]`` tokens of its request, of which its own ``q_len`` tokens are
the last ones. FlashInfer's bottom-right causal mask makes that exact with no
custom mask. Rows whose query is at most ``decode_threshold`` tokens long come
first, as vLLM's FlashInfer metadata builder expects.

Gathered layout. Every collective of a PCP step moves
``num_padded_tokens_per_rank`` rows per rank -- the largest local token count,
computed from the scheduler output alone and hence equal on every rank::

    gathered buffer  [rank 0 tokens | pad][rank 1 tokens | pad] ...
    gathered_token_indices[j]  global token whose K/V sits in row j (-1: skip)
    restore_indices[t]         row of the gathered buffer holding token t
    padded_gather_indices[j]   global token computed in row j (0: a pad row)

Each rank runs the model on its ``P`` rows (``model_input_indices``: its local
tokens, then pad rows), so a rank with no local tokens -- common at N >= 3 for a
split chunk shorter than 2N tokens -- still takes part in every collective.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch


@dataclass(frozen=True)
class PrefillContextParallelMetadata:
    """One step's PCP plan, seen from ``pcp_rank``; identical inputs on all ranks.

    Global tokens are numbered in scheduler order: request by request, each
    request's scheduled tokens in position order. ``T`` is their count, ``L``
    this rank's local token count, ``R`` its row count, ``P`` the padded
    per-rank size and ``N`` the PCP world size.

    Attributes
    ----------
    num_tokens_per_rank : tuple[int, ...]
        Local token count of every rank, length ``N``.
    split : torch.Tensor
        ``[num_reqs]`` bool, the requests cut into chunks (:func:`split_requests`).
    num_padded_tokens_per_rank : int
        ``P = max(num_tokens_per_rank)``: rows per rank of every all-gather.
        A function of the scheduler output only, hence rank-invariant.
    local_token_indices : torch.Tensor
        ``[L]`` int64, global index of each local token.
    restore_indices : torch.Tensor
        ``[T]`` int64, row of the gathered ``[N * P]`` buffer that holds
        global token t (the owner's copy; rank 0's for replicated rows).
    gathered_token_indices : torch.Tensor
        ``[N * P]`` int64, global token held by each gathered row, or -1 for
        padding and for the non-kept copies of replicated tokens.
    query_start_loc : torch.Tensor
        ``[R + 1]`` int32, cumulative local query lengths.
    seq_lens : torch.Tensor
        ``[R]`` int32, KV length each row attends to (its request's
        computed tokens plus the scheduled tokens up to the row's end).
    row_req_indices : torch.Tensor
        ``[R]`` int32, batch index of each row's request (its block table).
    num_decode_rows, num_decode_tokens : int
        The leading rows whose query is at most ``decode_threshold`` long.
    """

    pcp_world_size: int
    pcp_rank: int
    num_tokens: int
    num_tokens_per_rank: tuple[int, ...]
    num_padded_tokens_per_rank: int
    num_split_requests: int
    split: torch.Tensor
    local_token_indices: torch.Tensor
    restore_indices: torch.Tensor
    gathered_token_indices: torch.Tensor
    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    row_req_indices: torch.Tensor
    num_decode_rows: int
    num_decode_tokens: int

    @property
    def num_local_tokens(self) -> int:
        return self.num_tokens_per_rank[self.pcp_rank]

    @property
    def num_rows(self) -> int:
        return int(self.seq_lens.numel())

    @property
    def max_query_len(self) -> int:
        return int((self.query_start_loc[1:] - self.query_start_loc[:-1]).max().item()) \
            if self.num_rows else 0

    @property
    def model_input_indices(self) -> torch.Tensor:
        """``[P]`` int64: the global tokens of this rank's model input, the ``L`` local
        tokens then ``P - L`` pad rows (copies of global token 0).

        Every rank's model input is ``P`` rows long, so collectives inside the model
        (vLLM's MoE all-gather and reduce-scatter over the PCP group) line up, and no
        rank runs a zero-token forward. Pad rows write no KV (their gathered rows are
        -1), attend to nothing and are dropped by the restore.
        """
        pad = self.num_padded_tokens_per_rank - self.num_local_tokens
        return torch.cat((self.local_token_indices,
                          self.local_token_indices.new_zeros(pad)))

    @property
    def is_split(self) -> bool:
        """False when no request is split: every rank then runs the whole
        step on its own and no collective is needed."""
        return self.num_split_requests > 0


@dataclass(frozen=True)
class _RankRows:
    """The rows of one rank, in local order (numpy int64 arrays of one length)."""

    req: np.ndarray
    token_start: np.ndarray  # global index of the row's first token
    q_len: np.ndarray
    seq_len: np.ndarray


def indptr_of(lens) -> torch.Tensor:
    """``[len(lens) + 1]`` int32 offsets of consecutive runs of ``lens`` (a numpy
    array or CPU tensor): FlashInfer's ``qo_indptr`` / ``kv_indptr``."""
    out = np.zeros(len(lens) + 1, dtype=np.int64)
    np.cumsum(np.asarray(lens, dtype=np.int64), out=out[1:])
    return torch.from_numpy(out.astype(np.int32))


def expand_ranges(starts: np.ndarray, lens: np.ndarray) -> np.ndarray:
    """Concatenate ``arange(s, s + n)`` for every (s, n) pair."""
    total = int(lens.sum())
    if total == 0:
        return np.zeros(0, dtype=np.int64)
    offsets = np.repeat(starts - (np.cumsum(lens) - lens), lens)
    return offsets + np.arange(total, dtype=np.int64)


def _plan_rank_rows(
    computed: np.ndarray,
    scheduled: np.ndarray,
    token_start: np.ndarray,
    split: np.ndarray,
    on_rank: np.ndarray,
    pcp_world_size: int,
    pcp_rank: int,
    decode_threshold: int,
) -> _RankRows:
    """Rows of one rank: its unsplit rows (``on_rank``), then its head and tail chunks."""
    num_chunks = 2 * pcp_world_size
    reqs, subs, starts, q_lens, seq_lens = [], [], [], [], []
    rep = np.flatnonzero(on_rank)
    reqs.append(rep)
    subs.append(np.zeros_like(rep))
    starts.append(token_start[rep])
    q_lens.append(scheduled[rep])
    seq_lens.append(computed[rep] + scheduled[rep])
    spl = np.flatnonzero(split)
    for sub, chunk in enumerate((pcp_rank, num_chunks - 1 - pcp_rank)):
        lo = scheduled[spl] * chunk // num_chunks
        hi = scheduled[spl] * (chunk + 1) // num_chunks
        reqs.append(spl)
        subs.append(np.full_like(spl, sub))
        starts.append(token_start[spl] + lo)
        q_lens.append(hi - lo)
        seq_lens.append(computed[spl] + hi)
    req, sub = np.concatenate(reqs), np.concatenate(subs)
    start, q_len, seq_len = (np.concatenate(a) for a in (starts, q_lens, seq_lens))
    keep = q_len > 0
    req, sub, start, q_len, seq_len = (a[keep] for a in (req, sub, start, q_len, seq_len))
    # Short rows first (vLLM's decode-first layout), then request order.
    order = np.lexsort((sub, req, q_len > decode_threshold))
    return _RankRows(req[order], start[order], q_len[order], seq_len[order])


def decode_owners(split: np.ndarray, is_prefilling: np.ndarray | None,
                  pcp_world_size: int, shard_decodes: bool) -> np.ndarray:
    """``[R]`` int64: the one rank that computes each unsplit request, or -1 where every
    rank computes it. With ``shard_decodes`` the i-th decode row of the step (a request
    past its prefill) goes to rank ``i % N``; prefills that are not split stay on every
    rank."""
    owners = np.full(len(split), -1, dtype=np.int64)
    if shard_decodes and is_prefilling is not None:
        decodes = np.flatnonzero(~split & ~np.asarray(is_prefilling, dtype=bool))
        owners[decodes] = np.arange(len(decodes)) % pcp_world_size
    return owners


def split_requests(num_scheduled_tokens: Sequence[int], min_split_tokens: int,
                   prefill_lens: Sequence[int] | None = None,
                   min_chunk_tokens: int = 2) -> np.ndarray:
    """Which requests of a step are split: at least ``min_chunk_tokens`` tokens
    scheduled (values below 2 act as 2), and a prefill of at least
    ``min_split_tokens`` tokens (the same).

    ``prefill_lens``: each request's whole prefill (its prompt; more when a
    preempted request recomputes its output too). Given, every chunk of a long
    prompt of at least ``min_chunk_tokens`` tokens is split; without it, this step's
    tokens decide. ``min_chunk_tokens``: see :func:`min_chunk_tokens`.
    """
    scheduled = np.asarray(num_scheduled_tokens, dtype=np.int64).reshape(-1)
    length = scheduled if prefill_lens is None else \
        np.asarray(prefill_lens, dtype=np.int64).reshape(-1)
    return (scheduled >= max(2, min_chunk_tokens)) & (length >= max(2, min_split_tokens))


def min_chunk_tokens(pcp_world_size: int, decode_threshold: int) -> int:
    """The shortest chunk a whole-cache split (DCP = 1) splits: one whose 2N rows all
    have more than ``decode_threshold`` tokens. vLLM's FlashInfer attends a row of at
    most that many query tokens with its decode kernel, so a chunk that one GPU attends
    as a prefill must stay a prefill in every row; a shorter chunk is computed whole on
    every rank, as one GPU computes it (on SM90 with an fp8 KV cache the two kernels
    take the queries in bf16 and in fp8)."""
    return 2 * pcp_world_size * (decode_threshold + 1)


def build_pcp_metadata(
    num_computed_tokens: Sequence[int],
    num_scheduled_tokens: Sequence[int],
    pcp_world_size: int,
    pcp_rank: int,
    *,
    min_split_tokens: int = 2,
    decode_threshold: int = 1,
    prefill_lens: Sequence[int] | None = None,
    min_chunk_tokens: int = 2,
    is_prefilling: Sequence[bool] | None = None,
    shard_decodes: bool = False,
) -> PrefillContextParallelMetadata:
    """Plan one step for ``pcp_rank``.

    Parameters
    ----------
    num_computed_tokens, num_scheduled_tokens : sequence of int
        Per request of the batch, in batch order: tokens whose KV is already
        cached, and tokens scheduled in this step.
    pcp_world_size, pcp_rank : int
        ``N`` and this rank's index in the PCP group.
    min_split_tokens : int
        Requests with a shorter prefill (``prefill_lens``, else this step's
        scheduled tokens) are replicated, not split: :func:`split_requests`.
    decode_threshold : int
        Rows with at most this many query tokens are ordered first.
    prefill_lens : sequence of int, optional
        Per request, its whole prefill length (the prompt's).
    min_chunk_tokens : int
        Shorter chunks are replicated, not split (:func:`split_requests`).
    is_prefilling, shard_decodes : sequence of bool, bool
        With ``shard_decodes``, each unsplit request that ``is_prefilling`` marks as
        past its prefill runs on one rank only (:func:`decode_owners`).
    """
    if not 0 <= pcp_rank < pcp_world_size:
        raise ValueError(f"pcp_rank {pcp_rank} outside [0, {pcp_world_size})")
    return build_pcp_metadata_all_ranks(
        num_computed_tokens, num_scheduled_tokens, pcp_world_size,
        min_split_tokens=min_split_tokens, decode_threshold=decode_threshold,
        prefill_lens=prefill_lens, min_chunk_tokens=min_chunk_tokens,
        is_prefilling=is_prefilling, shard_decodes=shard_decodes)[pcp_rank]


def build_pcp_metadata_all_ranks(
    num_computed_tokens: Sequence[int],
    num_scheduled_tokens: Sequence[int],
    pcp_world_size: int,
    *,
    min_split_tokens: int = 2,
    decode_threshold: int = 1,
    prefill_lens: Sequence[int] | None = None,
    min_chunk_tokens: int = 2,
    is_prefilling: Sequence[bool] | None = None,
    shard_decodes: bool = False,
    num_padded_tokens_per_rank: int | None = None,
) -> list[PrefillContextParallelMetadata]:
    """:func:`build_pcp_metadata` for every rank at once (one plan, N views).

    ``num_padded_tokens_per_rank``: ``P`` when a CUDA graph fixes it (at least the
    largest local token count); by default that count."""
    computed = np.asarray(num_computed_tokens, dtype=np.int64).reshape(-1)
    scheduled = np.asarray(num_scheduled_tokens, dtype=np.int64).reshape(-1)
    if computed.shape != scheduled.shape or (scheduled < 0).any() or (computed < 0).any():
        raise ValueError("need one non-negative computed and scheduled count per request")
    token_start = np.cumsum(scheduled) - scheduled
    split = split_requests(scheduled, min_split_tokens, prefill_lens, min_chunk_tokens)
    owners = decode_owners(split, is_prefilling, pcp_world_size, shard_decodes)
    rows = [
        _plan_rank_rows(computed, scheduled, token_start, split,
                        ~split & ((owners < 0) | (owners == r)), pcp_world_size, r,
                        decode_threshold)
        for r in range(pcp_world_size)
    ]
    local_tokens = [expand_ranges(rw.token_start, rw.q_len) for rw in rows]
    counts = tuple(len(t) for t in local_tokens)
    padded = max(counts) if counts else 0
    if num_padded_tokens_per_rank is not None:
        if num_padded_tokens_per_rank < padded:
            raise ValueError(f"{num_padded_tokens_per_rank} padded rows per rank, fewer "
                             f"than the {padded} tokens of the largest rank")
        padded = num_padded_tokens_per_rank
    everywhere = np.repeat(~split & (owners < 0), scheduled)
    restore, gathered = _gathered_layout(local_tokens, everywhere, padded)
    shared = dict(pcp_world_size=pcp_world_size, num_tokens=int(scheduled.sum()),
                  num_tokens_per_rank=counts, num_padded_tokens_per_rank=padded,
                  num_split_requests=int(split.sum()), split=torch.from_numpy(split),
                  restore_indices=torch.from_numpy(restore),
                  gathered_token_indices=torch.from_numpy(gathered))
    return [_rank_view(rank, rw, tokens, decode_threshold, shared)
            for rank, (rw, tokens) in enumerate(zip(rows, local_tokens))]


def _rank_view(rank: int, rows: _RankRows, local_tokens: np.ndarray, decode_threshold: int,
               shared: dict) -> PrefillContextParallelMetadata:
    num_decode_rows = int((rows.q_len <= decode_threshold).sum())
    return PrefillContextParallelMetadata(
        pcp_rank=rank,
        local_token_indices=torch.from_numpy(local_tokens),
        query_start_loc=indptr_of(rows.q_len),
        seq_lens=torch.from_numpy(rows.seq_len.astype(np.int32)),
        row_req_indices=torch.from_numpy(rows.req.astype(np.int32)),
        num_decode_rows=num_decode_rows,
        num_decode_tokens=int(rows.q_len[:num_decode_rows].sum()),
        **shared,
    )


def _gathered_layout(
    local_tokens: list[np.ndarray], everywhere: np.ndarray, padded: int
) -> tuple[np.ndarray, np.ndarray]:
    """Restore indices ``[T]`` and gathered token indices ``[N * P]``; of a token that
    every rank computes (``everywhere``, per token) rank 0's copy is kept."""
    num_tokens = len(everywhere)
    restore = np.full(num_tokens, -1, dtype=np.int64)
    gathered = np.full(len(local_tokens) * padded, -1, dtype=np.int64)
    for rank, tokens in enumerate(local_tokens):
        rows = rank * padded + np.arange(len(tokens), dtype=np.int64)
        kept = np.ones(len(tokens), dtype=bool) if rank == 0 else ~everywhere[tokens]
        restore[tokens[kept]] = rows[kept]
        gathered[rows[kept]] = tokens[kept]
    return restore, gathered
