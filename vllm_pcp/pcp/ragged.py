"""FlashInfer's ragged prefill for the new tokens of a split step (DCP = 1).

On a fresh step (no cached context), every key of a local row is a step token, on every
rank after the K/V all-gather, so the row attends the gathered K/V with the ragged kernel
instead of the paged cache: 1.16-1.21x faster for the slowest rank at 2 x 32K, 4 x 32K and
2 x 128K (``benchmarks/results/kernel-choice.json``)::

    gathered K/V   [rank 0: c0 c3 | pad][rank 1: c1 c2 | pad]     (N = 2, one prompt)
    row (c2, rank 1)  keys c0 c1 c2  ->  rows 0.., P.., P+|c1|..  of the buffer
    ragged kernel  causal, bottom-right: the row's queries are its last keys

Steps with context keep the paged kernel. The kernels round differently, so a ragged step
is not bit-equal to one GPU's paged prefill (within one bf16 ulp);
``--additional-config '{"pcp_split_attention": "paged"}'`` keeps the paged kernel.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from vllm_pcp.pcp.fence import PlanFence
from vllm_pcp.pcp.partition import PrefillContextParallelMetadata, expand_ranges, indptr_of


def ragged_kv_rows(plan: PrefillContextParallelMetadata,
                   num_scheduled_tokens: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """The keys of each local row of a fresh step: ``kv_rows [K]`` int64 rows of the
    gathered ``[N * P]`` buffer, row after row (row j: its request's tokens
    ``0 .. seq_lens[j]``), and ``kv_indptr [R + 1]`` int32."""
    scheduled = np.asarray(num_scheduled_tokens, dtype=np.int64).reshape(-1)
    token_start = np.cumsum(scheduled) - scheduled
    rows_req = plan.row_req_indices.numpy().astype(np.int64)
    kv_lens = plan.seq_lens.numpy().astype(np.int64)
    tokens = expand_ranges(token_start[rows_req], kv_lens)
    kv_rows = plan.restore_indices[torch.from_numpy(tokens)] if len(tokens) else \
        torch.zeros(0, dtype=torch.int64)
    return kv_rows, indptr_of(kv_lens)


@dataclass
class PlannedRaggedStep:
    """A fresh split step's ragged kernel, planned once for a KV cache group's layers;
    valid until the next plan. ``kv_rows`` None: no local rows, nothing to attend."""

    wrapper: object  # FlashInfer's BatchPrefillWithRaggedKVCacheWrapper, planned
    kv_rows: torch.Tensor | None  # [K] int64 on the device
    num_local_tokens: int

    def run(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
            out: torch.Tensor) -> None:
        """``query``/``out [L, Hq, D]``, ``key``/``value [N * P, Hkv, D]`` gathered."""
        if self.kv_rows is not None:
            self.wrapper.run(query, key.index_select(0, self.kv_rows),
                             value.index_select(0, self.kv_rows), out=out)


class RaggedSplitAttention:
    """The ragged wrapper of one KV cache group: :meth:`plan` a fresh step once."""

    def __init__(self, workspace: torch.Tensor, num_qo_heads: int, num_kv_heads: int,
                 head_dim: int, dtype: torch.dtype, sm_scale: float):
        import flashinfer

        self.heads = (num_qo_heads, num_kv_heads, head_dim)
        self.dtype, self.sm_scale = dtype, sm_scale
        self._wrapper = flashinfer.BatchPrefillWithRaggedKVCacheWrapper(workspace, "NHD",
                                                                        backend="auto")
        self._fence = PlanFence()  # the wrapper's host buffer, between two steps' plans

    def plan(self, plan: PrefillContextParallelMetadata, num_scheduled_tokens: Sequence[int],
             device: torch.device) -> PlannedRaggedStep:
        """Plan the local rows of a fresh step on the host; key rows go to ``device``."""
        if not plan.num_rows:
            return PlannedRaggedStep(self._wrapper, None, 0)
        kv_rows, kv_indptr = ragged_kv_rows(plan, num_scheduled_tokens)
        hq, hkv, dim = self.heads
        self._fence.wait()
        self._wrapper.plan(plan.query_start_loc, kv_indptr, hq, hkv, dim, causal=True,
                           sm_scale=self.sm_scale, q_data_type=self.dtype,
                           kv_data_type=self.dtype, o_data_type=self.dtype)
        self._fence.record(device)
        return PlannedRaggedStep(self._wrapper, kv_rows.to(device, non_blocking=True),
                                 plan.num_local_tokens)
