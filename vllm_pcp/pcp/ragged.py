"""FlashInfer's ragged prefill for the new tokens of a split step (DCP = 1).

On a step whose requests have no cached context (fresh prompts, their first
chunk), every key a local row attends to is one of the step's own tokens, and
after the K/V all-gather every rank holds all of them. The row can then attend
the gathered K/V with FlashInfer's ragged kernel instead of reading the paged
cache, which ``benchmarks/results/kernel-choice.json`` measured 1.16-1.21x faster
for the slowest rank at 2 x 32K, 4 x 32K and 2 x 128K::

    gathered K/V   [rank 0: c0 c3 | pad][rank 1: c1 c2 | pad]     (N = 2, one prompt)
    row (c2, rank 1)  keys c0 c1 c2  ->  rows 0.., P.., P+|c1|..  of the buffer
    ragged kernel  causal, bottom-right: the row's queries are its last keys

Each row's keys are its request's step tokens ``0 .. row end`` in position
order, named as rows of the gathered buffer (:func:`ragged_kv_rows`); the layer
gathers them with one ``index_select`` per K and V. Steps with context (chunked
prefills after the first chunk, prefix hits, decodes in the batch) keep the
paged kernel: their earlier keys are only in the cache.

The two kernels round differently, so a ragged step is not bit-equal to one
GPU's paged prefill (within one bf16 ulp of the output in kernel-choice);
``--additional-config '{"pcp_split_attention": "paged"}'`` keeps the paged
kernel on every step.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from vllm_pcp.pcp.fence import PlanFence
from vllm_pcp.pcp.partition import PrefillContextParallelMetadata, expand_ranges, indptr_of


def is_fresh_step(num_computed_tokens: Sequence[int]) -> bool:
    """True when no request of the step has tokens in the cache from earlier steps:
    every key of the step is one of its own tokens. Scheduler output only, so the
    same on every rank."""
    computed = np.asarray(num_computed_tokens, dtype=np.int64).reshape(-1)
    return len(computed) > 0 and not computed.any()


def ragged_kv_rows(plan: PrefillContextParallelMetadata,
                   num_scheduled_tokens: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """The keys of each local row of a fresh step, as rows of the K/V all-gather's buffer.

    Parameters
    ----------
    plan : PrefillContextParallelMetadata
        The step's split, seen from this rank; no request has context.
    num_scheduled_tokens : Sequence[int]
        ``[num_reqs]``, the step's tokens of each request (global token order).

    Returns
    -------
    kv_rows : torch.Tensor
        ``[K]`` int64, row of the gathered ``[N * P]`` buffer of each key, row after
        row: local row j reads its request's tokens ``0 .. seq_lens[j]``.
    kv_indptr : torch.Tensor
        ``[R + 1]`` int32, cumulative key counts.
    """
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
    """A fresh split step's ragged kernel, planned once for every layer of a KV cache
    group; valid until the wrapper's next :meth:`RaggedSplitAttention.plan`.

    ``kv_rows`` is None on a rank without local rows: its layers still gather and
    write the step's K/V, and attend nothing."""

    wrapper: object  # FlashInfer's BatchPrefillWithRaggedKVCacheWrapper, planned
    kv_rows: torch.Tensor | None  # [K] int64 on the device
    num_local_tokens: int

    def run(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
            out: torch.Tensor) -> None:
        """``query [L, Hq, D]`` local rows; ``key``/``value [N * P, Hkv, D]`` the
        gathered buffer; ``out [L, Hq, D]`` written in place."""
        if self.kv_rows is not None:
            self.wrapper.run(query, key.index_select(0, self.kv_rows),
                             value.index_select(0, self.kv_rows), out=out)


class RaggedSplitAttention:
    """FlashInfer's ragged prefill wrapper of one KV cache group: :meth:`plan` a fresh
    step once, run it in every layer."""

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
        """Plan the local rows of a fresh step (:func:`is_fresh_step`); index arguments
        stay on the CPU (FlashInfer plans on the host), the key rows go to ``device``."""
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
