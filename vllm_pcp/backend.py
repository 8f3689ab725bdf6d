"""FlashInfer attention with prefill context parallelism.

On a PCP step the runner hands every layer local attention rows (each rank's
DualChunkSwap chunks) and, through the forward context, a slot mapping of the
*gathered* layout. The KV write then becomes: all-gather the new K/V of every
rank (one collective of ``N * P`` rows; with DCP also the context rows that
split chunks fetch, ``N * Pc``), write them into this rank's paged cache
(slots of tokens another DCP rank owns, and of context rows, are -1). With
DCP = 1 attention is FlashInfer's own: each local chunk attends causally over
the paged cache, and the bottom-right causal mask places the chunk at its
absolute offset. With DCP == PCP the cache holds a shard only, and
:mod:`vllm_pcp.dcp.attention` runs the step; so it does for DCP inside TP at
PCP = 1 (``-tp N -dcp N`` with FLASHINFER named), whose ranks hold every token
and their own query heads.
Steps without split prefills at DCP = 1, and PCP = 1 without DCP, run exactly
as stock FlashInfer.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from vllm.forward_context import get_forward_context, is_forward_context_available
from vllm.utils.torch_utils import canonicalize_singleton_dim_strides
from vllm.v1.attention.backends.flashinfer import (FlashInferBackend, FlashInferImpl,
                                                   FlashInferMetadataBuilder)

from vllm_pcp.pcp.exchange import gather_kv


@dataclass
class PCPKVExchange:
    """What a layer needs for the KV exchange of one PCP step.

    With ``keep_step_kv`` (DCP) the cache write also keeps this layer's gathered
    K/V buffer in ``step_kv`` for the attention that follows it (the next
    layer's write replaces it). With ``read_context`` the buffer also carries
    the context rows each rank stores for the split chunks (``num_context_rows``
    per rank), read from the layer's cache before the write.
    """

    group: object  # vLLM GroupCoordinator of the PCP ranks
    num_padded_tokens_per_rank: int  # P, identical on every rank
    keep_step_kv: bool = False
    num_context_rows: int = 0  # Pc, identical on every rank
    read_context: Callable[[tuple[torch.Tensor, torch.Tensor]], torch.Tensor] | None = None
    step_kv: tuple[torch.Tensor, torch.Tensor] | None = None


@dataclass
class PCPDCPMetadata:
    """Attention metadata of a PCP x DCP step (replaces FlashInferMetadata)."""

    attention: object  # vllm_pcp.dcp.attention.DCPAttention, planned for the step
    group: object  # vLLM GroupCoordinator of the DCP ranks (= the PCP ranks at PCP > 1)
    pcp_exchange: PCPKVExchange | None  # None on a decode step: stock cache write
    num_local_tokens: int
    heads_gathered: bool = False  # DCP inside TP: query heads all-gathered, K/V of the layer


@dataclass
class PCPNoRowsMetadata:
    """Attention metadata of a rank with no local rows in a split step (N >= 3 and a
    split chunk shorter than 2N tokens). Its model input is pad rows only: attention
    writes zeros, while the layer still joins the step's K/V exchange."""

    pcp_exchange: PCPKVExchange
    num_actual_tokens: int = 0


class PCPFlashInferImpl(FlashInferImpl):
    supports_pcp = True

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        unplanned = _dcp_unplanned_settings(self) if self.dcp_world_size > 1 else []
        if unplanned:
            from vllm_pcp.config import dcp_layer_error

            raise dcp_layer_error(unplanned, self.pcp_world_size, self.dcp_world_size)

    def do_kv_cache_update(self, layer: torch.nn.Module, key: torch.Tensor,
                           value: torch.Tensor, kv_cache: torch.Tensor,
                           slot_mapping: torch.Tensor) -> None:
        exchange = _current_exchange(layer) if self.pcp_world_size > 1 else None
        if exchange is not None:
            context = (None if exchange.read_context is None
                       else exchange.read_context(self._kv_views(kv_cache)))
            key, value = gather_kv(exchange.group, key, value,
                                   exchange.num_padded_tokens_per_rank, context,
                                   exchange.num_context_rows)
            if exchange.keep_step_kv:
                exchange.step_kv = (key, value)
        super().do_kv_cache_update(layer, key, value, kv_cache, slot_mapping)

    def _kv_views(self, kv_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The layer's paged (K, V) in the cache layout FlashInfer reads. Zero-copy;
        a 1-kv-head cache gets TMA-legal strides, as vLLM's forward does."""
        cache = canonicalize_singleton_dim_strides(
            kv_cache.permute(*FlashInferBackend.get_kv_cache_stride_order()))
        return cache.split(self.head_size, dim=-1)

    def forward(self, layer, query, key, value, kv_cache, attn_metadata, output,
                output_scale=None, output_block_scale=None):
        if isinstance(attn_metadata, PCPNoRowsMetadata):
            return output.fill_(0)
        if not isinstance(attn_metadata, PCPDCPMetadata):
            if self.dcp_world_size > 1:
                # DCP on FlashInfer is the plugin's (vLLM's own is refused): every
                # engine step and graph capture carries PCPDCPMetadata; anything else
                # is a profiling or warm-up run. Like vLLM's profiling run: zeros.
                return output.fill_(0)
            super().forward(layer, query, key, value, kv_cache, attn_metadata,
                            output, output_scale, output_block_scale)
            if getattr(attn_metadata, "pcp_exchange", None) is not None:
                _zero_pad_rows(output, attn_metadata.num_actual_tokens)
            return output
        if output_scale is not None:
            raise NotImplementedError("PCP x DCP does not fuse output quantization")
        exchange, n = attn_metadata.pcp_exchange, attn_metadata.num_local_tokens
        k_step, v_step = (None, None) if exchange is None else exchange.step_kv
        kv = self._kv_views(kv_cache)
        if attn_metadata.heads_gathered:  # every rank holds the step's K/V: the layer's
            out = attn_metadata.attention.run_heads_gathered(
                attn_metadata.group, query[:n], key[:n], value[:n], kv)
        else:
            out = attn_metadata.attention.run(attn_metadata.group, query[:n], k_step, v_step,
                                              kv)
        output[:n].copy_(out)
        if exchange is not None:
            _zero_pad_rows(output, n)
        return output


class PCPFlashInferMetadataBuilder(FlashInferMetadataBuilder):
    """Stock planning; carries the step's :class:`PCPKVExchange` to the layers.

    A split request is two attention rows on every rank (its chunks r and
    2N-1-r), so a PCP step has up to ``2 * max_num_seqs`` rows: the builder's
    per-row buffers, sized by vLLM for ``max_num_seqs``, are made twice as long.
    """

    _dcp_attention = None

    def __init__(self, kv_cache_spec, layer_names, vllm_config, device):
        parallel = vllm_config.parallel_config
        if parallel.prefill_context_parallel_size == 1 and \
                parallel.decode_context_parallel_size > 1:
            from vllm_pcp.config import WORKER_CLS, stock_flashinfer_dcp_error

            if parallel.worker_cls != WORKER_CLS:  # FlashInfer picked by vLLM, not named
                raise stock_flashinfer_dcp_error(parallel.decode_context_parallel_size)
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)
        if parallel.prefill_context_parallel_size > 1:
            grow_row_buffers(self, 2 * vllm_config.scheduler_config.max_num_seqs)

    def build(self, common_prefix_len, common_attn_metadata, fast_build=False):
        metadata = super().build(common_prefix_len, common_attn_metadata, fast_build)
        metadata.pcp_exchange = getattr(common_attn_metadata, "pcp_exchange", None)
        return metadata

    def build_dcp(self, plan, block_table: torch.Tensor, group,
                  exchange: PCPKVExchange | None,
                  graph_rows: int | None = None) -> PCPDCPMetadata:
        """Plan a PCP x DCP step (``plan``: a DCPAttentionPlan) once for all layers;
        ``graph_rows``: a pure decode step run as the full CUDA graph of that size."""
        if self._dcp_attention is None:
            from vllm.v1.attention.backends.utils import get_kv_cache_layout

            from vllm_pcp.dcp.attention import DCPAttention

            # DCP inside TP gathers the query heads of the DCP group
            heads = self.num_qo_heads * (self.dcp_world_size if _heads_gathered(self) else 1)
            self._dcp_attention = DCPAttention(
                self._get_workspace_buffer(), heads, self.num_kv_heads,
                self.head_dim, self.page_size, self.q_data_type_prefill,
                self.global_hyperparameters.sm_scale, get_kv_cache_layout(),
                max_graph_rows=_max_decode_graph_rows(self.vllm_config))
        self._dcp_attention.plan(plan, block_table, graph_rows,
                                 kv_gathered=not _heads_gathered(self))
        if exchange is not None and plan.ctx_gather is not None:  # context rides along
            exchange.num_context_rows = plan.ctx_gather.num_padded
            exchange.read_context = self._dcp_attention.local_context
        return PCPDCPMetadata(self._dcp_attention, group, exchange,
                              graph_rows or plan.num_local_tokens, _heads_gathered(self))


def _zero_pad_rows(output: torch.Tensor, num_actual_tokens: int) -> None:
    """Zero the pad rows of a split step's attention output (``model_input_indices``):
    they stay finite through the rest of the model, MoE routing included."""
    if output.shape[0] > num_actual_tokens:
        output[num_actual_tokens:].zero_()


def _dcp_unplanned_settings(impl: FlashInferImpl) -> list[str]:
    """The layer's settings that vllm-pcp's DCP attention does not plan: a sliding
    window (FlashInferImpl keeps ``(window - 1, 0)``, ``(-1, -1)`` for none), a logits
    soft cap, attention sinks."""
    out = []
    if impl.sliding_window not in (None, (-1, -1)):
        out.append(f"a sliding window of {impl.sliding_window[0] + 1} tokens")
    if impl.logits_soft_cap:
        out.append(f"logits_soft_cap {impl.logits_soft_cap}")
    if impl.sinks is not None:
        out.append("attention sinks")
    return out


def _heads_gathered(builder) -> bool:
    """DCP inside TP (PCP = 1): the DCP ranks hold different query heads."""
    return builder.vllm_config.parallel_config.prefill_context_parallel_size == 1


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


def _current_exchange(layer: torch.nn.Module) -> PCPKVExchange | None:
    if not is_forward_context_available():
        return None
    metadata = get_forward_context().attn_metadata
    if isinstance(metadata, dict):
        metadata = metadata.get(layer.layer_name)
    return getattr(metadata, "pcp_exchange", None)
