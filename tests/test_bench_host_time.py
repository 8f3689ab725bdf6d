"""benchmarks/host_time.py on the CPU: every step of both layouts is split by the plugin's
manager, plans and runs (FlashInfer replaced by the reference kernels, the steps' lengths
divided by 64); its ratios; its timing of nested calls."""
import os
import sys

import pytest
import torch

ROOT = os.path.join(os.path.dirname(__file__), "..")
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
import host_time  # noqa: E402
import fake_flashinfer  # noqa: E402

CPU = torch.device("cpu")


@pytest.fixture
def reference_flashinfer(monkeypatch):
    """FlashInfer's wrappers computed by the reference kernels (16-bit outputs); vLLM's
    FlashInfer planning without pinned host buffers, which need a CUDA driver."""
    import vllm.utils.flashinfer as vllm_flashinfer

    fake_flashinfer.install(monkeypatch, float32=False)
    if not torch.cuda.is_available():
        monkeypatch.setattr(vllm_flashinfer, "PIN_MEMORY", False)


def test_every_step_plans_and_runs(reference_flashinfer):
    rows = host_time.measure(CPU, scale=64)
    assert [(r["step"], r["layout"]) for r in rows] == [
        ("mixed", "pcp2-dcp2-i8-keys"), ("mixed", "pcp2"), ("mixed", "pcp2-dcp2-i8-queries"),
        ("prefill", "pcp2-dcp2-i8-keys"), ("prefill", "pcp2"), ("decode", "pcp2-dcp2-i8-keys"),
        ("decode", "pcp2")]
    assert all(r["plan_ms"] > 0 and r["layer_ms"] > 0 and r["gpu_ms"] is None
               and r["plan_waits"] is None and r["syncs"] is None and r["sync_sites"] == []
               for r in rows)
    for r in rows:  # the manager, the DCP plan and FlashInfer's plans timed apart
        parts = r["plan_parts_ms"]
        assert list(parts) == ["partition", "dcp_plan", "flashinfer", "rest"], parts
        assert parts["partition"] > 0 and parts["flashinfer"] > 0 and parts["rest"] >= 0
        assert (parts["dcp_plan"] > 0) is (r["layout"] != "pcp2"), (r["layout"], parts)
    for r in rows:  # the plan's and the layer's own host time by function, most first
        for top in (r["plan_top"], r["layer_top"]):
            assert 0 < len(top) <= 12 and all(calls > 0 for _, calls, _ in top)
            assert [ms for *_, ms in top] == sorted((ms for *_, ms in top), reverse=True)


def _rank0_chunk_tokens(scheduled: int, world: int = 2) -> int:
    """Rank 0's chunks of a split request: the first and the last of 2N."""
    n = 2 * world
    return scheduled // n + scheduled - scheduled * (n - 1) // n


MIXED_ROWS = 15 + _rank0_chunk_tokens(256 - 128 - 15)  # at scale 64: 15 decodes, the chunk


@pytest.mark.parametrize("make,rows", [
    (lambda: host_time.pcp_layer("mixed", CPU, 64), MIXED_ROWS),
    (lambda: host_time.pcp_layer("decode", CPU, 64), 15),
    (lambda: host_time.dcp_layer("mixed", "queries", CPU, 64), MIXED_ROWS),
    (lambda: host_time.dcp_layer("mixed", "keys", CPU, 64), MIXED_ROWS),
    (lambda: host_time.dcp_layer("prefill", "keys", CPU, 64), _rank0_chunk_tokens(128)),
    (lambda: host_time.dcp_layer("decode", "keys", CPU, 64), 15)])
def test_a_layer_attends_the_ranks_rows(reference_flashinfer, make, rows):
    """Rank 0's rows (every decode, its chunks of the split one), every output finite; a
    plan again gives the same layer."""
    plan, layer = make()
    plan()
    out = layer().clone()
    assert out.shape == (rows, 16, 128) and torch.isfinite(out).all()
    plan()
    torch.testing.assert_close(layer(), out)


def test_slots_are_the_dcp_ranks_own_tokens():
    """Rank 0 of 2 at interleave 2 stores positions 0, 1, 4, 5, ... of each request at its
    shard's offsets 0, 1, 2, 3, ... in the request's pages."""
    from bench_steps import dcp_slots

    table, page = torch.tensor([[3, 4], [7, 8]], dtype=torch.int32), host_time.PAGE
    slots = dcp_slots([0, 16], [5, 2], table, page, 2, 2)
    assert slots.tolist() == [3 * page, 3 * page + 1, -1, -1, 3 * page + 2,
                              7 * page + 8, 7 * page + 9]
    whole = dcp_slots([0, 15], [3, 2], table, page)
    assert whole.tolist() == [3 * page, 3 * page + 1, 3 * page + 2, 7 * page + 15, 8 * page]


def test_ratios_take_a_plan_and_36_layers_against_pcp2():
    rows = [{"step": "mixed", "layout": "pcp2", "plan_ms": 1.0, "layer_ms": 0.5},
            {"step": "mixed", "layout": "pcp2-dcp2-i8-keys", "plan_ms": 2.0, "layer_ms": 1.0}]
    assert host_time.ratios(rows) == [{"step": "mixed", "layout": "pcp2-dcp2-i8-keys",
                                       "host_ms_per_step": 38.0, "over_pcp2": 2.0}]


def test_a_timed_call_inside_another_counts_once(monkeypatch):
    """vLLM's fast_plan_decode calls the wrapper's plan: both are timed, counted once."""
    ticks = iter(range(100))
    monkeypatch.setattr(host_time, "_clock", lambda: next(ticks) / 1e3)  # 1 ms a reading
    parts = {}
    plan = host_time._timed(lambda: None, parts, "flashinfer")
    fast_plan = host_time._timed(plan, parts, "flashinfer")
    fast_plan()  # readings 0 and 1: the inner plan is not read
    plan()       # readings 2 and 3
    assert parts["flashinfer"] == 2.0
