"""V1 model runner with prefill context parallelism for GQA models.

Why V1: vLLM 0.26.0 sends every non-MLA PCP config to the V1
``GPUModelRunner`` (Model Runner V2's PCP manager is MLA-only), and V1 exposes
the two seams needed here, ``_build_attention_metadata`` and
``_model_forward``, so the subclass adds PCP without touching the rest of
the step (scheduling state, sampling, async output, logprobs).

One step is one :class:`PCPStep`::

    execute_model (stock)
      _prepare_inputs     stock global ids, positions, slot mapping; then the
                          step planned from the scheduler output (the same on
                          every rank): its split (partition.build_pcp_metadata)
                          or its DCP plan (dcp.plan.build_dcp_plan)
      _build_attention_metadata
                          one metadata object per KV cache group carries the
                          step to the layers (backend.PCPSplitMetadata /
                          PCPDCPMetadata: K/V exchange, gathered slot mapping,
                          the FlashInfer plan); the step gets its model inputs
      _model_forward      model on the local tokens only; every attention layer
                          all-gathers K/V before its cache write; the hidden
                          states are all-gathered and restored to global order
      sample (stock)      identical logits on every rank

Steps without a split request (decodes, short prefills) run stock on every
rank. Split steps run without CUDA graphs: the local token count is not a
captured size.

With ``-dcp N`` (equal to ``-pcp N``, or inside TP at PCP = 1) every step is
planned with :func:`vllm_pcp.dcp.plan.build_dcp_plan` and attended by
:class:`vllm_pcp.dcp.attention.DCPAttention`; a pure decode step runs the stock
forward and replays a full CUDA graph (FULL_DECODE_ONLY) planned into fixed
buffers, every other DCP step runs eagerly (docs/design.md).
"""
from __future__ import annotations

import sys
from dataclasses import dataclass

import numpy as np
import torch
from vllm.config import CUDAGraphMode
from vllm.distributed.parallel_state import get_dcp_group, get_pcp_group
from vllm.forward_context import get_forward_context
from vllm.logger import init_logger
from vllm.v1.attention.backend import CommonAttentionMetadata
from vllm.v1.worker.gpu_model_runner import GPUModelRunner

from vllm_pcp.backend import KVExchange, PCPFlashInferMetadataBuilder, PCPSplitMetadata
from vllm_pcp.knobs import PCPKnobs, min_split_tokens
from vllm_pcp.dcp.plan import DCPAttentionPlan, build_dcp_plan, min_folded_seq_len
from vllm_pcp.dcp.prefix import context_written_in_step
from vllm_pcp.pcp.agreement import SampledTokenCheck
from vllm_pcp.pcp.counts import PCPStepCounts
from vllm_pcp.pcp.exchange import (gathered_slot_mapping, restore_hidden_states,
                                   with_context_rows)
from vllm_pcp.pcp.memory import split_step_reserve_bytes
from vllm_pcp.pcp.partition import (PrefillContextParallelMetadata, build_pcp_metadata,
                                    min_chunk_tokens, split_requests)
from vllm_pcp.pcp.ragged import is_fresh_step

logger = init_logger("vllm.vllm_pcp.runner")


@dataclass
class SplitInputs:
    """A split step's model inputs on the device: what ``_model_forward`` runs."""

    model_input_indices: torch.Tensor  # [P] int64: local tokens, then pad rows
    restore_indices: torch.Tensor  # [T] int64
    num_padded_tokens_per_rank: int


@dataclass
class PCPStep:
    """One engine step as the plugin runs it.

    Planned by ``_prepare_inputs`` from the scheduler output (so the same on
    every rank), completed by ``_build_attention_metadata`` and consumed by
    ``_model_forward``; a step without it runs stock.
    """

    plan: PrefillContextParallelMetadata | DCPAttentionPlan
    inputs: SplitInputs | None = None  # set for steps whose tokens are split
    eager: bool = False  # a batch vLLM padded for a CUDA graph that must run eagerly
    # a fresh split step at DCP = 1 that may attend with the ragged kernel: its
    # scheduled tokens per request (vllm_pcp.pcp.ragged)
    ragged_scheduled: np.ndarray | None = None


class PCPModelRunner(GPUModelRunner):
    def __init__(self, vllm_config, device: torch.device):
        super().__init__(vllm_config, device)
        self.pcp_group = get_pcp_group()
        self.pcp_world_size = self.pcp_group.world_size
        self.pcp_rank = self.pcp_group.rank_in_group
        knobs = PCPKnobs.from_additional_config(vllm_config.additional_config)
        self.pcp_min_split_tokens = min_split_tokens(knobs, self.pcp_world_size)
        self.pcp_dcp_context_exchange = knobs.dcp_context_exchange
        self.pcp_split_attention = knobs.split_attention
        self.pcp_dcp = self._check_dcp(vllm_config)
        self._step: PCPStep | None = None  # from _prepare_inputs to _model_forward
        self.pcp_step_counts = PCPStepCounts()
        self.pcp_sampled_tokens = SampledTokenCheck.from_env(self.pcp_group)
        logger.info("PCP model runner: rank %d of %d, prefills of >= %d tokens are split, "
                    "KV cache %s", self.pcp_rank, self.pcp_world_size,
                    self.pcp_min_split_tokens,
                    "sharded (DCP)" if self.pcp_dcp else "whole on every rank")

    def _check_dcp(self, vllm_config) -> bool:
        """True when the KV cache is sharded: over the PCP ranks (DCP == PCP), or at
        PCP = 1 over vLLM's DCP group inside TP (query heads gathered)."""
        dcp = vllm_config.parallel_config.decode_context_parallel_size
        if dcp == 1:
            return False
        self.dcp_group = get_dcp_group()
        self.dcp_heads_gathered = self.pcp_world_size == 1
        if not self.dcp_heads_gathered and self.dcp_group.ranks != self.pcp_group.ranks:
            raise RuntimeError(f"DCP group {self.dcp_group.ranks} differs from PCP group "
                               f"{self.pcp_group.ranks}: this layout is not supported")
        self.cp_kv_cache_interleave_size = (
            vllm_config.parallel_config.cp_kv_cache_interleave_size)
        block_size = vllm_config.cache_config.block_size
        if block_size and block_size % self.cp_kv_cache_interleave_size:
            raise ValueError(f"--cp-kv-cache-interleave-size "
                             f"{self.cp_kv_cache_interleave_size} must divide the KV block "
                             f"size {block_size} (--block-size)")
        return True

    def _prepare_inputs(self, scheduler_output, num_scheduled_tokens):
        result = super()._prepare_inputs(scheduler_output, num_scheduled_tokens)
        num_reqs = self.input_batch.num_reqs
        computed = self.input_batch.num_computed_tokens_cpu[:num_reqs]
        scheduled = num_scheduled_tokens[:num_reqs]
        # a prompt's length decides, so that every chunk of a long one is split
        prefill_lens = np.maximum(self.input_batch.num_prompt_tokens[:num_reqs],
                                  computed + scheduled)
        self._step = None
        if self.pcp_dcp:  # a sharded cache needs the plugin's attention every step
            self._step = PCPStep(self._plan_dcp_step(
                computed, scheduled, prefill_lens,
                self._context_written_in_step(computed, scheduled, prefill_lens)))
        else:
            threshold = self.reorder_batch_threshold or 1
            chunk = min_chunk_tokens(self.pcp_world_size, threshold)
            if split_requests(scheduled, self.pcp_min_split_tokens, prefill_lens, chunk).any():
                # the same test build_pcp_metadata splits by: the plan is a split one
                self._step = PCPStep(build_pcp_metadata(
                    computed, scheduled, self.pcp_world_size, self.pcp_rank,
                    min_split_tokens=self.pcp_min_split_tokens, decode_threshold=threshold,
                    prefill_lens=prefill_lens, min_chunk_tokens=chunk))
                if self.pcp_split_attention == "auto" and is_fresh_step(computed):
                    self._step.ragged_scheduled = np.array(scheduled, dtype=np.int64)
        if self._step is not None:
            plan = self._step.plan
            self.pcp_step_counts.count(plan.pcp if isinstance(plan, DCPAttentionPlan) else plan)
        return result

    def _plan_dcp_step(self, num_computed_tokens, num_scheduled_tokens,
                       prefill_lens=None, context_written_in_step=None) -> DCPAttentionPlan:
        """The step's plan over the DCP group; at PCP = 1 no prefill is split (every
        rank runs every token, with its own query heads). ``context_written_in_step``:
        see :meth:`_context_written_in_step`."""
        return build_dcp_plan(
            num_computed_tokens, num_scheduled_tokens, self.dcp_group.world_size,
            self.dcp_group.rank_in_group, self.cp_kv_cache_interleave_size,
            min_split_tokens=sys.maxsize if self.dcp_heads_gathered else
            self.pcp_min_split_tokens, prefill_lens=prefill_lens,
            context_exchange=self.pcp_dcp_context_exchange,
            kv_to_q_heads=self.model_config.get_num_kv_heads(self.parallel_config)
            / self.num_query_heads, context_written_in_step=context_written_in_step)

    def _context_written_in_step(self, num_computed_tokens, num_scheduled_tokens,
                                 prefill_lens):
        """``[R]`` bool: split requests with context in a block that another request of
        the step writes (a prefix hit on blocks vLLM cached when it allocated them), in
        any KV cache group; read from the CPU block tables, the same on every rank.
        None where no split chunk could fetch its context (``queries``; DCP inside
        TP; no split request with context, e.g. decode steps)."""
        if self.pcp_dcp_context_exchange == "queries" or self.dcp_heads_gathered:
            return None
        tested = split_requests(num_scheduled_tokens, self.pcp_min_split_tokens,
                                prefill_lens) & (num_computed_tokens > 0)
        if not tested.any():
            return None
        hit = np.zeros(len(num_computed_tokens), dtype=bool)
        for gid in range(len(self.kv_cache_config.kv_cache_groups)):
            table = self.input_batch.block_table[gid]
            hit |= context_written_in_step(
                num_computed_tokens, num_scheduled_tokens, table.get_numpy_array(),
                table.block_size, self.dcp_group.world_size, self.cp_kv_cache_interleave_size,
                tested)
        return hit

    def _build_attention_metadata(self, *args, **kwargs):
        step, self._step = self._step, None
        if kwargs.get("for_cudagraph_capture"):
            if self.pcp_dcp:
                return self._build_dcp_capture_metadata(kwargs["num_reqs"]), None
            return super()._build_attention_metadata(*args, **kwargs)
        if step is None or kwargs.get("ubatch_slices"):
            return super()._build_attention_metadata(*args, **kwargs)
        plan = step.plan
        if isinstance(plan, DCPAttentionPlan):
            if plan.decode is not None:  # num_reqs_padded: vLLM replays a full graph
                metadata = self._build_dcp_decode_metadata(plan, kwargs.get("num_reqs_padded"))
            elif self.dcp_heads_gathered:  # stock forward, never a graph replay
                step.eager = True
                metadata = self._build_dcp_decode_metadata(plan)
            else:
                metadata, step.inputs = self._build_dcp_split_metadata(plan,
                                                                       kwargs["slot_mappings"])
        else:
            metadata, step.inputs = self._build_split_metadata(plan, kwargs["slot_mappings"],
                                                               step.ragged_scheduled)
        self._step = step  # for _model_forward
        return metadata, None

    @staticmethod
    def _split_inputs(plan: PrefillContextParallelMetadata, device) -> SplitInputs:
        return SplitInputs(plan.model_input_indices.to(device, non_blocking=True),
                           plan.restore_indices.to(device, non_blocking=True),
                           plan.num_padded_tokens_per_rank)

    def _build_dcp_split_metadata(self, plan: DCPAttentionPlan,
                                  slot_mappings: dict[int, torch.Tensor]):
        """Per-layer PCP x DCP metadata and the step's inputs. vLLM's slot mapping
        already holds -1 for tokens another DCP rank owns."""
        dev, pcp = self.device, plan.pcp
        gathered, num_context_rows = pcp.gathered_token_indices, 0
        if plan.ctx_gather is not None:  # context rows ride in the K/V exchange's buffer
            num_context_rows = plan.ctx_gather.num_padded
            gathered = with_context_rows(gathered, pcp.num_padded_tokens_per_rank,
                                         num_context_rows)
        gathered = gathered.to(dev, non_blocking=True)
        exchange = KVExchange(self.pcp_group, pcp.num_padded_tokens_per_rank, num_context_rows)
        attn_metadata = {}
        num_reqs = self.input_batch.num_reqs
        for gid, _ in enumerate(self.kv_cache_config.kv_cache_groups):
            table = self.input_batch.block_table[gid].get_device_tensor(num_reqs)
            slots = gathered_slot_mapping(slot_mappings[gid], gathered)
            for attn_group in self.attn_groups[gid]:
                metadata = self._pcp_builder(attn_group).build_dcp(
                    plan, table, self.dcp_group, False, exchange, slots)
                for name in attn_group.layer_names:
                    attn_metadata[name] = metadata
        return attn_metadata, self._split_inputs(pcp, dev)

    def _build_dcp_decode_metadata(self, plan: DCPAttentionPlan,
                                   graph_rows: int | None = None) -> dict:
        """A step where every rank runs every token (a pure decode step; any step at
        PCP = 1): each writes the tokens it owns with vLLM's slot mapping, and has
        no split inputs (nothing to restore). ``graph_rows``: the batch size of the
        full CUDA graph the step replays."""
        attn_metadata = {}
        num_rows = graph_rows or self.input_batch.num_reqs
        for gid, _ in enumerate(self.kv_cache_config.kv_cache_groups):
            table = self.input_batch.block_table[gid].get_device_tensor(num_rows)
            for attn_group in self.attn_groups[gid]:
                metadata = self._pcp_builder(attn_group).build_dcp(
                    plan, table, self.dcp_group, self.dcp_heads_gathered,
                    graph_rows=graph_rows)
                for name in attn_group.layer_names:
                    attn_metadata[name] = metadata
        return attn_metadata

    def _build_dcp_capture_metadata(self, num_reqs: int) -> dict:
        """Capture of a decode graph: vLLM's dummy decode batch planned as a folded
        decode step. Its rows are made long enough for every rank to hold a token:
        vLLM's memory profiling captures with its token budget over the batch size
        (16 at 8192 / 512), shorter than ``interleave * (N - 1)`` for large
        interleaves; a replay plans its own batch, so the lengths only need to be valid."""
        seq_lens = self.optimistic_seq_lens_cpu[:num_reqs].numpy().astype(np.int64)
        seq_lens = seq_lens[seq_lens > 0]  # rows past the dummy batch: graph padding
        if not len(seq_lens):
            raise RuntimeError(f"CUDA graph capture of {num_reqs} decode rows without "
                               "sequences; run with --enforce-eager")
        seq_lens = np.maximum(seq_lens, min_folded_seq_len(self.dcp_group.world_size,
                                                           self.cp_kv_cache_interleave_size))
        plan = self._plan_dcp_step(seq_lens - 1, np.ones(len(seq_lens), dtype=np.int64))
        return self._build_dcp_decode_metadata(plan, num_reqs)

    @staticmethod
    def _pcp_builder(attn_group) -> PCPFlashInferMetadataBuilder:
        builder = attn_group.get_metadata_builder(0)
        if not isinstance(builder, PCPFlashInferMetadataBuilder):
            raise RuntimeError(
                f"PCP needs the FLASHINFER attention backend, layer group "
                f"{attn_group.layer_names[:1]} uses {type(builder).__name__}")
        return builder

    def _build_split_metadata(self, plan: PrefillContextParallelMetadata,
                              slot_mappings: dict[int, torch.Tensor],
                              ragged_scheduled: np.ndarray | None = None):
        """Per-layer metadata of a split step at DCP = 1 and the step's inputs: vLLM's
        FlashInfer plan of the local rows (None on a rank without rows, which plans
        no kernel but takes part in the K/V exchange of every layer), or, on a fresh
        step (``ragged_scheduled``, its tokens per request), the ragged kernel's plan
        for the groups whose layers may take it (:mod:`vllm_pcp.pcp.ragged`)."""
        dev = self.device
        gathered = plan.gathered_token_indices.to(dev, non_blocking=True)
        exchange = KVExchange(self.pcp_group, plan.num_padded_tokens_per_rank)
        local_rows, attn_metadata = None, {}
        for gid, _ in enumerate(self.kv_cache_config.kv_cache_groups):
            slots = gathered_slot_mapping(slot_mappings[gid], gathered)
            for attn_group in self.attn_groups[gid]:
                builder = self._pcp_builder(attn_group)
                if ragged_scheduled is not None and builder.can_attend_ragged():
                    metadata = PCPSplitMetadata(exchange, slots, None,
                                                builder.build_ragged(plan, ragged_scheduled))
                else:
                    if local_rows is None:
                        local_rows = self._local_rows(plan, slot_mappings) if plan.num_rows \
                            else {}
                    cm = local_rows.get(gid)
                    local = None if cm is None else builder.build(common_prefix_len=0,
                                                                  common_attn_metadata=cm)
                    metadata = PCPSplitMetadata(exchange, slots, local)
                for name in attn_group.layer_names:
                    attn_metadata[name] = metadata
        if ragged_scheduled is not None:
            self.pcp_step_counts.ragged_steps += any(
                m.ragged is not None for m in attn_metadata.values())
        return attn_metadata, self._split_inputs(plan, dev)

    def _local_rows(self, plan: PrefillContextParallelMetadata,
                    slot_mappings: dict[int, torch.Tensor]) -> dict[int, CommonAttentionMetadata]:
        """This rank's local rows as vLLM's attention input, by KV cache group (the
        rows' tensors go to the device once, for every group)."""
        dev = self.device
        local = plan.local_token_indices.to(dev, non_blocking=True)
        row_req = plan.row_req_indices.to(dev, dtype=torch.int64, non_blocking=True)
        q_lens = plan.query_start_loc[1:] - plan.query_start_loc[:-1]
        rows = dict(
            query_start_loc=plan.query_start_loc.to(dev, non_blocking=True),
            query_start_loc_cpu=plan.query_start_loc,
            seq_lens=plan.seq_lens.to(dev, non_blocking=True),
            _seq_lens_cpu=plan.seq_lens,
            _num_computed_tokens_cpu=plan.seq_lens - q_lens,
            seq_lens_cpu_upper_bound=plan.seq_lens,
            num_reqs=plan.num_rows,
            num_actual_tokens=plan.num_local_tokens,
            max_query_len=plan.max_query_len,
            max_seq_len=int(plan.seq_lens.max()),
            causal=True,
            positions=self.positions.index_select(0, local))
        out = {}
        for gid, _ in enumerate(self.kv_cache_config.kv_cache_groups):
            table = self.input_batch.block_table[gid].get_device_tensor(
                self.input_batch.num_reqs)
            out[gid] = CommonAttentionMetadata(
                block_table_tensor=table.index_select(0, row_req),
                slot_mapping=slot_mappings[gid].index_select(0, local), **rows)
        return out

    def _model_forward(self, input_ids=None, positions=None, intermediate_tensors=None,
                       inputs_embeds=None, **model_kwargs):
        step, self._step = self._step, None
        inputs = None if step is None else step.inputs
        if inputs is None:
            if step is not None and step.eager:  # a decode batch vLLM padded for a graph
                ctx = get_forward_context()
                ctx.cudagraph_runtime_mode, ctx.batch_descriptor = CUDAGraphMode.NONE, None
            return super()._model_forward(input_ids, positions, intermediate_tensors,
                                          inputs_embeds, **model_kwargs)
        if inputs_embeds is not None or intermediate_tensors is not None:
            raise RuntimeError("PCP runs token-id inputs on a single pipeline stage")
        ctx = get_forward_context()
        ctx.cudagraph_runtime_mode = CUDAGraphMode.NONE
        ctx.batch_descriptor = None
        ctx.is_padding = None
        rows = inputs.model_input_indices  # P on every rank
        hidden = super()._model_forward(input_ids.index_select(0, rows),
                                        positions.index_select(-1, rows),
                                        None, None, **model_kwargs)
        return restore_hidden_states(self.pcp_group, hidden, inputs.num_padded_tokens_per_rank,
                                     inputs.restore_indices, num_output_rows=input_ids.shape[0])

    def profile_run(self) -> None:
        """vLLM's profile run with the widest split step's buffers held beside it
        (:mod:`vllm_pcp.pcp.memory`): the KV cache is sized with them set aside.
        ``pcp_profile_peak_bytes``: the run's peak of torch allocations above what
        was allocated before it (the peak reset first, as vLLM's ``memory_profiling``
        resets it just before: the same count, also where ``--kv-cache-memory-bytes``
        skips vLLM's profiling)."""
        reserve = split_step_reserve_bytes(self.vllm_config)
        logger.info("PCP: %.3f GiB held through the profile run for split steps",
                    reserve / (1 << 30))
        torch.cuda.reset_peak_memory_stats(self.device)
        before = torch.cuda.memory_allocated(self.device)
        held = torch.empty(reserve, dtype=torch.uint8, device=self.device)
        try:
            super().profile_run()
        finally:
            del held
        self.pcp_profile_peak_bytes = torch.cuda.max_memory_allocated(self.device) - before

    def _sample(self, logits, spec_decode_metadata):
        """vLLM's sampler; with VLLM_PCP_CHECK_SAMPLED_TOKENS the ids are compared across
        the PCP ranks before any rank feeds them back (:mod:`vllm_pcp.pcp.agreement`)."""
        output = super()._sample(logits, spec_decode_metadata)
        self.pcp_sampled_tokens.check(output.sampled_token_ids)
        return output
