"""The PCP manager for GQA models: vLLM's Model Runner V2 ``PCPManager`` with vllm-pcp's split.

vLLM's manager builds the local batches, the gathered slot mapping, the restore of the
hidden states and the CUDA graph sizes. This subclass changes which requests are split
(:mod:`vllm_pcp.pcp.partition`); runs an unsplit step with decodes on every rank
(``replicate``) with no collective, each rank writing its own K/V and keeping its own
hidden states; and carries the split (:class:`PCPStep`, ``input_batch.pcp``) to vllm-pcp's
attention metadata builder::

    global batch  [decodes | short prompt | long prompt: c0 c1 c2 c3]        N = 2
    rank 0 rows   [decodes | short prompt | c0 | c3]     (replicate policy)
    rank 1 rows   [decodes | short prompt | c1 | c2]
    gathered K/V  [rank 0 rows | pad][rank 1 rows | pad]  rank 0's copy written, restored
"""
from __future__ import annotations

from dataclasses import dataclass, fields, replace

import numpy as np
import torch
from vllm.config import CUDAGraphMode, get_current_vllm_config_or_none
from vllm.logger import init_logger
from vllm.utils.torch_utils import async_tensor_h2d
from vllm.v1.attention.backends.utils import PAD_SLOT_ID
from vllm.v1.worker.gpu.pcp_manager import PCPBatchMetadata, PCPManager, RankSegment

from vllm_pcp.pcp.counts import PCPStepCounts
from vllm_pcp.pcp.partition import PrefillContextParallelMetadata, build_pcp_metadata_all_ranks
from vllm_pcp.knobs import PCPSettings

logger = init_logger("vllm.vllm_pcp.manager")


@dataclass(frozen=True)
class PCPStep:
    """One step's split, carried in the local batch to the attention metadata builder."""

    plans: tuple[PrefillContextParallelMetadata, ...]  # every rank's view of the split
    pcp_rank: int
    num_computed_tokens: np.ndarray  # [R] int64, global batch order
    num_scheduled_tokens: np.ndarray  # [R] int64
    gathered: bool  # the layers all-gather the K/V (False: every rank computes every token)

    @property
    def plan(self) -> PrefillContextParallelMetadata:
        return self.plans[self.pcp_rank]

    @property
    def is_fresh(self) -> bool:
        """No request has tokens cached by earlier steps: every key is a step token."""
        return bool(len(self.num_computed_tokens)) and not self.num_computed_tokens.any()

    def first_local_row(self) -> np.ndarray:
        """``[R]`` int64, this rank's first local row of each request (-1: none here)."""
        req = self.plan.row_req_indices.numpy()
        out = np.full(len(self.num_scheduled_tokens), -1, dtype=np.int64)
        out[req[::-1]] = np.arange(len(req))[::-1]
        return out


@dataclass(frozen=True)
class PCPStepBatchMetadata(PCPBatchMetadata):
    """vLLM's per-step PCP metadata of the local batch, with the step's split."""

    step: PCPStep | None = None


def _segments(plan: PrefillContextParallelMetadata) -> list[RankSegment]:
    """A rank's rows as vLLM's segments: global token range and local token range."""
    qsl = plan.query_start_loc.numpy()
    local = plan.local_token_indices.numpy()
    return [RankSegment(global_batch_req_idx=int(req),
                        global_batch_slice=slice(int(local[lo]), int(local[lo]) + hi - lo),
                        rank_local_batch_slice=slice(int(lo), int(hi)))
            for req, lo, hi in zip(plan.row_req_indices.tolist(), qsl[:-1], qsl[1:])]


class GQAPCPManager(PCPManager):
    """vLLM's MRV2 PCP manager for GQA models on vllm-pcp's FlashInfer backend."""

    @staticmethod
    def validate_config(vllm_config, supports_mm_inputs: bool) -> None:
        from vllm_pcp.config import check_pcp_config

        check_pcp_config(vllm_config, supports_mm_inputs)

    def __init__(self, *args, settings: PCPSettings | None = None, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        if settings is None:
            vllm_config = get_current_vllm_config_or_none()
            if vllm_config is None:
                raise RuntimeError("GQAPCPManager reads its settings from the current "
                                   "vLLM config: build it inside set_current_vllm_config")
            settings = PCPSettings.from_vllm_config(vllm_config)
        self.settings = settings
        self.shard_decode_requests = settings.shard_decodes
        self.step_counts = PCPStepCounts()
        self._plans: tuple[PrefillContextParallelMetadata, ...] | None = None
        self._unsplit_local = False
        logger.info("vllm-pcp: rank %d of %d, prompts of >= %d tokens split, decodes %s, "
                    "KV cache %s", self.pcp_rank, self.pcp_world_size,
                    self.settings.min_split_tokens, self.settings.decode_policy,
                    "sharded (DCP)" if self.dcp_world_size > 1 else "whole on every rank")

    def plan_split(self, num_computed_tokens, num_scheduled_tokens, is_prefilling,
                   prefill_lens=None, num_padded_tokens_per_rank: int | None = None
                   ) -> list[PrefillContextParallelMetadata]:
        """Every rank's view of the step's split. Without ``prefill_lens`` this step's
        tokens stand for each prompt's length: fewer splits, no rank gets fewer tokens."""
        s = self.settings
        return build_pcp_metadata_all_ranks(
            num_computed_tokens, num_scheduled_tokens, self.pcp_world_size,
            min_split_tokens=s.min_split_tokens, decode_threshold=s.decode_threshold,
            prefill_lens=prefill_lens, min_chunk_tokens=s.min_chunk_tokens,
            is_prefilling=is_prefilling, shard_decodes=s.shard_decodes,
            num_padded_tokens_per_rank=num_padded_tokens_per_rank)

    def get_num_tokens_for_dispatch(self, num_scheduled_tokens, is_prefilling) -> int:
        """An upper bound of the largest local batch (prompt lengths unknown here)."""
        scheduled = np.asarray(num_scheduled_tokens, dtype=np.int64)
        plans = self.plan_split(np.zeros_like(scheduled), scheduled, is_prefilling)
        return max(plans[0].num_tokens_per_rank)

    def partition_batch(self, input_batch, batch_desc):
        """vLLM's partition of the global batch, with :meth:`plan_split`'s split."""
        padded = (batch_desc.num_tokens if batch_desc.cg_mode != CUDAGraphMode.NONE
                  else None)
        computed = input_batch.num_computed_tokens_np.astype(np.int64)
        scheduled = np.asarray(input_batch.num_scheduled_tokens, dtype=np.int64)
        plans = tuple(self.plan_split(computed, scheduled, input_batch.is_prefilling_np,
                                      input_batch.prefill_len_np, padded))
        self._plans = plans  # read by _build_batch_layout, within this call
        try:
            local = super().partition_batch(input_batch, batch_desc)
        finally:
            self._plans = None
        step = PCPStep(plans, self.pcp_rank, computed, scheduled,
                       gathered=not self._unsplit_local)
        self.step_counts.count(step)
        metadata = {f.name: getattr(local.pcp, f.name) for f in fields(PCPBatchMetadata)}
        return replace(local, pcp=PCPStepBatchMetadata(**metadata, step=step))

    def _build_batch_layout(self, num_scheduled_tokens, num_computed_tokens, is_prefilling,
                            query_start_loc_np, padded_num_tokens=None):
        """The gathered layout of :meth:`partition_batch`'s split: vLLM's segments, the
        rows gathered, each token's copy written and restored. A step that splits nothing
        with every token on every rank stays local: no restore, each writes its own K/V."""
        plans = self._plans
        if plans is None:
            raise RuntimeError("GQAPCPManager lays out only the batch of partition_batch")
        padded = plans[0].num_padded_tokens_per_rank
        local = plans[self.pcp_rank]
        self._unsplit_local = (self.settings.unsplit_steps_local and not local.is_split
                               and len(local.local_token_indices) == local.num_tokens
                               and bool((local.local_token_indices
                                         == torch.arange(local.num_tokens)).all()))
        gather = torch.cat([plan.model_input_indices for plan in plans])
        write = plans[0].gathered_token_indices >= 0
        if self._unsplit_local:  # every rank writes its own copy of each token
            write = torch.cat([torch.arange(padded) < plan.num_local_tokens for plan in plans])
        self._padded_gather_idx = async_tensor_h2d(gather.numpy(), device=self.device)
        self._gathered_kv_write_mask = async_tensor_h2d(write.numpy(), device=self.device)
        self._hidden_restore_idx = None if self._unsplit_local else async_tensor_h2d(
            local.restore_indices.numpy(), device=self.device)
        return [_segments(plan) for plan in plans], list(plans[0].num_tokens_per_rank)

    def _convert_to_gathered_slot_mappings(self, global_batch_slot_mappings):
        """vLLM's gathered slot mapping ``[groups, N * P]``; on a local step ``[groups, P]``."""
        if not self._unsplit_local:
            return super()._convert_to_gathered_slot_mappings(global_batch_slot_mappings)
        rows = self._local_gather_idx.shape[0]
        start = self.pcp_rank * rows
        out = self._gathered_kv_slot_mappings[:, :rows]
        torch.index_select(global_batch_slot_mappings, 1, self._local_gather_idx, out=out)
        mask = self._gathered_kv_write_mask[start:start + rows]
        torch.where(mask.unsqueeze(0), out, self._pad_slot_id, out=out)
        return out

    def get_dummy_slot_mappings(self, num_tokens: int) -> torch.Tensor:
        """The slot mapping of the steps dummy and capture runs stand for: with local
        unsplit steps (the only ones full graphs replay), the local layout, at the
        address a replay writes."""
        if not self.settings.unsplit_steps_local:
            return super().get_dummy_slot_mappings(num_tokens)
        self._gathered_kv_slot_mappings.fill_(PAD_SLOT_ID)
        return self._gathered_kv_slot_mappings[:, :num_tokens]
