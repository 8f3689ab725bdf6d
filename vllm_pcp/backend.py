"""FlashInfer attention with prefill context parallelism.

The runner gives every layer of a step the plugin runs one metadata object,
shared by the layers of a KV cache group, that carries the whole step:

    PCPSplitMetadata   split step, whole cache on every rank (DCP = 1)
      cache write      all-gather the new K/V of every rank (one collective of
                       ``N * P`` rows), write them with the gathered slot mapping
      attention        vLLM's FlashInfer over this rank's local rows (its
                       DualChunkSwap chunks): each attends causally over the
                       paged cache, the bottom-right causal mask placing the
                       chunk at its absolute offset
      fresh steps      (no request with cached context, ``ragged``) the layer's
                       forward gathers and writes, and the local rows attend the
                       gathered K/V with FlashInfer's ragged kernel
                       (:mod:`vllm_pcp.pcp.ragged`)
    PCPDCPMetadata     KV cache sharded (DCP == PCP, or DCP inside TP at PCP = 1)
      forward          read the context rows split chunks fetch, all-gather new
                       K/V and context (``N * (P + Pc)`` rows), write this rank's
                       share (slots of tokens another rank owns are -1), then
                       :mod:`vllm_pcp.dcp.attention`; a decode step (and DCP
                       inside TP) keeps vLLM's cache write

Any other step runs exactly as stock FlashInfer.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from vllm.forward_context import get_forward_context, is_forward_context_available
from vllm.utils.torch_utils import canonicalize_singleton_dim_strides
from vllm.v1.attention.backends.flashinfer import (FlashInferBackend, FlashInferImpl,
                                                   FlashInferMetadataBuilder)

from vllm_pcp import config as pcp_config
from vllm_pcp.pcp.exchange import gather_kv
from vllm_pcp.pcp.ragged import PlannedRaggedStep, RaggedSplitAttention


@dataclass(frozen=True)
class KVExchange:
    """The K/V all-gather of one PCP step, the same for every layer.

    ``num_context_rows`` (PCP x DCP with ``context_exchange="keys"``): the
    buffer also carries the context rows each rank stores for the split chunks.
    """

    group: object  # vLLM GroupCoordinator of the PCP ranks
    num_padded_tokens_per_rank: int  # P, identical on every rank
    num_context_rows: int = 0  # Pc, identical on every rank

    def gather(self, key: torch.Tensor, value: torch.Tensor,
               context: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Every rank's new K/V (and context rows): :func:`vllm_pcp.pcp.exchange.gather_kv`."""
        return gather_kv(self.group, key, value, self.num_padded_tokens_per_rank, context,
                         self.num_context_rows)


@dataclass
class PCPSplitMetadata:
    """A layer's attention metadata on a split step with the whole cache on every
    rank (DCP = 1). The cache write all-gathers the step's K/V and writes it with
    the gathered slot mapping; attention is vLLM's FlashInfer over this rank's
    local rows (``local``). ``local`` is None on a rank with no local rows, a step
    that :func:`vllm_pcp.pcp.partition.min_chunk_tokens` keeps from happening (every
    split row has 2 tokens or more): its model input would be pad rows only, attention
    writes zeros, and the layer still joins the exchange.

    ``ragged`` (a fresh step, :mod:`vllm_pcp.pcp.ragged`): ``local`` is None and the
    layer's forward gathers, writes and attends the gathered K/V."""

    exchange: KVExchange
    slot_mapping: torch.Tensor  # [N * P] gathered layout, -1 where nothing is written
    local: FlashInferMetadata | None
    ragged: PlannedRaggedStep | None = None

    @property
    def num_actual_tokens(self) -> int:
        if self.ragged is not None:
            return self.ragged.num_local_tokens
        return 0 if self.local is None else self.local.num_actual_tokens


@dataclass
class PCPDCPMetadata:
    """A layer's attention metadata on a step with the KV cache sharded (DCP).

    With ``exchange`` (a split or prefill step at PCP > 1) the layer's forward
    reads the context rows to send, all-gathers the step's K/V, writes this
    rank's share of it (``slot_mapping``) and attends; without (a pure decode
    step; DCP inside TP) vLLM's cache write runs first, with its own slot mapping.
    """

    attention: object  # vllm_pcp.dcp.attention.DCPAttention
    step: object  # its PlannedDCPStep for this step
    group: object  # vLLM GroupCoordinator of the DCP ranks (= the PCP ranks at PCP > 1)
    exchange: KVExchange | None
    num_local_tokens: int
    heads_gathered: bool = False  # DCP inside TP: query heads all-gathered
    slot_mapping: torch.Tensor | None = None  # [N * (P + Pc)] with ``exchange``


class PCPFlashInferImpl(FlashInferImpl):
    supports_pcp = True

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        pcp, dcp = self.pcp_world_size, self.dcp_world_size
        unapplied = _unapplied_settings(self) if pcp > 1 or dcp > 1 else []
        unplanned = _dcp_unplanned_settings(self) if dcp > 1 else []
        if pcp > 1 and dcp == 1 and self.kv_cache_dtype not in pcp_config.PCP_CACHE_DTYPES:
            raise pcp_config.PCPConfigError(
                f"vllm-pcp cannot run an attention layer with a {self.kv_cache_dtype} KV "
                "cache: " + pcp_config.pcp_kv_dtype_refusal(self.kv_cache_dtype, pcp))
        if unapplied or unplanned:
            raise (pcp_config.cp_layer_error(unapplied + unplanned, pcp, dcp) if unapplied
                   else pcp_config.dcp_layer_error(unplanned, pcp, dcp))

    def do_kv_cache_update(self, layer: torch.nn.Module, key: torch.Tensor,
                           value: torch.Tensor, kv_cache: torch.Tensor,
                           slot_mapping: torch.Tensor) -> None:
        metadata = _layer_metadata(layer) if self.pcp_world_size > 1 else None
        if isinstance(metadata, PCPSplitMetadata):
            if metadata.ragged is not None:
                return  # the layer's forward gathers, writes and attends
            key, value = metadata.exchange.gather(key, value)
            slot_mapping = metadata.slot_mapping
        elif isinstance(metadata, PCPDCPMetadata) and metadata.exchange is not None:
            return  # the layer's forward gathers, writes and attends
        super().do_kv_cache_update(layer, key, value, kv_cache, slot_mapping)

    def _kv_views(self, kv_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The layer's paged (K, V) in the cache layout FlashInfer reads. Zero-copy;
        a 1-kv-head cache gets TMA-legal strides, as vLLM's forward does."""
        cache = canonicalize_singleton_dim_strides(
            kv_cache.permute(*FlashInferBackend.get_kv_cache_stride_order()))
        return cache.split(self.head_size, dim=-1)

    def forward(self, layer, query, key, value, kv_cache, attn_metadata, output,
                output_scale=None, output_block_scale=None):
        if isinstance(attn_metadata, PCPDCPMetadata):
            return self._forward_dcp(layer, query, key, value, kv_cache, attn_metadata,
                                     output, output_scale)
        if isinstance(attn_metadata, PCPSplitMetadata):
            if attn_metadata.ragged is not None:
                return self._forward_ragged(layer, query, key, value, kv_cache,
                                            attn_metadata, output, output_scale)
            if attn_metadata.local is None:
                return output.fill_(0)
            super().forward(layer, query, key, value, kv_cache, attn_metadata.local,
                            output, output_scale, output_block_scale)
            _zero_pad_rows(output, attn_metadata.num_actual_tokens)
            return output
        if self.dcp_world_size > 1:
            # DCP on FlashInfer is the plugin's (vLLM's own is refused): every engine
            # step and graph capture carries PCPDCPMetadata; anything else is a
            # profiling or warm-up run. Like vLLM's profiling run: zeros.
            return output.fill_(0)
        return super().forward(layer, query, key, value, kv_cache, attn_metadata, output,
                               output_scale, output_block_scale)

    def _forward_ragged(self, layer, query, key, value, kv_cache,
                        metadata: PCPSplitMetadata, output, output_scale):
        """A fresh split step: all-gather the step's K/V, write it to the cache, attend
        the local rows over the gathered K/V (:mod:`vllm_pcp.pcp.ragged`)."""
        if output_scale is not None:
            raise NotImplementedError("the ragged split attention does not fuse output "
                                      "quantization; run with --additional-config "
                                      "'{\"pcp_split_attention\": \"paged\"}'")
        k_step, v_step = metadata.exchange.gather(key, value)
        super().do_kv_cache_update(layer, k_step, v_step, kv_cache, metadata.slot_mapping)
        n = metadata.num_actual_tokens
        metadata.ragged.run(query[:n], k_step, v_step, output[:n])
        _zero_pad_rows(output, n)
        return output

    def _forward_dcp(self, layer, query, key, value, kv_cache, metadata: PCPDCPMetadata,
                     output, output_scale):
        if output_scale is not None:
            raise NotImplementedError("PCP x DCP does not fuse output quantization")
        exchange, n = metadata.exchange, metadata.num_local_tokens
        attention, step, kv = metadata.attention, metadata.step, self._kv_views(kv_cache)
        if metadata.heads_gathered:  # every rank holds the step's K/V: the layer's
            out = attention.run_heads_gathered(step, metadata.group, query[:n], key[:n],
                                               value[:n], kv)
        else:
            k_step = v_step = None
            if exchange is not None:  # context read before this step's write
                k_step, v_step = exchange.gather(key, value, step.read_context(kv))
                super().do_kv_cache_update(layer, k_step, v_step, kv_cache,
                                           metadata.slot_mapping)
            out = attention.run(step, metadata.group, query[:n], k_step, v_step, kv,
                                out=None if exchange is None else output[:n])
        if out.data_ptr() != output.data_ptr():
            output[:n].copy_(out)
        if exchange is not None:
            _zero_pad_rows(output, n)
        return output


class PCPFlashInferMetadataBuilder(FlashInferMetadataBuilder):
    """Stock planning of a split step's local rows, and one plan per PCP x DCP step.

    A split request is two attention rows on every rank (its chunks r and
    2N-1-r), so a PCP step has up to ``2 * max_num_seqs`` rows: the builder's
    per-row buffers, sized by vLLM for ``max_num_seqs``, are made twice as long.
    """

    _dcp_attention = None
    _ragged_attention = None

    def __init__(self, kv_cache_spec, layer_names, vllm_config, device):
        parallel = vllm_config.parallel_config
        if parallel.prefill_context_parallel_size == 1 and \
                parallel.decode_context_parallel_size > 1:
            if parallel.worker_cls != pcp_config.WORKER_CLS:  # FlashInfer picked by vLLM
                raise pcp_config.stock_flashinfer_dcp_error(
                    parallel.decode_context_parallel_size)
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)
        if self.dcp_world_size > 1 and not self.global_hyperparameters.has_same_all_params:
            _refuse_mixed_scales(vllm_config, layer_names)
        if parallel.prefill_context_parallel_size > 1:
            grow_row_buffers(self, 2 * vllm_config.scheduler_config.max_num_seqs)

    def can_attend_ragged(self) -> bool:
        """Whether this group's layers may take the ragged kernel on fresh steps: an
        unquantized cache and no setting the plan would have to carry (one softmax
        scale, no window, soft cap or sinks)."""
        return (self.cache_dtype in pcp_config.DCP_CACHE_DTYPES and self.window_left == -1
                and not self.logits_soft_cap and not self.has_sinks
                and bool(self.global_hyperparameters.has_same_all_params))

    def build_ragged(self, plan, num_scheduled_tokens) -> PlannedRaggedStep:
        """Plan a fresh split step's ragged kernel (:mod:`vllm_pcp.pcp.ragged`) once for
        the group's layers."""
        if self._ragged_attention is None:
            self._ragged_attention = RaggedSplitAttention(
                self._get_workspace_buffer(), self.num_qo_heads, self.num_kv_heads,
                self.head_dim, self.q_data_type_prefill, self.sm_scale)
        return self._ragged_attention.plan(plan, num_scheduled_tokens, self.device)

    def build_dcp(self, plan, block_table: torch.Tensor, group, heads_gathered: bool,
                  exchange: KVExchange | None = None, slot_mapping: torch.Tensor | None = None,
                  graph_rows: int | None = None) -> PCPDCPMetadata:
        """Plan a PCP x DCP step (``plan``: a DCPAttentionPlan) once for all layers.

        ``heads_gathered``: DCP inside TP (PCP = 1), the DCP ranks hold different
        query heads. ``exchange`` and ``slot_mapping`` (gathered layout): steps whose
        layers all-gather K/V. ``graph_rows``: a pure decode step run as the full
        CUDA graph of that size."""
        if self._dcp_attention is None:
            from vllm.v1.attention.backends.utils import get_kv_cache_layout

            from vllm_pcp.dcp.attention import DCPAttention

            heads = self.num_qo_heads * (self.dcp_world_size if heads_gathered else 1)
            self._dcp_attention = DCPAttention(
                self._get_workspace_buffer(), heads, self.num_kv_heads,
                self.head_dim, self.page_size, self.q_data_type_prefill,
                self.global_hyperparameters.sm_scale, get_kv_cache_layout(),
                max_graph_rows=_max_decode_graph_rows(self.vllm_config))
        step = self._dcp_attention.plan(plan, block_table, graph_rows,
                                        kv_gathered=not heads_gathered)
        return PCPDCPMetadata(self._dcp_attention, step, group, exchange,
                              graph_rows or plan.num_local_tokens, heads_gathered,
                              slot_mapping)


def _zero_pad_rows(output: torch.Tensor, num_actual_tokens: int) -> None:
    """Zero the pad rows of a split step's attention output (``model_input_indices``):
    they stay finite through the rest of the model, MoE routing included."""
    if output.shape[0] > num_actual_tokens:
        output[num_actual_tokens:].zero_()


def _unapplied_settings(impl: FlashInferImpl) -> list[str]:
    """The layer's settings that no attention path of vllm-pcp applies: ALiBi slopes
    (FlashInferImpl keeps them and never reads them), a KV cache shared with another
    layer (not verified)."""
    out = []
    if impl.alibi_slopes is not None:
        out.append("ALiBi slopes")
    if impl.kv_sharing_target_layer_name is not None:
        out.append(f"its KV cache shared with {impl.kv_sharing_target_layer_name}")
    return out


def _dcp_unplanned_settings(impl: FlashInferImpl) -> list[str]:
    """The layer's settings that vllm-pcp's DCP attention does not plan: a sliding
    window (FlashInferImpl keeps ``(window - 1, 0)``, ``(-1, -1)`` for none), a logits
    soft cap, attention sinks, a quantized KV cache."""
    out = []
    if impl.sliding_window not in (None, (-1, -1)):
        out.append(f"a sliding window of {impl.sliding_window[0] + 1} tokens")
    if impl.logits_soft_cap:
        out.append(f"logits_soft_cap {impl.logits_soft_cap}")
    if impl.sinks is not None:
        out.append("attention sinks")
    if impl.kv_cache_dtype not in pcp_config.DCP_CACHE_DTYPES:
        out.append(f"a {impl.kv_cache_dtype} KV cache")
    return out


def _refuse_mixed_scales(vllm_config, layer_names: list[str]) -> None:
    """Under DCP, refuse a KV cache group whose layers differ in softmax scale (the
    only setting left to differ: the layers refuse windows, soft caps and sinks)."""
    from vllm.v1.attention.backends.utils import get_per_layer_parameters

    parallel = vllm_config.parallel_config
    params = get_per_layer_parameters(vllm_config, layer_names, FlashInferImpl).values()
    raise pcp_config.dcp_scales_error(sorted({p.sm_scale for p in params}),
                                      parallel.prefill_context_parallel_size,
                                      parallel.decode_context_parallel_size)


def _max_decode_graph_rows(vllm_config) -> int:
    """The largest decode batch a CUDA graph may be captured for."""
    capture = vllm_config.compilation_config.max_cudagraph_capture_size or 0
    return max(vllm_config.scheduler_config.max_num_seqs, capture)


def grow_row_buffers(builder: FlashInferMetadataBuilder, max_rows: int) -> None:
    """Re-make the builder's per-row paged-KV buffers for ``max_rows`` rows, keeping
    the pages-per-row bound vLLM sized them with. Never shrinks them."""
    rows = builder.paged_kv_last_page_len.cpu.shape[0]
    if max_rows <= rows:
        return
    pages_per_row = builder.paged_kv_indices.cpu.shape[0] // rows
    builder.paged_kv_indptr = builder._make_buffer(max_rows + 1)
    builder.paged_kv_indptr_cpu_buffer = torch.zeros_like(
        builder.paged_kv_indptr.cpu, pin_memory=builder.pin_memory)
    builder.paged_kv_indices = builder._make_buffer(max_rows * pages_per_row)
    builder.paged_kv_last_page_len = builder._make_buffer(max_rows)


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
