"""Run the plugin's FlashInfer layer (``PCPFlashInferImpl.forward``) on one PCP x DCP
step for every rank of a thread group, as the runner builds the step.

Shared by the CPU test (FlashInfer's kernels and vLLM's cache write replaced by
plain torch) and the GPU test (real FlashInfer, vLLM's cache kernel). Each rank
starts from a vLLM-layout KV cache holding its shard of the context, the
step's own slots set to a sentinel; the layer must write them.
"""
from __future__ import annotations

import math
from types import SimpleNamespace

import torch

from dcp_harness import COMPUTED, SCHEDULED, _paged_shard, expected_output, make_batch
from helpers import ThreadGroup

SENTINEL = 100.0  # what the step's slots hold before the layer writes them


def _make_impls(monkeypatch, world, hq, hkv, dim):
    """One real PCPFlashInferImpl per rank (PCP = DCP = ``world``)."""
    import vllm.distributed.parallel_state as parallel_state

    from vllm_pcp.backend import PCPFlashInferImpl

    impls = []
    for rank in range(world):
        for name in ("get_dcp_group", "get_pcp_group"):
            monkeypatch.setattr(parallel_state, name, lambda r=rank: SimpleNamespace(
                world_size=world, rank_in_group=r))
        impls.append(PCPFlashInferImpl(hq, dim, 1 / math.sqrt(dim), hkv, None, None, "auto"))
    return impls


def _vllm_cache(impl, shard, kv_layout):
    """``shard`` (NHD ``(K, V)`` pages) in vLLM's FlashInfer cache tensor: logical
    ``[blocks, Hkv, page, 2 * D]`` over the memory order of ``kv_layout``."""
    from vllm.v1.attention.backends.flashinfer import FlashInferBackend

    k, v = shard
    blocks, page, hkv, dim = k.shape
    shape = FlashInferBackend.get_kv_cache_shape(blocks, page, hkv, dim)
    order = FlashInferBackend.get_kv_cache_stride_order()
    inverse = [order.index(i) for i in range(len(order))]
    cache = torch.zeros([shape[i] for i in order], dtype=k.dtype,
                        device=k.device).permute(*inverse)
    k_view, v_view = impl._kv_views(cache)
    if kv_layout == "HND":
        k, v = k.transpose(1, 2), v.transpose(1, 2)
    k_view.copy_(k), v_view.copy_(v)
    return cache


def _step_slots(computed, scheduled, table, rank, world, interleave, page):
    """vLLM's DCP slot mapping of the step's tokens on ``rank``: ``[T]``, -1 where
    another rank owns the token."""
    from vllm_pcp.dcp.layout import dcp_local_offset, dcp_owner

    slots = []
    for req, (c, s) in enumerate(zip(computed, scheduled)):
        pos = torch.arange(c, c + s)
        mine = dcp_owner(pos, world, interleave) == rank
        local = dcp_local_offset(pos[mine], world, interleave)
        slot = torch.full((s,), -1, dtype=torch.int64)
        slot[mine] = table[req].cpu()[local // page].long() * page + local % page
        slots.append(slot)
    return torch.cat(slots)


def _erase(cache_views, slots, page, kv_layout):
    """The step's own slots set to SENTINEL: the layer has to write them."""
    owned = slots[slots >= 0]
    block, offset = owned // page, owned % page
    for view in cache_views:  # in place: NHD [blocks, page, Hkv, D], HND [blocks, Hkv, page, D]
        if kv_layout == "HND":
            view[block, :, offset] = SENTINEL
        else:
            view[block, offset] = SENTINEL


def run_dcp_layer_step(monkeypatch, world, interleave, exchange, device, dtype, hq=16,
                       hkv=2, dim=128, page=16, around_forward=None):
    """``(per-rank results, expected output)``: each rank's ``(restored output
    [T, Hq, D] float32 on the CPU, its cache after the step, the cache it should
    hold)`` and causal attention of the whole batch. ``around_forward(rank)``: a
    context manager the layer's forward runs in (default none)."""
    from vllm.config import DeviceConfig, VllmConfig, set_current_vllm_config

    with set_current_vllm_config(VllmConfig(device_config=DeviceConfig(device="cuda"))):
        return _run_dcp_layer_step(monkeypatch, world, interleave, exchange, device, dtype,
                                   hq, hkv, dim, page, around_forward)


def _run_dcp_layer_step(monkeypatch, world, interleave, exchange, device, dtype, hq, hkv,
                        dim, page, around_forward):
    import contextlib

    from vllm.v1.attention.backends.utils import get_kv_cache_layout

    from vllm_pcp.backend import KVExchange, PCPDCPMetadata
    from vllm_pcp.dcp.attention import DCPAttention
    from vllm_pcp.dcp.plan import build_dcp_plan
    from vllm_pcp.pcp.exchange import (gathered_slot_mapping, restore_hidden_states,
                                       with_context_rows)

    full, q = make_batch(hq, hkv, dim, 7 * world + interleave)
    full = [(k.to(dtype).float(), v.to(dtype).float()) for k, v in full]  # rounded once
    q = q.to(device, dtype)
    k_step = torch.cat([k[c:] for (k, _), c in zip(full, COMPUTED)]).to(device, dtype)
    v_step = torch.cat([v[c:] for (_, v), c in zip(full, COMPUTED)]).to(device, dtype)
    kv_layout, group = get_kv_cache_layout(), ThreadGroup(world)
    impls = _make_impls(monkeypatch, world, hq, hkv, dim)

    def rank_fn(rank):
        impl = impls[rank]
        plan = build_dcp_plan(COMPUTED, SCHEDULED, world, rank, interleave, min_split_tokens=2,
                              context_exchange=exchange, kv_to_q_heads=hkv / hq)
        shard, table = _paged_shard(full, rank, world, interleave, page, device, dtype)
        cache = _vllm_cache(impl, shard, kv_layout)
        expect_cache = cache.clone()
        slots = _step_slots(COMPUTED, SCHEDULED, table, rank, world, interleave, page)
        _erase(impl._kv_views(cache), slots, page, kv_layout)
        workspace = torch.empty(128 << 20, dtype=torch.uint8, device=device)
        attn = DCPAttention(workspace, hq, hkv, dim, page, dtype, 1 / math.sqrt(dim),
                            kv_layout)
        step = attn.plan(plan, table)
        pcp = plan.pcp
        padded, context_rows = pcp.num_padded_tokens_per_rank, 0
        gathered = pcp.gathered_token_indices
        if plan.ctx_gather is not None:
            context_rows = plan.ctx_gather.num_padded
            gathered = with_context_rows(gathered, padded, context_rows)
        metadata = PCPDCPMetadata(
            attn, step, group.rank(rank), KVExchange(group.rank(rank), padded, context_rows),
            plan.num_local_tokens,
            slot_mapping=gathered_slot_mapping(slots.to(device), gathered.to(device)))
        layer = SimpleNamespace(layer_name="l0", _k_scale=torch.ones(1, device=device),
                                _v_scale=torch.ones(1, device=device))
        rows = pcp.model_input_indices.to(device)  # P rows: local tokens, then pad rows
        output = torch.full((padded, hq, dim), float("nan"), dtype=dtype, device=device)
        q_rows, k_rows, v_rows = q[rows], k_step[rows], v_step[rows]
        with (around_forward or (lambda r: contextlib.nullcontext()))(rank):
            impl.forward(layer, q_rows, k_rows, v_rows, cache, metadata, output)
        restored = restore_hidden_states(group.rank(rank), output.reshape(padded, hq * dim),
                                         padded, pcp.restore_indices.to(device))
        return restored.reshape(-1, hq, dim).float().cpu(), cache, expect_cache

    expect = expected_output(full, q.float().cpu())
    return group.run(rank_fn), expect
