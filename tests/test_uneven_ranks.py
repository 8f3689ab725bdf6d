"""Split steps whose ranks hold unequal or no local tokens, through the runner.

A split chunk shorter than 2N tokens leaves ranks with no local tokens at N >= 3;
a decode beside a split prefill gives ranks unequal counts at any N. Every rank runs
the model on ``P`` rows (its local tokens, then pad rows), so that collectives inside
the model line up: vLLM 0.26.0's fused MoE with PCP all-gathers the hidden states
over the PCP group and reduce-scatters the expert sums
(``fused_moe/runner/moe_runner.py``, ``_maybe_dispatch`` / ``_maybe_combine``).

Without CP vs with CP: a one-layer model (K/V exchange and cache write through
``PCPFlashInferImpl``, attention, a MoE whose experts are sharded over the ranks)
must restore, on every rank, what one process computes, and write every token's K/V
exactly once.
"""
import os
import socket
import threading
from datetime import timedelta
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from vllm.v1.attention.backends.flashinfer import FlashInferImpl

import vllm_pcp.backend as backend_mod
import vllm_pcp.runner as runner_mod
from helpers import ThreadGroup
from test_runner_cpu import _make_runner
from vllm_pcp.backend import PCPFlashInferImpl, PCPFlashInferMetadataBuilder, PCPSplitMetadata
from vllm_pcp.pcp.partition import build_pcp_metadata
from vllm_pcp.runner import PCPStep

ZERO_TOKEN_STEPS = {  # (computed, scheduled): some rank gets no local token
    3: ([40], [2]), 4: ([16384], [2]), 8: ([70], [5])}
UNEQUAL_STEPS = {  # a decode beside a split prefill: local counts differ by one
    2: ([30, 0], [1, 9]), 4: ([30, 12], [1, 13])}


class _Builder(PCPFlashInferMetadataBuilder):
    def build(self, common_prefix_len, common_attn_metadata, fast_build=False):
        cm = common_attn_metadata
        return SimpleNamespace(num_actual_tokens=cm.num_actual_tokens)


def _expert(h: torch.Tensor, expert: int) -> torch.Tensor:
    return torch.tanh(h * (expert + 1))


def _moe(group, x: torch.Tensor) -> torch.Tensor:
    """vLLM's PCP MoE: all-gather the rows, this rank's expert over all of them,
    reduce-scatter the sums (blocks of ``len(x)`` rows, rank order)."""
    rank, world = group.rank_in_group, group.world_size
    mine = _expert(group.all_gather(x, dim=0), rank)
    summed = group.all_gather(mine.unsqueeze(0), dim=0).sum(0)
    return summed[rank * len(x):(rank + 1) * len(x)]


def _one_process(input_ids, positions, world):
    x = torch.stack([input_ids.float(), positions.float()], dim=1)
    h = 3 * x  # attention (2 x, the fake kernel) plus the residual
    return sum(_expert(h, e) for e in range(world))


def _fake_stock_forward(self, layer, query, key, value, kv_cache, attn_metadata, output,
                        output_scale=None, output_block_scale=None):
    n = attn_metadata.num_actual_tokens
    output.fill_(float("nan"))  # vLLM's output buffer is torch.empty: pad rows hold anything
    output[:n] = 2 * query[:n]
    return output


def _step_inputs(computed, scheduled):
    positions = torch.cat([c + torch.arange(s) for c, s in zip(computed, scheduled)])
    input_ids = torch.arange(len(positions)) * 7 + 1
    slots = torch.arange(len(positions), dtype=torch.int64) * 3 + 5
    return input_ids, positions, slots


def _run_rank(group, rank, computed, scheduled, contexts, written):
    """One rank's split step: plan, metadata, forward; (output, model input rows)."""
    input_ids, positions, slots = _step_inputs(computed, scheduled)
    runner = _make_runner(SimpleNamespace(rank=lambda r: group, world_size=group.world_size),
                          rank)
    builder = object.__new__(_Builder)
    runner.attn_groups = [[SimpleNamespace(layer_names=["l0"],
                                           get_metadata_builder=lambda i: builder)]]
    runner.positions = positions
    runner.input_batch.num_reqs = len(scheduled)
    plan = build_pcp_metadata(computed, scheduled, group.world_size, rank, min_split_tokens=2)
    runner._step = PCPStep(plan)
    metadata = runner._build_attention_metadata(slot_mappings={0: slots})[0]["l0"]
    impl = object.__new__(PCPFlashInferImpl)
    impl.pcp_world_size, impl.dcp_world_size = group.world_size, 1
    layer = SimpleNamespace(metadata=metadata)
    model_rows = []

    def model(input_ids, positions, intermediate_tensors=None, inputs_embeds=None):
        x = torch.stack([input_ids.float(), positions.float()], dim=1)  # [P, 2]
        model_rows.append(len(x))
        kv = x.unsqueeze(1)
        impl.do_kv_cache_update(layer, kv, kv, rank, "vllm's local slot mapping")
        out = impl.forward(layer, x, kv, kv, None, metadata, torch.empty_like(x))
        assert torch.isfinite(out).all()  # pad rows included: MoE routing reads them
        return _moe(group, out + x)

    runner.model = model
    contexts.ctx = SimpleNamespace(slot_mapping=None, cudagraph_runtime_mode=None,
                                   batch_descriptor=None, is_padding=None)
    return runner._model_forward(input_ids, positions), model_rows, plan


def _patch_layers(monkeypatch, written):
    monkeypatch.setattr(FlashInferImpl, "forward", _fake_stock_forward)
    monkeypatch.setattr(FlashInferImpl, "do_kv_cache_update",
                        lambda self, layer, k, v, cache, slots: written.__setitem__(
                            cache, dict(zip(slots.tolist(), k[:, 0].tolist()))))
    monkeypatch.setattr(backend_mod, "_layer_metadata", lambda layer: layer.metadata)


def _check_step(outs, rows, written, computed, scheduled, world):
    input_ids, positions, slots = _step_inputs(computed, scheduled)
    expect = _one_process(input_ids, positions, world)
    for out in outs:
        torch.testing.assert_close(out, expect)
    assert len(set(rows)) == 1  # every rank's model input has the same length
    x = torch.stack([input_ids.float(), positions.float()], dim=1)
    for rank in range(world):  # every token's K/V written once, at its slot, on every rank
        kept = {s: k for s, k in written[rank].items() if s >= 0}
        assert kept == dict(zip(slots.tolist(), x.tolist()))


def _run_threads(monkeypatch, world, computed, scheduled):
    group, contexts, written = ThreadGroup(world), threading.local(), {}
    monkeypatch.setattr(runner_mod, "get_forward_context", lambda: contexts.ctx)
    _patch_layers(monkeypatch, written)
    results = group.run(lambda r: _run_rank(group.rank(r), r, computed, scheduled,
                                            contexts, written))
    outs = [out for out, _, _ in results]
    rows = [n for _, model_rows, _ in results for n in model_rows]
    _check_step(outs, rows, written, computed, scheduled, world)
    return results[0][2]


@pytest.mark.parametrize("world", sorted(ZERO_TOKEN_STEPS))
def test_ranks_without_local_tokens_join_every_exchange(monkeypatch, world):
    plan = _run_threads(monkeypatch, world, *ZERO_TOKEN_STEPS[world])
    assert 0 in plan.num_tokens_per_rank


@pytest.mark.parametrize("world", sorted(UNEQUAL_STEPS))
def test_moe_collectives_see_the_same_rows_on_every_rank(monkeypatch, world):
    plan = _run_threads(monkeypatch, world, *UNEQUAL_STEPS[world])
    assert len(set(plan.num_tokens_per_rank)) > 1


def test_a_rank_without_rows_plans_no_kernel(monkeypatch):
    group = ThreadGroup(3)
    runner = _make_runner(group, 1)
    runner.positions = torch.tensor([40, 41])
    runner.input_batch.num_reqs = 1
    plan = build_pcp_metadata([40], [2], 3, 1, min_split_tokens=2)
    assert plan.num_local_tokens == 0 and plan.num_padded_tokens_per_rank == 1
    metadata, inputs = runner._build_split_metadata(plan, {0: torch.tensor([7, 8])})
    assert isinstance(metadata["l0"], PCPSplitMetadata) and metadata["l0"].local is None
    assert metadata["l1"] is not None
    assert metadata["l0"].exchange.num_padded_tokens_per_rank == 1
    assert inputs.model_input_indices.tolist() == [0]  # one pad row
    impl = object.__new__(PCPFlashInferImpl)
    out = impl.forward(None, None, None, None, None, metadata["l0"], torch.ones(1, 4))
    assert (out == 0).all()


class _GlooGroup:
    def __init__(self):
        self.world_size, self.rank_in_group = dist.get_world_size(), dist.get_rank()

    def all_gather(self, x, dim=0):
        parts = [torch.empty_like(x) for _ in range(self.world_size)]
        dist.all_gather(parts, x.contiguous())
        return torch.cat(parts, dim=dim)


def _gloo_worker(rank, world, port, computed, scheduled, results):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world,
                            timeout=timedelta(seconds=60))
    try:
        with pytest.MonkeyPatch.context() as monkeypatch:
            contexts, written = threading.local(), {}
            monkeypatch.setattr(runner_mod, "get_forward_context", lambda: contexts.ctx)
            _patch_layers(monkeypatch, written)
            out, rows, _ = _run_rank(_GlooGroup(), rank, computed, scheduled, contexts,
                                     written)
            results[rank] = (out, rows[0], written[rank])
    finally:
        dist.destroy_process_group()


def test_ranks_without_local_tokens_on_gloo_processes():
    world, (computed, scheduled) = 3, ZERO_TOKEN_STEPS[3]
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    results = mp.Manager().dict()
    mp.spawn(_gloo_worker, args=(world, port, computed, scheduled, results), nprocs=world,
             join=True)
    got = [results[r] for r in range(world)]
    _check_step([g[0] for g in got], [g[1] for g in got], {r: g[2] for r, g in enumerate(got)},
                computed, scheduled, world)


@pytest.mark.parametrize("n", sorted(ZERO_TOKEN_STEPS))
def test_step_counts_tell_which_split_steps_left_ranks_without_tokens(n):
    """The evidence the engine checks read (``collective_rpc("pcp_step_counts")``): a
    zero-token step is counted by every rank, as its own by the ranks that had none."""
    computed, scheduled = ZERO_TOKEN_STEPS[n]
    plans = [build_pcp_metadata(computed, scheduled, n, r) for r in range(n)]
    even = build_pcp_metadata([0], [8 * n], n, 0)
    counts = []
    for plan in plans:
        c = runner_mod.PCPStepCounts()
        for step in (plan, even, None):  # None: a step the runner ran stock
            c.count(step)
        counts.append(c)
    assert all((c.split_steps, c.steps_with_rank_without_tokens) == (2, 1) for c in counts)
    empty = [r for r, p in enumerate(plans) if p.num_local_tokens == 0]
    assert empty and [c.steps_without_local_tokens for c in counts] == [
        int(r in empty) for r in range(n)]


@pytest.mark.parametrize("ranks", [4, 8])
def test_the_engine_cases_make_a_step_with_ranks_without_tokens(ranks):
    """The engine suite's exactness cases (tests/engine/cases.py) hold a split chunk
    shorter than 2N tokens under chunked prefill (len_4099's last), a step in which some
    rank gets no local tokens at -pcp 4 -dcp 4 and 8."""
    import cases
    import worker
    from vllm_pcp.pcp.partition import build_pcp_metadata_all_ranks

    chunk = worker.VARIANTS["chunked"]
    tails = [(n - n % chunk, n % chunk) for c in cases.build_cases(33000, 32000)
             if c["kind"] == "batch" for n in map(len, c["prompts"])
             if n > chunk and 2 <= n % chunk < 2 * ranks]
    plans = [build_pcp_metadata_all_ranks([c], [t], ranks, min_split_tokens=2,
                                          prefill_lens=[c + t])[0] for c, t in tails]
    assert plans and all(p.num_split_requests == 1 for p in plans)
    assert any(min(p.num_tokens_per_rank) == 0 for p in plans)
