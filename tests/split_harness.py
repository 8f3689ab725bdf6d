"""Run the plugin's FlashInfer layer on one fresh split step at DCP = 1 (the ragged
kernel, :mod:`vllm_pcp.pcp.ragged`) for every rank of a thread group.

Shared by the CPU test (FlashInfer's kernels and vLLM's cache write replaced by
plain torch) and the GPU test (real FlashInfer, vLLM's cache kernel). Every rank
starts from an empty vLLM-layout KV cache; the layer must write every token of
the step into it (the whole cache on every rank) and attend its local rows.
"""
from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass
from types import SimpleNamespace

import torch

from dcp_harness import expected_output, make_batch
from helpers import ThreadGroup
from layer_harness import _vllm_cache

PAGE = 16


@dataclass
class RankResult:
    restored: torch.Tensor  # [T, Hq, D] float32 on the CPU, the step's output in global order
    out_local: torch.Tensor  # [L, Hq, D] this rank's rows, as the layer wrote them
    q_local: torch.Tensor  # [L, Hq, D]
    kv: tuple  # the layer's (K, V) views of its cache, in ``kv_layout``
    kv_layout: str
    cache_written: bool  # the cache holds every token of the step at its slot, exactly
    plan: object  # PrefillContextParallelMetadata
    table: torch.Tensor  # [num_reqs, pages] block table


def _make_impl(monkeypatch, world, rank, hq, hkv, dim):
    """A real PCPFlashInferImpl of rank ``rank`` at PCP = ``world``, DCP = 1."""
    import vllm.distributed.parallel_state as parallel_state

    from vllm_pcp.backend import PCPFlashInferImpl

    monkeypatch.setattr(parallel_state, "get_pcp_group", lambda: SimpleNamespace(
        world_size=world, rank_in_group=rank))
    monkeypatch.setattr(parallel_state, "get_dcp_group", lambda: SimpleNamespace(
        world_size=1, rank_in_group=0))
    return PCPFlashInferImpl(hq, dim, 1 / math.sqrt(dim), hkv, None, None, "auto")


def _block_table(scheduled, device):
    """Request q owns pages ``q * pages .. (q + 1) * pages``, in order."""
    pages = max(-(-s // PAGE) for s in scheduled)
    return (torch.arange(len(scheduled) * pages, dtype=torch.int32)
            .reshape(len(scheduled), pages).to(device))


def _step_slots(scheduled, table):
    """vLLM's slot mapping of the step's tokens (``[T]``): all of them, fresh prompts."""
    table = table.cpu().long()
    return torch.cat([table[q][torch.arange(s) // PAGE] * PAGE + torch.arange(s) % PAGE
                      for q, s in enumerate(scheduled)])


def run_ragged_split_step(monkeypatch, world, scheduled, device, dtype, hq=8, hkv=2, dim=64,
                          seed=0, min_split_tokens=2, around_forward=None):
    """``(per-rank RankResult, expected [T, Hq, D])`` of one fresh step of the prompts
    ``scheduled`` split over ``world`` ranks; expected: causal attention of each whole
    prompt (float32). ``around_forward(rank)``: a context manager the layer's forward
    runs in (default none)."""
    from vllm.config import DeviceConfig, VllmConfig, set_current_vllm_config

    with set_current_vllm_config(VllmConfig(device_config=DeviceConfig(device="cuda"))):
        return _run(monkeypatch, world, list(scheduled), device, dtype, hq, hkv, dim, seed,
                    min_split_tokens, around_forward or (lambda rank: contextlib.nullcontext()))


def _read_slots(kv, slots, kv_layout):
    """``(K, V)`` rows ``[T, Hkv, D]`` at ``slots`` of the cache views."""
    page, offset = slots // PAGE, slots % PAGE
    if kv_layout == "HND":  # [pages, Hkv, page_size, D]
        return tuple(view[page, :, offset] for view in kv)
    return tuple(view[page, offset] for view in kv)


def _run(monkeypatch, world, scheduled, device, dtype, hq, hkv, dim, seed, min_split_tokens,
         around_forward):
    from vllm.v1.attention.backends.utils import get_kv_cache_layout

    from vllm_pcp.backend import KVExchange, PCPSplitMetadata
    from vllm_pcp.pcp.exchange import gathered_slot_mapping, restore_hidden_states
    from vllm_pcp.pcp.partition import build_pcp_metadata
    from vllm_pcp.pcp.ragged import RaggedSplitAttention

    computed = [0] * len(scheduled)
    full, q = make_batch(hq, hkv, dim, seed, computed=computed, scheduled=scheduled)
    full = [(k.to(dtype).float(), v.to(dtype).float()) for k, v in full]  # rounded once
    q = q.to(dtype)
    k_step = torch.cat([k for k, _ in full]).to(device, dtype)
    v_step = torch.cat([v for _, v in full]).to(device, dtype)
    q_dev, group = q.to(device), ThreadGroup(world)
    impls = [_make_impl(monkeypatch, world, r, hq, hkv, dim) for r in range(world)]
    table = _block_table(scheduled, device)
    slots = _step_slots(scheduled, table).to(device)
    kv_layout = get_kv_cache_layout()

    def rank_fn(rank):
        impl = impls[rank]
        plan = build_pcp_metadata(computed, scheduled, world, rank,
                                  min_split_tokens=min_split_tokens)
        blocks = table.numel()
        empty = torch.zeros(blocks, PAGE, hkv, dim, dtype=dtype, device=device)
        cache = _vllm_cache(impl, (empty, empty.clone()), kv_layout)
        workspace = torch.empty(128 << 20, dtype=torch.uint8, device=device)
        ragged = RaggedSplitAttention(workspace, hq, hkv, dim, dtype, 1 / math.sqrt(dim))
        padded = plan.num_padded_tokens_per_rank
        metadata = PCPSplitMetadata(
            KVExchange(group.rank(rank), padded),
            gathered_slot_mapping(slots, plan.gathered_token_indices.to(device)), None,
            ragged.plan(plan, scheduled, torch.device(device)))
        layer = SimpleNamespace(layer_name="l0", _k_scale=torch.ones(1, device=device),
                                _v_scale=torch.ones(1, device=device))
        rows = plan.model_input_indices.to(device)  # P rows: local tokens, then pad rows
        output = torch.full((padded, hq, dim), float("nan"), dtype=dtype, device=device)
        q_rows, k_rows, v_rows = q_dev[rows], k_step[rows], v_step[rows]
        with around_forward(rank):
            impl.forward(layer, q_rows, k_rows, v_rows, cache, metadata, output)
        restored = restore_hidden_states(group.rank(rank), output.reshape(padded, hq * dim),
                                         padded, plan.restore_indices.to(device))
        n, kv = plan.num_local_tokens, impl._kv_views(cache)
        k_written, v_written = _read_slots(kv, slots, kv_layout)
        written = torch.equal(k_written, k_step) and torch.equal(v_written, v_step)
        return RankResult(restored.reshape(-1, hq, dim).float().cpu(), output[:n],
                          q_dev[rows[:n]], kv, kv_layout, written, plan, table)

    expect = expected_output(full, q.float(), computed=computed, scheduled=scheduled)
    return group.run(rank_fn), expect

