"""The per-step trace summary of scripts/trace_steps.py on a hand-made trace."""
import gzip
import json
import os
import subprocess
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "scripts"))
from trace_steps import is_mixed, summarize_steps  # noqa: E402

SCRIPT = os.path.join(os.path.dirname(__file__), "..", "scripts", "trace_steps.py")


def _x(cat, name, ts, dur):
    return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur}


STEP = "execute_context_1(8192)_generation_0(0)"
EVENTS = [
    _x("user_annotation", STEP, -50, 120),          # host span
    _x("gpu_user_annotation", STEP, 0, 100),        # GPU span
    _x("kernel", "ncclDevKernel_AllGather_RING_LL", 10, 30),
    _x("kernel", "flashinfer::PrefillWithKVCacheKernel", 30, 30),  # overlaps the NCCL one
    _x("kernel", "nvjet_gemm", 70, 10),
    _x("kernel", "nvjet_gemm", 95, 20),             # runs past the step: clipped at 100
    _x("kernel", "before", -40, 10),                # outside the step
    _x("gpu_user_annotation", "execute_context_0(0)_generation_8(8)", 200, 10),
    _x("kernel", "ncclDevKernel_AllGather_RING_LL", 200, 10),
    {"ph": "i", "name": "marker", "ts": 5},
]


def test_steps_split_gpu_time_into_kernels_and_idle():
    first, second = summarize_steps(EVENTS)
    assert first == {"step": STEP, "host_ms": 0.12, "gpu_span_ms": 0.1, "busy_ms": 0.065,
                     "nccl_ms": 0.03, "flashinfer_ms": 0.03, "idle_ms": 0.035}
    assert second["step"].startswith("execute_context_0") and second["host_ms"] is None
    assert (second["busy_ms"], second["nccl_ms"], second["idle_ms"]) == (0.01, 0.01, 0.0)


def test_cli_reads_gzipped_traces(tmp_path):
    trace = tmp_path / "rank0.pt.trace.json.gz"
    with gzip.open(trace, "wt") as f:
        json.dump({"traceEvents": EVENTS}, f)
    out = tmp_path / "steps.json"
    done = subprocess.run([sys.executable, SCRIPT, str(trace), "--out", str(out)],
                          check=True, capture_output=True, text=True)
    rows = json.load(open(out))["rank0.pt.trace.json.gz"]
    assert [r["gpu_span_ms"] for r in rows] == [0.1, 0.01]
    assert done.stdout.splitlines()[0] == "rank0.pt.trace.json.gz: 0 mixed of 2 steps"


def test_a_step_is_mixed_when_it_has_both_prefills_and_decodes():
    assert is_mixed("execute_context_1(8185)_generation_7(7)")
    assert not is_mixed(STEP)
    assert not is_mixed("execute_context_0(0)_generation_8(8)")
    assert not is_mixed("execute_context_1(8192)")  # another vLLM's annotation: not counted


def test_cli_summarises_each_trace_with_python_self_time(tmp_path):
    from trace_steps import ATTENTION_OP

    host = [{**_x("cpu_op", ATTENTION_OP, 0, 100), "pid": 1, "tid": 1},
            {**_x("python_function", "run", 5, 40), "pid": 1, "tid": 1}]
    traces = []
    for rank, extra in ((0, []), (1, host)):
        traces.append(tmp_path / f"rank{rank}.pt.trace.json")
        traces[-1].write_text(json.dumps({"traceEvents": EVENTS + extra}))
    subprocess.run([sys.executable, SCRIPT, *map(str, traces), "--out",
                    str(tmp_path / "steps.json"), "--python-out", str(tmp_path / "py.json")],
                   check=True, capture_output=True)
    steps = json.load(open(tmp_path / "steps.json"))
    assert [len(steps[f"rank{r}.pt.trace.json"]) for r in (0, 1)] == [2, 2]
    assert json.load(open(tmp_path / "py.json")) == {
        "rank0.pt.trace.json": [],
        "rank1.pt.trace.json": [{"function": "run", "self_ms": 0.04, "calls": 1}]}


def test_python_self_time_inside_the_attention_op_leaves_out_what_it_calls():
    from trace_steps import ATTENTION_OP, python_self_ms

    def host(cat, name, ts, dur, tid=1):
        return {**_x(cat, name, ts, dur), "pid": 7, "tid": tid}

    events = [
        host("cpu_op", ATTENTION_OP, 0, 100),
        host("python_function", "dcp_attention.py(212): run", 5, 55),
        host("cpu_op", "aten::index_select", 10, 10),
        host("python_function", "flashinfer/prefill.py(900): run", 30, 20),
        host("python_function", "dcp_attention.py(212): run", 70, 20),
        host("python_function", "dcp_attention.py(212): run", 200, 10),  # outside the op
        host("python_function", "other thread", 6, 50, tid=2),  # not inside: another thread
        _x("kernel", "nvjet_gemm", 10, 80),  # device events do not nest
    ]
    assert python_self_ms(events) == [
        {"function": "dcp_attention.py(212): run", "self_ms": 0.045, "calls": 2},
        {"function": "flashinfer/prefill.py(900): run", "self_ms": 0.02, "calls": 1}]
