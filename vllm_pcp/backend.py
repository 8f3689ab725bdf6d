"""FlashInfer attention with prefill context parallelism.

On a PCP step the runner hands every layer local attention rows (each rank's
DualChunkSwap chunks) and, through the forward context, a slot mapping of the
*gathered* layout. The KV write then becomes: all-gather the new K/V of every
rank (one collective of ``N * P`` rows), write them all into this rank's paged
cache. Attention is FlashInfer's own: each local chunk attends causally over
the paged cache, and the bottom-right causal mask places the chunk at its
absolute offset. Steps without split prefills, and PCP = 1, run exactly as
stock FlashInfer.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from vllm.v1.attention.backends.flashinfer import (FlashInferBackend, FlashInferImpl,
                                                   FlashInferMetadataBuilder)

from vllm_pcp.exchange import gather_kv


@dataclass(frozen=True)
class PCPKVExchange:
    """What a layer needs for the KV exchange of one PCP step."""

    group: object  # vLLM GroupCoordinator of the PCP ranks
    num_padded_tokens_per_rank: int  # P, identical on every rank


class PCPFlashInferImpl(FlashInferImpl):
    supports_pcp = True

    def do_kv_cache_update(self, layer: torch.nn.Module, key: torch.Tensor,
                           value: torch.Tensor, kv_cache: torch.Tensor,
                           slot_mapping: torch.Tensor) -> None:
        exchange = _current_exchange(layer)
        if exchange is not None:
            key, value = gather_kv(exchange.group, key, value,
                                   exchange.num_padded_tokens_per_rank)
        super().do_kv_cache_update(layer, key, value, kv_cache, slot_mapping)


class PCPFlashInferMetadataBuilder(FlashInferMetadataBuilder):
    """Stock planning; carries the step's :class:`PCPKVExchange` to the layers."""

    def build(self, common_prefix_len, common_attn_metadata, fast_build=False):
        metadata = super().build(common_prefix_len, common_attn_metadata, fast_build)
        metadata.pcp_exchange = getattr(common_attn_metadata, "pcp_exchange", None)
        return metadata


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
    from vllm.forward_context import get_forward_context, is_forward_context_available

    if not is_forward_context_available():
        return None
    metadata = get_forward_context().attn_metadata
    if isinstance(metadata, dict):
        metadata = metadata.get(layer.layer_name)
    return getattr(metadata, "pcp_exchange", None)
