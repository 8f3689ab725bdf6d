"""benchmarks/dcp_host.py, run for real on the CPU: one PCP x DCP layer's collectives and
FlashInfer calls at each step shape, the step split by the plugin's manager."""
import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))
import dcp_host  # noqa: E402


@pytest.mark.parametrize("step,exchange,collectives,runs,gathered", [
    ("mixed", "keys", 2, 2, True),     # K/V (+ context) all-gather; replicated rows' partials
    ("mixed", "queries", 4, 3, True),  # + the split rows' queries out and partials back
    ("prefill", "keys", 1, 1, True),   # one K/V (+ context) all-gather, the new-part call
    ("decode", "keys", 1, 1, False),   # one shard call, one packed all-gather of the partials
])
def test_collectives_and_kernel_calls_per_layer(step, exchange, collectives, runs, gathered):
    row = dcp_host.measure(step, exchange)
    assert hasattr(sys.modules["flashinfer"], "__file__")  # the stand-ins do not leak
    assert row["gathered"] is gathered  # a step that splits nothing gathers no K/V
    assert (row["collectives"], row["flashinfer_runs"]) == (collectives, runs)
    assert 0 <= row["kernel_ops"] <= row["aten_ops"] == sum(row["ops"].values())
    if step == "decode":  # the kernel, the gather and the merge are stand-ins: at most a
        assert row["kernel_ops"] == row["ops"].get("copy_", 0) <= 1  # copy to the output
    later = row["later_layer"]  # a later layer of the same step makes the same calls
    assert (later["collectives"], later["flashinfer_runs"]) == (collectives, runs)
    assert 0 <= later["kernel_ops"] <= later["aten_ops"] <= row["aten_ops"]
    assert row["plan_host_ms"] > 0 and row["partition_host_ms"] > 0


@pytest.mark.parametrize("step", ["mixed", "prefill", "decode"])
def test_steps_are_an_engines_with_their_decodes_past_prefill(step):
    computed, scheduled, prompts = dcp_host.step_batch(step)
    assert len(computed) == len(scheduled) == len(prompts)
    decodes = [i for i, n in enumerate(scheduled) if n == 1]
    assert all(computed[i] >= prompts[i] for i in decodes)  # past their prefill
    assert all(c + n <= p for c, n, p in zip(computed, scheduled, prompts) if n > 1)
    split = dcp_host.split_step(step)[0].plan.split.tolist()
    assert split == [n > 1 for n in scheduled]  # the chunk is split, the decodes are not
