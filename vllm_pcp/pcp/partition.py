"""Split one step's scheduled tokens across prefill-context-parallel ranks: pure functions
of the scheduler output (no process group, no GPU), the same plan on every rank.

DualChunkSwap: a split prefill is cut into 2N chunks (sizes within one token); rank r owns
chunks r and 2N-1-r, a cheap and an expensive slice of the causal triangle::

    N = 2, one prompt         | c0 | c1 | c2 | c3 |      causal work
    rank 0  (head c0, tail c3)  ##             ####    1 + 4 = 5
    rank 1  (head c1, tail c2)       ###  ###          2 + 3 = 5

Unsplit rows (decodes, short prefills) are replicated: every rank computes them and rank
0's copy is kept (restored, written); with ``shard_decodes`` the i-th decode runs on rank
``i % N`` only. Each local chunk is a *row* attending to the first ``seq_lens[row]`` tokens
of its request, its own last (FlashInfer's bottom-right causal mask); rows of at most
``decode_threshold`` tokens come first, as vLLM's FlashInfer builder expects.

Every collective moves ``P = num_padded_tokens_per_rank`` rows per rank (the largest local
token count) and every rank runs the model on ``P`` rows, so a rank without tokens (common
at N >= 3) still joins every collective::

    gathered buffer  [rank 0 tokens | pad][rank 1 tokens | pad] ...
    gathered_token_indices[j]  global token whose K/V sits in row j (-1: skip)
    restore_indices[t]         row of the gathered buffer holding token t
    padded_gather_indices[j]   global token computed in row j (0: a pad row)
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch


@dataclass(frozen=True)
class PrefillContextParallelMetadata:
    """One step's PCP plan, seen from ``pcp_rank``. Global tokens are numbered in
    scheduler order (request by request, each in position order): ``T`` of them; ``L``
    local tokens, ``R`` local rows, ``P`` padded rows per rank, ``N`` ranks."""

    pcp_world_size: int
    pcp_rank: int
    num_tokens: int
    num_tokens_per_rank: tuple[int, ...]  # [N] local token count of every rank
    num_padded_tokens_per_rank: int  # P = max(num_tokens_per_rank), unless a graph fixes it
    num_split_requests: int
    split: torch.Tensor  # [num_reqs] bool, the requests cut into chunks (split_requests)
    local_token_indices: torch.Tensor  # [L] int64, global index of each local token
    # [T] int64, row of the gathered [N * P] buffer holding token t (the kept copy)
    restore_indices: torch.Tensor
    # [N * P] int64, global token of each gathered row; -1: padding, non-kept copies
    gathered_token_indices: torch.Tensor
    query_start_loc: torch.Tensor  # [R + 1] int32, cumulative local query lengths
    # [R] int32, keys each row attends to: computed tokens + scheduled up to the row end
    seq_lens: torch.Tensor
    row_req_indices: torch.Tensor  # [R] int32, batch index of each row's request
    num_decode_rows: int  # the leading rows of at most decode_threshold query tokens
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
        """``[P]`` int64 global tokens of the model input: ``L`` local tokens, then pad
        rows (token 0). ``P`` rows on every rank line up the collectives inside the model
        (MoE all-gather and reduce-scatter) and avoid zero-token forwards; pad rows write
        no KV, attend to nothing and are dropped by the restore."""
        pad = self.num_padded_tokens_per_rank - self.num_local_tokens
        return torch.cat((self.local_token_indices,
                          self.local_token_indices.new_zeros(pad)))

    @property
    def is_split(self) -> bool:
        """False when no request is split (no collective is needed)."""
        return self.num_split_requests > 0


@dataclass(frozen=True)
class _RankRows:
    """The rows of one rank, in local order (numpy int64 arrays of one length)."""

    req: np.ndarray
    token_start: np.ndarray  # global index of the row's first token
    q_len: np.ndarray
    seq_len: np.ndarray


def indptr_of(lens) -> torch.Tensor:
    """``[len(lens) + 1]`` int32 run offsets: FlashInfer's ``qo_indptr`` / ``kv_indptr``."""
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


def _plan_rank_rows(computed: np.ndarray, scheduled: np.ndarray, token_start: np.ndarray,
                    split: np.ndarray, on_rank: np.ndarray, pcp_world_size: int,
                    pcp_rank: int, decode_threshold: int) -> _RankRows:
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
    """``[R]`` int64: the one rank computing each unsplit request (-1: every rank). With
    ``shard_decodes`` the i-th decode goes to rank ``i % N``; unsplit prefills stay on all."""
    owners = np.full(len(split), -1, dtype=np.int64)
    if shard_decodes and is_prefilling is not None:
        decodes = np.flatnonzero(~split & ~np.asarray(is_prefilling, dtype=bool))
        owners[decodes] = np.arange(len(decodes)) % pcp_world_size
    return owners


def split_requests(num_scheduled_tokens: Sequence[int], min_split_tokens: int,
                   prefill_lens: Sequence[int] | None = None,
                   min_chunk_tokens: int = 2) -> np.ndarray:
    """``[num_reqs]`` bool: at least ``min_chunk_tokens`` scheduled and a prefill of at
    least ``min_split_tokens`` (both at least 2). The prefill is ``prefill_lens`` (the
    prompt; more when a preempted request recomputes its output), else this step's
    tokens, so with it every chunk of a long prompt is split."""
    scheduled = np.asarray(num_scheduled_tokens, dtype=np.int64).reshape(-1)
    length = scheduled if prefill_lens is None else \
        np.asarray(prefill_lens, dtype=np.int64).reshape(-1)
    return (scheduled >= max(2, min_chunk_tokens)) & (length >= max(2, min_split_tokens))


def min_chunk_tokens(pcp_world_size: int, decode_threshold: int) -> int:
    """The shortest chunk split at DCP = 1: its 2N rows all exceed ``decode_threshold``.
    vLLM's FlashInfer attends shorter rows with its decode kernel, so a chunk one GPU
    attends as a prefill must stay one in every row (on SM90 with an fp8 cache the two
    kernels read queries in bf16 and fp8); a shorter chunk is computed whole."""
    return 2 * pcp_world_size * (decode_threshold + 1)


def build_pcp_metadata(num_computed_tokens: Sequence[int], num_scheduled_tokens: Sequence[int],
                       pcp_world_size: int, pcp_rank: int, *, min_split_tokens: int = 2,
                       decode_threshold: int = 1, prefill_lens: Sequence[int] | None = None,
                       min_chunk_tokens: int = 2, is_prefilling: Sequence[bool] | None = None,
                       shard_decodes: bool = False) -> PrefillContextParallelMetadata:
    """Plan one step for ``pcp_rank`` from each request's cached and scheduled tokens
    (batch order). Which requests split: :func:`split_requests`; which rank computes a
    decode under ``shard_decodes``: :func:`decode_owners`."""
    if not 0 <= pcp_rank < pcp_world_size:
        raise ValueError(f"pcp_rank {pcp_rank} outside [0, {pcp_world_size})")
    return build_pcp_metadata_all_ranks(
        num_computed_tokens, num_scheduled_tokens, pcp_world_size,
        min_split_tokens=min_split_tokens, decode_threshold=decode_threshold,
        prefill_lens=prefill_lens, min_chunk_tokens=min_chunk_tokens,
        is_prefilling=is_prefilling, shard_decodes=shard_decodes)[pcp_rank]


def build_pcp_metadata_all_ranks(
        num_computed_tokens: Sequence[int], num_scheduled_tokens: Sequence[int],
        pcp_world_size: int, *, min_split_tokens: int = 2, decode_threshold: int = 1,
        prefill_lens: Sequence[int] | None = None, min_chunk_tokens: int = 2,
        is_prefilling: Sequence[bool] | None = None, shard_decodes: bool = False,
        num_padded_tokens_per_rank: int | None = None) -> list[PrefillContextParallelMetadata]:
    """:func:`build_pcp_metadata` for every rank at once (one plan, N views);
    ``num_padded_tokens_per_rank``: ``P`` where a CUDA graph fixes it."""
    computed = np.asarray(num_computed_tokens, dtype=np.int64).reshape(-1)
    scheduled = np.asarray(num_scheduled_tokens, dtype=np.int64).reshape(-1)
    if computed.shape != scheduled.shape or (scheduled < 0).any() or (computed < 0).any():
        raise ValueError("need one non-negative computed and scheduled count per request")
    token_start = np.cumsum(scheduled) - scheduled
    split = split_requests(scheduled, min_split_tokens, prefill_lens, min_chunk_tokens)
    owners = decode_owners(split, is_prefilling, pcp_world_size, shard_decodes)
    rows = [_plan_rank_rows(computed, scheduled, token_start, split,
                            ~split & ((owners < 0) | (owners == r)), pcp_world_size, r,
                            decode_threshold) for r in range(pcp_world_size)]
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
        pcp_rank=rank, local_token_indices=torch.from_numpy(local_tokens),
        query_start_loc=indptr_of(rows.q_len),
        seq_lens=torch.from_numpy(rows.seq_len.astype(np.int32)),
        row_req_indices=torch.from_numpy(rows.req.astype(np.int32)),
        num_decode_rows=num_decode_rows,
        num_decode_tokens=int(rows.q_len[:num_decode_rows].sum()), **shared)


def _gathered_layout(local_tokens: list[np.ndarray], everywhere: np.ndarray,
                     padded: int) -> tuple[np.ndarray, np.ndarray]:
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
