"""Run the plugin's FlashInfer layer on one PCP x DCP step for every rank of a thread
group, as vLLM 0.33.0's Model Runner V2 drives it.

vLLM's own PCP machinery makes each rank's step: ``GQAPCPManager.partition_batch`` on
the scheduler's global batch (``tests/manager_harness.py``), its gathered slot mapping,
the block table of the local rows. The plugin's builder plans the step
(``PCPFlashInferMetadataBuilder.build(..., pcp_step=step)``), the layer runs vLLM's two
calls (``do_kv_cache_update``, then ``forward``) over a KV cache in vLLM's per-layer
layout, and vLLM's manager restores the output (``restore_hidden_states``).

Shared by the CPU test (FlashInfer's kernels and vLLM's cache write replaced by plain
torch) and the GPU test (real FlashInfer, vLLM's cache kernel). Each rank starts from a
cache holding its shard of the context, the step's own slots set to a sentinel; the
layer must write them.
"""
from __future__ import annotations

import contextlib
import math
import threading
from types import SimpleNamespace

import torch

from dcp_harness import COMPUTED, SCHEDULED, _paged_shard, expected_output, make_batch
from helpers import ThreadGroup

SENTINEL = 100.0  # what the step's slots hold before the layer writes them
LAYOUTS = {"NHD": "LBNHC", "HND": "LBHNC"}  # FlashInfer's name -> vLLM's KVCacheLayout


def kv_cache_layout(kv_layout: str):
    """vLLM's ``KVCacheLayout`` whose per-layer view FlashInfer reads as ``kv_layout``."""
    from vllm.v1.kv_cache_interface import KVCacheLayout

    return KVCacheLayout[LAYOUTS[kv_layout]]


def vllm_cache(shard, kv_layout: str) -> torch.Tensor:
    """``shard`` (NHD ``(K, V)`` pages ``[B, page, Hkv, D]``) in vLLM's per-layer
    FlashInfer cache: logical ``[B, Hkv, page, 2 * D]`` (K then V in the last dim) over
    the memory order of the layout FlashInfer reads as ``kv_layout``."""
    k, v = shard
    blocks, page, hkv, dim = k.shape
    order = kv_cache_layout(kv_layout).layer_view_order
    logical = (blocks, hkv, page, 2 * dim)
    physical = torch.zeros([logical[i] for i in order], dtype=k.dtype, device=k.device)
    cache = physical.permute(*[order.index(i) for i in range(4)])
    k_view, v_view = cache_views(cache, kv_layout)
    if kv_layout == "HND":
        k, v = k.transpose(1, 2), v.transpose(1, 2)
    k_view.copy_(k), v_view.copy_(v)
    return cache


def cache_views(cache: torch.Tensor, kv_layout: str):
    """The ``(K, V)`` views FlashInfer reads of :func:`vllm_cache`: NHD ``[B, page, Hkv,
    D]`` or HND ``[B, Hkv, page, D]``."""
    order = kv_cache_layout(kv_layout).layer_view_order
    return cache.permute(*order).split(cache.shape[-1] // 2, dim=-1)


def make_impl(monkeypatch, world: int, rank: int, hq: int, hkv: int, dim: int, dcp: int):
    """A real ``PCPFlashInferImpl`` of ``rank`` at PCP = ``world``, DCP = ``dcp`` (the group
    sizes vLLM's ``AttentionImplBase.__new__`` reads, given), built outside a vLLM config
    as vLLM's CPU tests build layers."""
    import vllm.distributed.parallel_state as parallel_state
    import vllm.v1.attention.backends.flashinfer as flashinfer

    from vllm_pcp.backend import PCPFlashInferImpl

    monkeypatch.setattr(flashinfer, "can_use_trtllm_attention", lambda *a, **k: False)
    monkeypatch.setattr(parallel_state, "_DCP", SimpleNamespace(
        world_size=dcp, rank_in_group=rank if dcp > 1 else 0))
    monkeypatch.setattr(parallel_state, "get_pcp_group", lambda: SimpleNamespace(
        world_size=world, rank_in_group=rank))
    return PCPFlashInferImpl(hq, dim, 1 / math.sqrt(dim), hkv, None, None, "auto")


def layer_config(world, dcp, hq, hkv, dim, dtype, kv_layout, monkeypatch, tmp,
                 interleave=1, max_model_len=None, **knobs):
    """vLLM's own VllmConfig of ``-pcp world -dcp dcp`` on a small Qwen2 of these heads in
    ``dtype`` (``tmp``: its config.json), ``pcp_min_split_tokens`` 2 (the shortest split)
    and the other ``pcp_*`` knobs (by their name less the prefix), the KV cache layout
    resolved to ``kv_layout``."""
    from vllm.config import AttentionConfig

    from helpers import real_vllm_config

    config = real_vllm_config(
        tmp, monkeypatch, dict(prefill_context_parallel_size=world,
                               decode_context_parallel_size=dcp,
                               cp_kv_cache_interleave_size=interleave),
        hf=dict(hidden_size=hq * dim, num_attention_heads=hq, num_key_value_heads=hkv),
        dtype=str(dtype).removeprefix("torch."),
        attention_config=AttentionConfig(backend="FLASHINFER"),
        model={} if max_model_len is None else {"max_model_len": max_model_len},
        additional_config={"pcp_min_split_tokens": 2,
                           **{f"pcp_{name}": value for name, value in knobs.items()}})
    config.cache_config.kv_cache_layout = LAYOUTS[kv_layout]
    return config


def make_builder(monkeypatch, config, impl, page, dtype, device):
    """The plugin's builder of one KV cache group of one layer (``impl``), made by its own
    ``__init__`` (on the CPU, vLLM's FlashInfer builder as on a GPU without trtllm-gen
    kernels)."""
    import vllm.v1.attention.backends.flashinfer as flashinfer
    from vllm.config import set_current_vllm_config
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    from helpers import attention_layer, flashinfer_on_cpu
    from vllm_pcp.backend import PCPFlashInferMetadataBuilder

    if torch.device(device).type == "cpu":
        flashinfer_on_cpu(monkeypatch)
    dcp = config.parallel_config.decode_context_parallel_size
    monkeypatch.setattr(flashinfer, "get_dcp_group", lambda: SimpleNamespace(
        world_size=dcp, rank_in_group=0))
    config.compilation_config.static_forward_context["layers.0.attn"] = attention_layer(impl)
    spec = FullAttentionSpec(block_size=page, num_kv_heads=impl.num_kv_heads,
                             head_size=impl.head_size, dtype=dtype)
    with set_current_vllm_config(config):
        return PCPFlashInferMetadataBuilder(spec, ["layers.0.attn"], config,
                                           torch.device(device))


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


def _erase(views, slots, page, kv_layout):
    """The step's own slots set to SENTINEL: the layer has to write them."""
    owned = slots[slots >= 0]
    block, offset = owned // page, owned % page
    for view in views:  # in place: NHD [blocks, page, Hkv, D], HND [blocks, Hkv, page, D]
        if kv_layout == "HND":
            view[block, :, offset] = SENTINEL
        else:
            view[block, offset] = SENTINEL


class _RankContext:
    """What vLLM's process-wide state gives the running rank's thread: its PCP and DCP
    group, the layer's attention metadata of the step."""

    def __init__(self):
        self._local = threading.local()

    def set(self, **kw):
        self._local.__dict__.update(kw)

    def __getattr__(self, name):
        return getattr(self._local, name)


def run_dcp_layer_step(monkeypatch, world, interleave, exchange, device, dtype, hq=16,
                       hkv=2, dim=128, page=16, computed=COMPUTED, scheduled=SCHEDULED,
                       kv_layout="NHD", around_forward=None, max_model_len=None):
    """``(per-rank results, expected output)`` of a ``-pcp world -dcp world`` step: each
    rank's ``(restored output [T, Hq, D] float32 on the CPU, its cache after the step, the
    cache it should hold, its step)`` and causal attention of the whole batch.
    ``around_forward(rank)``: a context manager the layer's two calls run in."""
    import tempfile

    full, q = make_batch(hq, hkv, dim, 7 * world + interleave, computed, scheduled)
    full = [(k.to(dtype).float(), v.to(dtype).float()) for k, v in full]  # rounded once

    def rank_inputs(rank):
        shard, table = _paged_shard(full, rank, world, interleave, page, device, dtype)
        cache = vllm_cache(shard, kv_layout)
        expect_cache = cache.clone()
        slots = _step_slots(computed, scheduled, table, rank, world, interleave, page)
        _erase(cache_views(cache, kv_layout), slots, page, kv_layout)
        return cache, table, slots, expect_cache

    with tempfile.TemporaryDirectory() as tmp:
        config = layer_config(world, world, hq, hkv, dim, dtype, kv_layout, monkeypatch,
                              tmp, interleave, max_model_len, dcp_context_exchange=exchange)
        results = run_layer_step(monkeypatch, config, full, q, computed, scheduled, page,
                                 device, dtype, rank_inputs, around_forward)
    expect = expected_output(full, q.float(), computed, scheduled)
    return [(r.restored, r.cache, r.inputs[3], r.step) for r in results], expect


class LayerResult(SimpleNamespace):
    """One rank's run of :func:`run_layer_step`: ``restored`` (its output restored by
    vLLM's manager, ``[T, Hq, D]`` float32 on the CPU), ``output`` (the layer's ``[P, Hq,
    D]``), ``rows`` (the step tokens of its ``P`` input rows), ``cache``, ``metadata``,
    ``step``, ``table`` and what ``rank_inputs`` gave (``inputs``)."""


def run_layer_step(monkeypatch, config, full, q, computed, scheduled, page, device, dtype,
                   rank_inputs, around_forward=None) -> list[LayerResult]:
    """One layer of one step on every rank of ``config``'s PCP group, as vLLM's runner
    drives it: the manager's partition of the global batch, its gathered slot mapping
    of the global one, the local rows' block table, the plugin's builder and layer, vLLM's
    restore. ``full``: each request's K/V ``[C + S, Hkv, D]``; ``q``: the step's queries
    ``[T, Hq, D]``; ``rank_inputs(rank)``: ``(cache, block table [R, pages], global slot
    mapping [T], ...)`` of the rank."""
    import vllm.v1.worker.gpu.pcp_manager as pcp_manager

    import vllm_pcp.backend as backend
    from manager_harness import descriptor, global_batch, managers
    from vllm_pcp.knobs import PCPSettings

    parallel = config.parallel_config
    world, dcp = parallel.prefill_context_parallel_size, parallel.decode_context_parallel_size
    hq, hkv, dim = q.shape[1], full[0][0].shape[1], q.shape[2]
    q = q.to(device, dtype)
    k_step = torch.cat([k[c:] for (k, _), c in zip(full, computed)]).to(device, dtype)
    v_step = torch.cat([v[c:] for (_, v), c in zip(full, computed)]).to(device, dtype)
    group, ctx = ThreadGroup(world), _RankContext()
    for name in ("get_pcp_group", "get_dcp_group"):
        monkeypatch.setattr(backend, name, lambda: ctx.group)
    monkeypatch.setattr(pcp_manager, "get_pcp_group", lambda: ctx.group)
    monkeypatch.setattr(backend, "_layer_metadata", lambda layer: ctx.metadata)
    impls = [make_impl(monkeypatch, world, r, hq, hkv, dim, dcp) for r in range(world)]
    builders = [make_builder(monkeypatch, config, impl, page, dtype, device) for impl in impls]
    ranks = managers(world, PCPSettings.from_vllm_config(config))
    around = around_forward or (lambda rank: contextlib.nullcontext())

    def rank_fn(rank):
        ctx.set(group=group.rank(rank))
        manager, impl = ranks[rank], impls[rank]
        local = manager.partition_batch(global_batch(computed, scheduled), descriptor())
        step = local.pcp.step
        inputs = rank_inputs(rank)
        cache, table, slots = inputs[:3]
        slot_mapping = manager._convert_to_gathered_slot_mappings(
            slots.cpu().unsqueeze(0))[0].clone().to(device)
        local_table = table[local.idx_mapping[:local.num_reqs].to(table.device)]
        metadata = builders[rank].build(0, SimpleNamespace(
            block_table_tensor=local_table, slot_mapping=slot_mapping,
            num_actual_tokens=local.num_tokens), pcp_step=step)
        ctx.set(metadata=metadata)
        layer = SimpleNamespace(layer_name="l0", _k_scale=torch.ones(1, device=device),
                                _v_scale=torch.ones(1, device=device))
        rows = step.plan.model_input_indices.to(device)  # P rows: local tokens, pad rows
        assert len(rows) == local.num_tokens_after_padding
        output = torch.full((len(rows), hq, dim), float("nan"), dtype=dtype, device=device)
        q_rows, k_rows, v_rows = q[rows], k_step[rows], v_step[rows]
        with around(rank):
            impl.do_kv_cache_update(layer, k_rows, v_rows, cache, slot_mapping)
            impl.forward(layer, q_rows, k_rows, v_rows, cache, metadata, output)
        restored = manager.restore_hidden_states(output.reshape(len(rows), hq * dim))
        return LayerResult(restored=restored.reshape(-1, hq, dim).float().cpu(),
                           output=output, rows=rows, cache=cache, metadata=metadata,
                           step=step, table=table, inputs=inputs)

    return group.run(rank_fn)
