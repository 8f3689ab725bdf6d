"""benchmarks/dcp_host.py, run for real on the CPU: one PCP x DCP layer's collectives and
FlashInfer calls at each step shape."""
import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))
import dcp_host  # noqa: E402


@pytest.mark.parametrize("step,exchange,collectives,runs", [
    ("mixed", "keys", 2, 2),     # K/V (+ context) all-gather; replicated rows' partials
    ("mixed", "queries", 4, 3),  # + the split rows' queries out and partials back
    ("prefill", "keys", 1, 1),   # the first chunk: no context, one K/V all-gather
    ("decode", "keys", 1, 1),    # one shard call, one packed all-gather of the partials
])
def test_collectives_and_kernel_calls_per_layer(step, exchange, collectives, runs):
    row = dcp_host.measure(step, exchange)
    assert hasattr(sys.modules["flashinfer"], "__file__")  # the stand-ins do not leak
    assert (row["collectives"], row["flashinfer_runs"]) == (collectives, runs)
    assert 0 <= row["kernel_ops"] <= row["aten_ops"] == sum(row["ops"].values())
    if step == "decode":  # a decode layer launches the kernel, the gather, the merge only
        assert row["kernel_ops"] == 0
    later = row["later_layer"]  # a later layer of the same step makes the same calls
    assert (later["collectives"], later["flashinfer_runs"]) == (collectives, runs)
    assert 0 <= later["kernel_ops"] <= later["aten_ops"] <= row["aten_ops"]
    assert row["plan_host_ms"] > 0
