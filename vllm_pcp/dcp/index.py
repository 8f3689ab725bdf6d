"""Index arithmetic that :class:`vllm_pcp.dcp.attention.DCPAttention` plans with,
once per step on the CPU: FlashInfer's paged-KV arguments of a rank's shard, the
cache slots of the context a rank sends, and the row sets the layers read and
write (as slices where they are one run of rows). Pure functions of tensors."""
from __future__ import annotations

import torch

from vllm_pcp.dcp.plan import AttentionRows, ContextGather, DCPAttentionPlan
from vllm_pcp.pcp.partition import indptr_of


def paged_kv_layout(kv_len: torch.Tensor, block_table: torch.Tensor,
                    page_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """FlashInfer's paged-KV arguments for rows of ``kv_len`` local tokens.

    ``kv_len`` is ``[R]`` on the CPU; ``block_table`` is ``[R, max_pages]``
    (one row per attention row) on any device. Returns ``indptr [R + 1]`` and
    ``last_page_len [R]`` on the CPU and ``indices [sum pages]`` on the block
    table's device, all int32. The page list is gathered by index, so the
    device never has to report a count back (no synchronization).
    """
    kv_len = kv_len.long()
    pages = (kv_len + page_size - 1) // page_size
    indptr = indptr_of(pages)
    rows = torch.repeat_interleave(torch.arange(len(kv_len)), pages)
    cols = torch.arange(int(indptr[-1])) - indptr[:-1].long().repeat_interleave(pages)
    flat = (rows * block_table.shape[1] + cols).to(block_table.device, non_blocking=True)
    indices = block_table.reshape(-1).index_select(0, flat)
    last = kv_len - (pages - 1).clamp(min=0) * page_size
    return indptr, indices.to(torch.int32), last.to(torch.int32)


def context_slots(gather: ContextGather, block_table: torch.Tensor,
                  page_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Page and in-page slot of each context token this rank sends: the first
    ``gather.local_len[g]`` tokens of request ``gather.req[g]``'s shard, request
    after request; both ``[sum local_len]`` int64 on the block table's device."""
    lens = gather.local_len.long()
    starts = torch.cumsum(lens, 0) - lens
    offsets = torch.arange(int(lens.sum())) - starts.repeat_interleave(lens)
    req = gather.req.long().repeat_interleave(lens)
    flat = (req * block_table.shape[1] + offsets // page_size).to(block_table.device,
                                                                 non_blocking=True)
    page = block_table.reshape(-1).index_select(0, flat).long()
    return page, (offsets % page_size).to(block_table.device, non_blocking=True)


def kept_rows(rows: AttentionRows, keep: torch.Tensor | None = None) -> AttentionRows:
    """The rows with keys (kv_len 0 rows dropped, with their query tokens), of those
    ``keep`` marks if given."""
    keep = rows.kv_len > 0 if keep is None else keep & (rows.kv_len > 0)
    lens = (rows.qo_indptr[1:] - rows.qo_indptr[:-1])[keep]
    per_token = torch.repeat_interleave(keep, rows.qo_indptr[1:] - rows.qo_indptr[:-1])
    indptr = indptr_of(lens)
    return AttentionRows(rows.query_index[per_token], indptr, rows.req[keep], rows.kv_len[keep])


def owned_split_tokens(plan: DCPAttentionPlan) -> torch.Tensor | None:
    """Local positions of this rank's split-row queries that have context (CPU)."""
    rank, padded = plan.dcp_rank, plan.pcp.num_padded_tokens_per_rank
    index = plan.ctx_split.query_index
    mine = index[(index >= rank * padded) & (index < (rank + 1) * padded)] - rank * padded
    return mine if len(mine) else None


def rows_index(index: torch.Tensor, device) -> torch.Tensor | slice:
    """``index`` (CPU, ascending rows or not) as a slice where it is one run of
    consecutive rows, so that reading and writing those rows is a view and a copy
    rather than a gather and a scatter; else the index on ``device``."""
    n = len(index)
    if n and int(index[-1]) - int(index[0]) == n - 1 and bool((index.diff() == 1).all()):
        return slice(int(index[0]), int(index[0]) + n)
    return index.to(device, non_blocking=True)


def positions_in(haystack: torch.Tensor, needles: torch.Tensor) -> torch.Tensor:
    """Position in ``haystack`` (distinct values) of each value of ``needles``."""
    lookup = torch.full((int(haystack.max()) + 1,), -1, dtype=torch.int64,
                        device=haystack.device)
    lookup[haystack] = torch.arange(len(haystack), device=haystack.device)
    return lookup[needles]
