"""Same-step prefix hits under DCP: context that the step itself writes.

vLLM 0.26.0 caches a request's blocks when it allocates them
(``KVCacheManager.allocate_slots`` -> ``cache_blocks``), so a request
scheduled beside another one (``n > 1``, a shared system prompt) can count as
computed tokens that the other request computes in this very step, on the same
blocks. That context is in the cache only after the step's cache write: a split
chunk that fetched it before the write (``context_exchange="keys"``) would read
stale slots, so :func:`vllm_pcp.dcp.plan.build_dcp_plan` sends such a request's
queries instead.

Prefix sharing is by whole blocks holding the same positions, so a block-id
test is exact: request i's context ``[0, C_i)`` lies in a block that another
request j writes (``[C_j, C_j + S_j)``). Under DCP (size D, interleave I) every
rank keeps a request's local token o in block-table entry ``o // block_size``
(vLLM's slot mapping: one entry spans ``block_size * D`` positions when I
divides the block size). Pure functions of the scheduler output and the block
table, which are the same on every rank.
"""
from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from vllm_pcp.dcp.layout import dcp_local_seq_len
from vllm_pcp.pcp.partition import expand_ranges


def _entry_ranges(first: np.ndarray, end: np.ndarray, block_size: int, world_size: int,
                  interleave: int) -> tuple[np.ndarray, np.ndarray]:
    """Block-table entries that hold positions ``[first, end)`` on each rank.

    Parameters
    ----------
    first, end : np.ndarray
        ``[R]`` int64, the positions of each request.

    Returns
    -------
    tuple of np.ndarray
        ``(start, stop)``, ``[D, R]`` int64 each: rank d keeps those positions in
        entries ``start[d, r] .. stop[d, r] - 1`` (none where ``stop == start``).
    """
    def local(positions):
        tensor = torch.from_numpy(positions)
        return np.stack([dcp_local_seq_len(tensor, d, world_size, interleave).numpy()
                         for d in range(world_size)])

    low, high = local(first), local(end)
    start = low // block_size
    stop = np.where(high > low, -(-high // block_size), start)
    return start, stop


def _block_ids(table: np.ndarray, reqs: np.ndarray, start: np.ndarray,
               stop: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``(request, block id)`` of every entry ``start[k] .. stop[k] - 1`` of row
    ``reqs[k]`` of ``table``, flat ``[E]`` int64 each."""
    lens = stop - start
    req = np.repeat(reqs, lens)
    return req, table[req, expand_ranges(start, lens)].astype(np.int64)


def _count_in(sorted_values: np.ndarray, values: np.ndarray) -> np.ndarray:
    """How often each of ``values`` occurs in ``sorted_values``."""
    return (np.searchsorted(sorted_values, values, side="right")
            - np.searchsorted(sorted_values, values, side="left"))


def context_written_in_step(num_computed_tokens: Sequence[int],
                            num_scheduled_tokens: Sequence[int], block_table: np.ndarray,
                            block_size: int, world_size: int, interleave: int,
                            tested: np.ndarray | None = None) -> np.ndarray:
    """Which requests have context in a block that another request writes this step.

    Parameters
    ----------
    num_computed_tokens, num_scheduled_tokens : Sequence[int]
        ``[R]``, the step's requests in batch order.
    block_table : np.ndarray
        ``[>= R, max_blocks]`` int, one KV cache group's block table (kernel
        blocks; vLLM's ``BlockTable.get_numpy_array()``), row r for request r.
    block_size : int
        Tokens of one kernel block on one rank (``BlockTable.block_size``).
    world_size, interleave : int
        DCP size and ``cp_kv_cache_interleave_size`` (1, 1 without DCP).
    tested : np.ndarray, optional
        ``[R]`` bool, the requests whose context to test (default: all); the
        others are no hit. Every request's writes count.

    Returns
    -------
    np.ndarray
        ``[R]`` bool. A request's own boundary block, which it both reads and
        writes, is no hit.
    """
    computed = np.asarray(num_computed_tokens, dtype=np.int64).reshape(-1)
    scheduled = np.asarray(num_scheduled_tokens, dtype=np.int64).reshape(-1)
    num_reqs = len(computed)
    hit = np.zeros(num_reqs, dtype=bool)
    reads_context = computed > 0
    if tested is not None:
        reads_context &= np.asarray(tested, dtype=bool).reshape(-1)
    readers = np.flatnonzero(reads_context)
    if num_reqs < 2 or not len(readers):
        return hit
    table, reqs = np.asarray(block_table)[:num_reqs], np.arange(num_reqs)
    _, context_stop = _entry_ranges(np.zeros_like(computed[readers]), computed[readers],
                                    block_size, world_size, interleave)
    ctx_req, ctx_ids = _block_ids(table, readers, np.zeros_like(readers),
                                  context_stop.max(0))
    write_start, write_stop = _entry_ranges(computed, computed + scheduled, block_size,
                                            world_size, interleave)
    write_req, write_ids = _block_ids(table, np.tile(reqs, world_size), write_start.ravel(),
                                      write_stop.ravel())
    shared = np.isin(ctx_ids, write_ids)
    if not shared.any():
        return hit
    ctx_req, ctx_ids = ctx_req[shared], ctx_ids[shared]
    writers = _count_in(np.sort(write_ids), ctx_ids)
    own_writes = _count_in(np.sort(write_ids * num_reqs + write_req),
                           ctx_ids * num_reqs + ctx_req)
    hit[ctx_req[writers > own_writes]] = True
    return hit
