"""The per-layer collectives and kernel calls of PCP x DCP attention, counted by
scripts/bench_dcp_host.py on the meta device (no GPU): one K/V collective per layer
for a split chunk that fetches its context, and every layer's work on every step shape."""
import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "scripts"))
import bench_dcp_host  # noqa: E402


@pytest.mark.parametrize("step,exchange,collectives,runs", [
    ("mixed", "keys", 2, 2),     # K/V (+ context) all-gather; replicated rows' partials
    ("mixed", "queries", 4, 3),  # + the split rows' queries out and partials back
    ("prefill", "keys", 1, 1),   # the first chunk: no context, one K/V all-gather
    ("decode", "keys", 1, 1),    # one shard call, one packed all-gather of the partials
])
def test_collectives_and_kernel_calls_per_layer(step, exchange, collectives, runs):
    row = bench_dcp_host.measure(step, exchange, interleave=8)
    assert hasattr(sys.modules["flashinfer"], "__file__")  # the stand-ins do not leak
    assert (row["collectives"], row["flashinfer_runs"]) == (collectives, runs)
    assert 0 <= row["kernel_ops"] <= row["aten_ops"]
    if step == "decode":  # a decode layer launches the kernel, the gather, the merge only
        assert row["kernel_ops"] == 0
