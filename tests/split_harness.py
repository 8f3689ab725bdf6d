"""Run the plugin's FlashInfer layer on one fresh split step at DCP = 1 (the ragged kernel,
:mod:`vllm_pcp.pcp.ragged`) for every rank of a thread group, as vLLM's runner drives it
(``tests/layer_harness.py``: the manager's split and slot mapping, the plugin's builder
and layer, vLLM's restore).

Shared by the CPU test (FlashInfer's kernels and vLLM's cache write replaced by plain
torch) and the GPU test (real FlashInfer, vLLM's cache kernel). Every rank starts from an
empty KV cache in vLLM's layout; the layer must write every token of the step into it
(the whole cache on every rank) and attend its local rows.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch

from dcp_harness import expected_output, make_batch
from layer_harness import cache_views, layer_config, run_layer_step, vllm_cache

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
    metadata: object  # what the plugin's builder made of the step


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


def _read_slots(kv, slots, kv_layout):
    """``(K, V)`` rows ``[T, Hkv, D]`` at ``slots`` of the cache views."""
    page, offset = slots // PAGE, slots % PAGE
    if kv_layout == "HND":  # [pages, Hkv, page_size, D]
        return tuple(view[page, :, offset] for view in kv)
    return tuple(view[page, offset] for view in kv)


def run_ragged_split_step(monkeypatch, world, scheduled, device, dtype, hq=8, hkv=2, dim=64,
                          seed=0, kv_layout="NHD", split_attention="auto",
                          around_forward=None):
    """``(per-rank RankResult, expected [T, Hq, D])`` of one fresh step of the prompts
    ``scheduled`` under ``-pcp world`` (``pcp_min_split_tokens`` 2: every prompt of at
    least 4N tokens split, shorter ones computed whole on every rank); expected: causal
    attention of each whole prompt (float32). ``around_forward(rank)``: a context manager
    the layer's calls run in (default none)."""
    import tempfile

    scheduled = list(scheduled)
    computed = [0] * len(scheduled)
    full, q = make_batch(hq, hkv, dim, seed, computed=computed, scheduled=scheduled)
    full = [(k.to(dtype).float(), v.to(dtype).float()) for k, v in full]  # rounded once
    q = q.to(dtype)
    table = _block_table(scheduled, device)
    slots = _step_slots(scheduled, table).to(device)

    def rank_inputs(rank):
        blocks = table.numel()
        empty = torch.zeros(blocks, PAGE, hkv, dim, dtype=dtype, device=device)
        return vllm_cache((empty, empty.clone()), kv_layout), table, slots

    with tempfile.TemporaryDirectory() as tmp:
        config = layer_config(world, 1, hq, hkv, dim, dtype, kv_layout, monkeypatch, tmp,
                              split_attention=split_attention)
        results = run_layer_step(monkeypatch, config, full, q, computed, scheduled, PAGE,
                                 device, dtype, rank_inputs,
                                 around_forward or (lambda rank: contextlib.nullcontext()))
    k_step = torch.cat([k for k, _ in full]).to(device, dtype)
    v_step = torch.cat([v for _, v in full]).to(device, dtype)
    out = []
    for result in results:
        n, kv = result.step.plan.num_local_tokens, cache_views(result.cache, kv_layout)
        k_written, v_written = _read_slots(kv, slots, kv_layout)
        written = torch.equal(k_written, k_step) and torch.equal(v_written, v_step)
        out.append(RankResult(result.restored, result.output[:n],
                              q.to(device)[result.rows[:n]], kv, kv_layout, written,
                              result.step.plan, table, result.metadata))
    return out, expected_output(full, q.float(), computed=computed, scheduled=scheduled)
