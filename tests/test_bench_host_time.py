"""benchmarks/host_time.py on the CPU: every step of both layouts plans and runs (FlashInfer
replaced by the reference kernels, the steps' lengths divided by 64), and its ratios."""
import os
import sys

import torch

ROOT = os.path.join(os.path.dirname(__file__), "..")
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
import host_time  # noqa: E402
from test_dcp_attention_cpu import reference_flashinfer  # noqa: E402,F401  (the fixture)


def test_every_step_plans_and_runs_and_attends_its_rows(reference_flashinfer):
    rows = host_time.measure(torch.device("cpu"), scale=64)
    assert [(r["step"], r["layout"]) for r in rows] == [
        ("mixed", "pcp2-dcp2-i8-keys"), ("mixed", "pcp2"), ("mixed", "pcp2-dcp2-i8-queries"),
        ("prefill", "pcp2-dcp2-i8-keys"), ("prefill", "pcp2"), ("decode", "pcp2-dcp2-i8-keys"),
        ("decode", "pcp2")]
    assert all(r["plan_ms"] > 0 and r["layer_ms"] > 0 and r["gpu_ms"] is None
               and r["plan_waits"] is None and r["syncs"] is None and r["sync_sites"] == []
               for r in rows)
    for r in rows:  # the split and FlashInfer's plans timed apart, the rest the plugin's
        parts = r["plan_parts_ms"]
        assert list(parts) == ["split", "flashinfer", "rest"] and parts["split"] > 0
        assert parts["flashinfer"] > 0 and parts["rest"] >= 0, (r["step"], r["layout"], parts)
    for r in rows:  # the plan's and the layer's own host time by function, most first
        for top in (r["plan_top"], r["layer_top"]):
            assert 0 < len(top) <= 12 and all(calls > 0 for _, calls, _ in top)
            assert [ms for *_, ms in top] == sorted((ms for *_, ms in top), reverse=True)
        assert any("plan" in where for where, *_ in r["plan_top"]), r["plan_top"]
    cpu = torch.device("cpu")
    for make in (lambda: host_time.pcp_layer("mixed", cpu, 64),
                 lambda: host_time.dcp_layer("mixed", "queries", cpu, 64),
                 lambda: host_time.dcp_layer("decode", "keys", cpu, 64)):
        plan, layer = make()
        plan()
        out = layer()  # the rank's rows, finite
        assert out.shape[0] >= 15 and out.shape[1:] == (16, 128) and torch.isfinite(out).all()


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

