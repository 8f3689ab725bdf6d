"""FlashInfer attention with prefill context parallelism for GQA models.

vLLM's PCP manager gives every rank a local batch (its chunks of the split prompts, and the
rows every rank computes) and a slot mapping for the rows of all ranks (``[N * P]``, -1
where nothing is written). This backend adds what FlashInfer lacks: a slot mapping longer
than the layer's ``P`` rows has every rank's new K/V all-gathered before vLLM's cache write;
at DCP = 1 vLLM's FlashInfer attends the local rows over the paged cache (bottom-right
causal mask), or on a fresh split step FlashInfer's ragged kernel over the gathered K/V
(:mod:`vllm_pcp.pcp.ragged`); at DCP = N each rank attends its shard and the partial states
are merged by LSE (:mod:`vllm_pcp.dcp.attention`); a rank without tokens writes zeros.
Without a ``pcp_step`` (dummy and capture runs, PCP = 1) it is stock FlashInfer.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from vllm.distributed.parallel_state import get_dcp_group, get_pcp_group
from vllm.forward_context import get_forward_context, is_forward_context_available
from vllm.utils.torch_utils import canonicalize_singleton_dim_strides
from vllm.v1.attention.backends.flashinfer import (FlashInferBackend, FlashInferImpl,
                                                   FlashInferMetadataBuilder)
from vllm.v1.utils import CpuGpuBuffer

from vllm_pcp import config as pcp_config
from vllm_pcp.knobs import PCPSettings
from vllm_pcp.pcp.exchange import gather_kv, with_context_rows
from vllm_pcp.pcp.memory import reserved_context_rows
from vllm_pcp.pcp.ragged import PlannedRaggedStep, RaggedSplitAttention


@dataclass(frozen=True)
class PCPEmptyMetadata:
    """A rank without local tokens: the layer joins the K/V exchange and writes zeros."""

    slot_mapping: torch.Tensor
    num_actual_tokens: int = 0


@dataclass(frozen=True)
class PCPRaggedMetadata:
    """A fresh split step at DCP = 1: the forward all-gathers the K/V, writes it and
    attends the local rows over it with FlashInfer's ragged kernel."""

    slot_mapping: torch.Tensor  # [N * P] gathered layout, -1 where nothing is written
    ragged: PlannedRaggedStep

    @property
    def num_actual_tokens(self) -> int:
        return self.ragged.num_local_tokens


@dataclass(frozen=True)
class PCPDCPMetadata:
    """A step with the KV cache sharded over the PCP ranks (``-pcp N -dcp N``). If
    ``gathered``, the forward reads the context split chunks fetch, all-gathers it with the
    step's K/V, writes this rank's share and attends; otherwise every rank holds every
    token: vLLM's cache write, then attention."""

    attention: object  # vllm_pcp.dcp.attention.DCPAttention
    step: object  # its PlannedDCPStep for this step
    gathered: bool
    num_padded_tokens_per_rank: int  # P
    num_context_rows: int  # Pc
    slot_mapping: torch.Tensor
    num_actual_tokens: int
    kv_view_order: tuple[int, ...]  # the cache's dims in the order FlashInfer reads


class PCPFlashInferImpl(FlashInferImpl):
    supports_pcp = True

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        pcp, dcp = self.pcp_world_size, self.dcp_world_size
        if pcp == 1:
            return
        unapplied = _unapplied_settings(self)
        unplanned = _dcp_unplanned_settings(self) if dcp > 1 else []
        if dcp == 1 and self.kv_cache_dtype not in pcp_config.PCP_CACHE_DTYPES:
            raise pcp_config.PCPConfigError(
                f"vllm-pcp cannot run an attention layer with a {self.kv_cache_dtype} KV "
                "cache: " + pcp_config.pcp_kv_dtype_refusal(self.kv_cache_dtype, pcp))
        if unapplied or unplanned:
            raise (pcp_config.cp_layer_error(unapplied + unplanned, pcp, dcp) if unapplied
                   else pcp_config.dcp_layer_error(unplanned, pcp))

    def do_kv_cache_update(self, layer: torch.nn.Module, key: torch.Tensor,
                           value: torch.Tensor, kv_cache: torch.Tensor,
                           slot_mapping: torch.Tensor) -> None:
        if self.pcp_world_size > 1:
            metadata = _layer_metadata(layer)
            if isinstance(metadata, PCPRaggedMetadata) or (
                    isinstance(metadata, PCPDCPMetadata) and metadata.gathered):
                return  # the layer's forward gathers, writes and attends
            if slot_mapping.shape[0] > key.shape[0]:  # laid out for every rank's rows
                key, value = gather_kv(get_pcp_group(), key, value, key.shape[0])
        super().do_kv_cache_update(layer, key, value, kv_cache, slot_mapping)

    def forward(self, layer, query, key, value, kv_cache, attn_metadata, output,
                output_scale=None, output_block_scale=None):
        if isinstance(attn_metadata, PCPDCPMetadata):
            return self._forward_dcp(layer, query, key, value, kv_cache, attn_metadata,
                                     output, output_scale)
        if isinstance(attn_metadata, PCPRaggedMetadata):
            return self._forward_ragged(layer, query, key, value, kv_cache, attn_metadata,
                                        output, output_scale)
        if isinstance(attn_metadata, PCPEmptyMetadata):
            return output.zero_()
        super().forward(layer, query, key, value, kv_cache, attn_metadata, output,
                        output_scale, output_block_scale)
        if self.pcp_world_size > 1 and attn_metadata is not None:
            _zero_pad_rows(output, attn_metadata.num_actual_tokens)
        return output

    def _forward_ragged(self, layer, query, key, value, kv_cache,
                        metadata: PCPRaggedMetadata, output, output_scale):
        """All-gather the step's K/V, write it, attend over it (:mod:`vllm_pcp.pcp.ragged`)."""
        if output_scale is not None:
            raise NotImplementedError("the ragged split attention does not fuse output "
                                      "quantization; run with --additional-config "
                                      "'{\"pcp_split_attention\": \"paged\"}'")
        k_step, v_step = gather_kv(get_pcp_group(), key, value, key.shape[0])
        super().do_kv_cache_update(layer, k_step, v_step, kv_cache, metadata.slot_mapping)
        n = metadata.num_actual_tokens
        metadata.ragged.run(query[:n], k_step, v_step, output[:n])
        _zero_pad_rows(output, n)
        return output

    def _kv_views(self, kv_cache: torch.Tensor,
                  order: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor]:
        """Zero-copy paged (K, V) in the layout FlashInfer reads (``layer_view_order``); a
        1-kv-head cache gets TMA-legal strides, as in vLLM's forward."""
        cache = canonicalize_singleton_dim_strides(kv_cache.permute(*order))
        return cache.split(self.head_size, dim=-1)

    def _forward_dcp(self, layer, query, key, value, kv_cache, metadata: PCPDCPMetadata,
                     output, output_scale):
        if output_scale is not None:
            raise NotImplementedError("PCP x DCP does not fuse output quantization")
        n, step = metadata.num_actual_tokens, metadata.step
        kv = self._kv_views(kv_cache, metadata.kv_view_order)
        if metadata.gathered:  # context read before this step's write
            k_step, v_step = gather_kv(get_pcp_group(), key, value,
                                       metadata.num_padded_tokens_per_rank,
                                       step.read_context(kv), metadata.num_context_rows)
            super().do_kv_cache_update(layer, k_step, v_step, kv_cache,
                                       metadata.slot_mapping)
        else:  # every rank holds the step's tokens, in step order
            k_step, v_step = key[:n], value[:n]
        metadata.attention.run(step, get_dcp_group(), query[:n], k_step, v_step, kv,
                               out=output[:n])
        _zero_pad_rows(output, n)
        return output


class PCPFlashInferMetadataBuilder(FlashInferMetadataBuilder):
    """vLLM's FlashInfer planning of a rank's local rows, and vllm-pcp's plans. A split
    request is two rows per rank, so the per-row buffers hold ``2 * max_num_seqs``."""

    _dcp_attention = None
    _ragged_attention = None

    def __init__(self, kv_cache_spec, layer_names, vllm_config, device):
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)
        self.pcp_world_size = vllm_config.parallel_config.prefill_context_parallel_size
        self.pcp_dcp = self.pcp_world_size > 1 and self.dcp_world_size > 1
        self.max_context_rows = reserved_context_rows(vllm_config)  # a -dcp step's fetch
        self.pcp_settings = (PCPSettings.from_vllm_config(vllm_config)
                             if self.pcp_world_size > 1 else None)
        if self.pcp_dcp and not self.global_hyperparameters.has_same_all_params:
            _refuse_mixed_scales(vllm_config, layer_names)
        if self.pcp_world_size > 1:
            grow_row_buffers(self, 2 * vllm_config.scheduler_config.max_num_seqs)

    def build(self, common_prefix_len, common_attn_metadata, fast_build: bool = False,
              pcp_step=None):
        cm = common_attn_metadata
        if self.pcp_dcp:
            return self._build_dcp(cm, pcp_step)
        if self.pcp_world_size > 1 and cm.num_actual_tokens == 0:
            return PCPEmptyMetadata(cm.slot_mapping)
        if (pcp_step is not None and pcp_step.plan.is_split and pcp_step.is_fresh
                and self.can_attend_ragged()):
            return PCPRaggedMetadata(cm.slot_mapping, self._plan_ragged(pcp_step))
        return super().build(common_prefix_len, cm, fast_build)

    def build_for_cudagraph_capture(self, common_attn_metadata):
        if self.pcp_dcp:  # config.py keeps full CUDA graphs off under -dcp
            raise RuntimeError("vllm-pcp plans the attention of every -dcp step itself: "
                               "full CUDA graphs cannot replay it")
        return super().build_for_cudagraph_capture(common_attn_metadata)

    def can_attend_ragged(self) -> bool:
        """Whether fresh split steps take the ragged kernel: ``pcp_split_attention auto``,
        an unquantized cache, one softmax scale, no window, soft cap or sinks."""
        return (self.pcp_settings.split_attention == "auto"
                and self.cache_dtype in pcp_config.DCP_CACHE_DTYPES
                and self.window_left == -1 and not self.logits_soft_cap and not self.has_sinks
                and bool(self.global_hyperparameters.has_same_all_params))

    def _plan_ragged(self, step) -> PlannedRaggedStep:
        """Plan a fresh split step's ragged kernel once for the group's layers."""
        if self._ragged_attention is None:
            self._ragged_attention = RaggedSplitAttention(
                self._get_workspace_buffer(), self.num_qo_heads, self.num_kv_heads,
                self.head_dim, self.q_data_type_prefill, self.sm_scale)
        return self._ragged_attention.plan(step.plan, step.num_scheduled_tokens, self.device)

    def _build_dcp(self, cm, step) -> PCPDCPMetadata:
        """Plan a PCP x DCP step once for the group's layers; without a step (dummy and
        capture runs) the layers write zeros, as in vLLM's profiling run."""
        if step is None:
            return None
        from vllm_pcp.dcp.plan import build_dcp_plan

        if self._dcp_attention is None:
            from vllm.v1.attention.backends.utils import get_flashinfer_layout_string

            from vllm_pcp.dcp.attention import DCPAttention

            self._dcp_attention = DCPAttention(
                self._get_workspace_buffer(), self.num_qo_heads, self.num_kv_heads,
                self.head_dim, self.page_size, self.q_data_type_prefill,
                self.global_hyperparameters.sm_scale,
                get_flashinfer_layout_string(self.kv_cache_layout))
        plan = build_dcp_plan(step,
                              self.vllm_config.parallel_config.cp_kv_cache_interleave_size,
                              kv_to_q_heads=self.num_kv_heads / self.num_qo_heads,
                              context_exchange=self.pcp_settings.dcp_context_exchange,
                              max_context_rows=self.max_context_rows)
        # every request has a row on every rank (PCPSettings.min_chunk_tokens)
        rows = torch.from_numpy(step.first_local_row()).to(self.device, non_blocking=True)
        table = cm.block_table_tensor.index_select(0, rows)
        planned = self._dcp_attention.plan(plan, table, kv_gathered=step.gathered)
        padded = step.plan.num_padded_tokens_per_rank
        context_rows = 0 if plan.ctx_gather is None else plan.ctx_gather.num_padded
        slots = cm.slot_mapping
        if step.gathered and context_rows:
            slots = with_context_rows(slots, padded, context_rows)
        return PCPDCPMetadata(self._dcp_attention, planned, step.gathered, padded,
                              context_rows, slots, plan.num_local_tokens,
                              tuple(self.kv_cache_layout.layer_view_order))


def _zero_pad_rows(output: torch.Tensor, num_actual_tokens: int) -> None:
    """Zero the output's pad rows: they stay finite through the model, MoE routing too."""
    if output.shape[0] > num_actual_tokens:
        output[num_actual_tokens:].zero_()


def _unapplied_settings(impl: FlashInferImpl) -> list[str]:
    """Settings no attention path of vllm-pcp applies: ALiBi slopes (FlashInferImpl never
    reads them), a sliding window (kept as ``(window - 1, 0)``; vLLM's PCP manager does not
    mask freed blocks), a KV cache shared with another layer (not verified)."""
    out = []
    if impl.alibi_slopes is not None:
        out.append("ALiBi slopes")
    if impl.sliding_window not in (None, (-1, -1)):
        out.append(f"a sliding window of {impl.sliding_window[0] + 1} tokens "
                   "(--disable-sliding-window turns it off)")
    if impl.kv_sharing_target_layer_name is not None:
        out.append(f"its KV cache shared with {impl.kv_sharing_target_layer_name}")
    return out


def _dcp_unplanned_settings(impl: FlashInferImpl) -> list[str]:
    """Settings vllm-pcp's DCP attention does not plan: soft cap, sinks, quantized KV."""
    out = []
    if impl.logits_soft_cap:
        out.append(f"logits_soft_cap {impl.logits_soft_cap}")
    if impl.sinks is not None:
        out.append("attention sinks")
    if impl.kv_cache_dtype not in pcp_config.DCP_CACHE_DTYPES:
        out.append(f"a {impl.kv_cache_dtype} KV cache")
    return out


def _refuse_mixed_scales(vllm_config, layer_names: list[str]) -> None:
    """Refuse a DCP KV cache group whose layers differ in softmax scale (the only setting
    left to differ: the layers refuse windows, soft caps and sinks)."""
    from vllm.v1.attention.backends.utils import get_per_layer_parameters

    parallel = vllm_config.parallel_config
    params = get_per_layer_parameters(vllm_config, layer_names, FlashInferImpl).values()
    raise pcp_config.dcp_scales_error(sorted({p.sm_scale for p in params}),
                                      parallel.prefill_context_parallel_size)


def grow_row_buffers(builder: FlashInferMetadataBuilder, max_rows: int) -> None:
    """Re-make the builder's per-row paged-KV buffers for ``max_rows`` rows (never fewer)."""
    rows = builder.paged_kv_last_page_len.np.shape[0]
    if max_rows <= rows:
        return
    pages_per_row = builder.paged_kv_indices.shape[0] // rows
    device = builder.paged_kv_indices.device
    builder.paged_kv_indptr = CpuGpuBuffer(max_rows + 1, dtype=torch.int32, device=device,
                                           pin_memory=False)
    builder.paged_kv_indices = torch.zeros(max_rows * pages_per_row, dtype=torch.int32,
                                           device=device)
    builder.paged_kv_last_page_len = CpuGpuBuffer(max_rows, dtype=torch.int32, device=device,
                                                  pin_memory=False)


class PCPFlashInferBackend(FlashInferBackend):
    @staticmethod
    def get_name() -> str:
        return "FLASHINFER"

    @staticmethod
    def get_impl_cls() -> type[PCPFlashInferImpl]:
        return PCPFlashInferImpl

    @staticmethod
    def get_builder_cls() -> type[PCPFlashInferMetadataBuilder]:
        return PCPFlashInferMetadataBuilder


def _layer_metadata(layer: torch.nn.Module):
    """The layer's attention metadata of the running step (None outside a forward)."""
    if not is_forward_context_available():
        return None
    metadata = get_forward_context().attn_metadata
    if isinstance(metadata, dict):
        metadata = metadata.get(layer.layer_name)
    return metadata
