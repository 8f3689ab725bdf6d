"""Index arithmetic :class:`vllm_pcp.dcp.attention.DCPAttention` plans with on the CPU:
paged-KV arguments of a shard, cache slots of the context sent, row sets of the layers."""
from __future__ import annotations

import numpy as np
import torch

from vllm_pcp.dcp.plan import AttentionRows, ContextGather, DCPAttentionPlan
from vllm_pcp.pcp.partition import expand_ranges, indptr_of


def paged_kv_layout(kv_len: torch.Tensor, block_table: torch.Tensor,
                    page_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """FlashInfer's paged-KV arguments for rows of ``kv_len [R]`` (CPU) local tokens over
    ``block_table [R, max_pages]``: int32 ``indptr [R + 1]`` and ``last_page_len [R]`` on the
    CPU, ``indices [sum pages]`` gathered by index on the table's device (no sync)."""
    kv_len = kv_len.numpy().astype(np.int64)
    pages = -(-kv_len // page_size)
    flat = expand_ranges(np.arange(len(kv_len)) * block_table.shape[1], pages)
    indices = block_table.reshape(-1).index_select(0, _to(flat, block_table.device))
    last = kv_len - np.maximum(pages - 1, 0) * page_size
    return indptr_of(pages), indices.to(torch.int32), torch.from_numpy(last.astype(np.int32))


def context_slots(gather: ContextGather, block_table: torch.Tensor,
                  page_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Page and slot (``[sum local_len]`` int64, table's device) of each context token sent:
    the first ``gather.local_len[g]`` of request ``gather.req[g]``'s shard."""
    lens = gather.local_len.numpy().astype(np.int64)
    offsets = expand_ranges(np.zeros_like(lens), lens)
    req = np.repeat(gather.req.numpy().astype(np.int64), lens)
    page_of, slot = np.divmod(offsets, page_size)
    flat = _to(req * block_table.shape[1] + page_of, block_table.device)
    return block_table.reshape(-1).index_select(0, flat).long(), _to(slot, block_table.device)


def _to(index: np.ndarray, device) -> torch.Tensor:
    """An int64 index array on ``device``, copied without waiting."""
    return torch.from_numpy(index.astype(np.int64, copy=False)).to(device, non_blocking=True)


def kept_rows(rows: AttentionRows, keep: torch.Tensor | None = None) -> AttentionRows:
    """The rows with keys (of those ``keep`` marks), with their query tokens."""
    keep = rows.kv_len.numpy() > 0 if keep is None else keep.numpy() & (rows.kv_len.numpy() > 0)
    lens = np.diff(rows.qo_indptr.numpy())
    per_token = np.repeat(keep, lens)
    return AttentionRows(rows.query_index[torch.from_numpy(per_token)], indptr_of(lens[keep]),
                         rows.req[torch.from_numpy(keep)], rows.kv_len[torch.from_numpy(keep)])


def owned_split_tokens(plan: DCPAttentionPlan) -> torch.Tensor | None:
    """Local positions of this rank's split-row queries that have context (CPU)."""
    rank, padded = plan.dcp_rank, plan.pcp.num_padded_tokens_per_rank
    index = plan.ctx_split.query_index
    mine = index[(index >= rank * padded) & (index < (rank + 1) * padded)] - rank * padded
    return mine if len(mine) else None


def rows_index(index: torch.Tensor, device) -> torch.Tensor | slice:
    """``index`` (CPU) as a slice where it is one run of rows (a view, not a gather), else
    on ``device``."""
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
