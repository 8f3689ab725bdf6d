"""Per-step summary of torch-profiler traces: where each engine step's time goes, per rank.

    python scripts/trace_steps.py profile-pcp2-dcp2/*.pt.trace.json.gz --out steps.json

vLLM's worker wraps every step in an ``execute_context_...`` annotation; the trace holds it
twice, as a host span (``user_annotation``) and as the GPU span from its first to its last
kernel (``gpu_user_annotation``). For each step and trace file this writes the host span,
the GPU span, the GPU time covered by kernels (their union), NCCL kernels, FlashInfer
kernels, and the GPU span left idle. NCCL time well above the peer rank's for the same
step is waiting for that rank, not moving bytes. It prints how many steps of each trace are
mixed (prefills beside decodes: what ``--profile-mixed`` is after). With ``--python-out``
(traces recorded with Python stacks, ``bench_pcp.py run --profile-stack``) it also writes
where the attention layer's host time goes, per Python function. The traces run to hundreds
of MB; these summaries are small enough to keep beside the results.
"""
from __future__ import annotations

import argparse
import gzip
import json
import os
import re

STEP_PREFIX = "execute_context_"
_STEP_COUNTS = re.compile(re.escape(STEP_PREFIX) + r"(\d+)\(\d+\)_generation_(\d+)\(\d+\)")


def is_mixed(step: str) -> bool:
    """Whether a step annotation holds both prefill (context) and decode requests."""
    m = _STEP_COUNTS.match(step)
    return bool(m) and int(m.group(1)) > 0 and int(m.group(2)) > 0


def _union_us(spans: list[tuple[float, float]]) -> float:
    """Total length covered by ``[start, end)`` spans."""
    total, end = 0.0, float("-inf")
    for s, e in sorted(spans):
        if e <= end:
            continue
        total += e - max(s, end)
        end = e
    return total


def _inside(kernels: list[dict], start: float, end: float) -> list[tuple[str, float, float]]:
    return [(k["name"], max(k["ts"], start), min(k["ts"] + k["dur"], end))
            for k in kernels if k["ts"] < end and k["ts"] + k["dur"] > start]


def summarize_steps(events: list[dict]) -> list[dict]:
    """One row per step annotation of one trace, in time order (times in ms).

    ``events``: Chrome-trace events (``ph`` "X" with ``cat``, ``name``, ``ts``, ``dur``
    in microseconds).
    """
    spans = [e for e in events if e.get("ph") == "X" and "dur" in e]
    kernels = [e for e in spans if e.get("cat") == "kernel"]
    host = sorted((e for e in spans if e.get("cat") == "user_annotation"
                   and e["name"].startswith(STEP_PREFIX)), key=lambda e: e["ts"])
    gpu = sorted((e for e in spans if e.get("cat") == "gpu_user_annotation"
                  and e["name"].startswith(STEP_PREFIX)), key=lambda e: e["ts"])
    rows = []
    for step in gpu:
        start, end = step["ts"], step["ts"] + step["dur"]
        inside = _inside(kernels, start, end)
        busy = _union_us([(s, e) for _, s, e in inside])
        nccl = _union_us([(s, e) for n, s, e in inside if "nccl" in n.lower()])
        attn = _union_us([(s, e) for n, s, e in inside if "flashinfer" in n.lower()])
        same = [h for h in host if h["name"] == step["name"] and h["ts"] <= start]
        rows.append({"step": step["name"],
                     "host_ms": round(same[-1]["dur"] / 1e3, 3) if same else None,
                     "gpu_span_ms": round(step["dur"] / 1e3, 3),
                     "busy_ms": round(busy / 1e3, 3), "nccl_ms": round(nccl / 1e3, 3),
                     "flashinfer_ms": round(attn / 1e3, 3),
                     "idle_ms": round((step["dur"] - busy) / 1e3, 3)})
    return rows


ATTENTION_OP = "vllm::unified_attention_with_output"


def python_self_ms(events: list[dict], under: str = ATTENTION_OP, top: int = 30) -> list[dict]:
    """Python self time inside the host spans of the op ``under`` (a trace recorded with
    ``with_stack``): per Python function, its time less that of the host events it called
    (Python functions and aten ops), summed over calls; the ``top`` largest, in ms.

    ``events``: Chrome-trace events; host events nest by time within one (pid, tid).
    """
    host = [e for e in events if e.get("ph") == "X" and "dur" in e
            and e.get("cat") in ("python_function", "cpu_op", "user_annotation")]
    host.sort(key=lambda e: (str(e.get("pid")), str(e.get("tid")), e["ts"], -e["dur"]))
    totals: dict[str, list[float]] = {}
    stack: list[list] = []  # [event, time of its children, inside ``under``]
    thread = None

    def close(entry):
        event, children, inside = entry
        if inside and event["cat"] == "python_function":
            total = totals.setdefault(event["name"], [0.0, 0])
            total[0] += event["dur"] - children
            total[1] += 1

    for event in host:
        if (event.get("pid"), event.get("tid")) != thread:
            while stack:
                close(stack.pop())
            thread = (event.get("pid"), event.get("tid"))
        while stack and stack[-1][0]["ts"] + stack[-1][0]["dur"] <= event["ts"]:
            close(stack.pop())
        inside = bool(stack) and (stack[-1][2] or stack[-1][0]["name"] == under)
        if stack:
            stack[-1][1] += event["dur"]
        stack.append([event, 0.0, inside])
    while stack:
        close(stack.pop())
    ranked = sorted(totals.items(), key=lambda kv: -kv[1][0])[:top]
    return [{"function": name, "self_ms": round(us / 1e3, 3), "calls": calls}
            for name, (us, calls) in ranked]


def _load(path: str) -> list[dict]:
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt") as f:
        return json.load(f)["traceEvents"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("traces", nargs="+")
    ap.add_argument("--out", required=True)
    ap.add_argument("--python-out", help="traces recorded with Python stacks: the Python "
                    f"self time inside {ATTENTION_OP} per function, to this file")
    args = ap.parse_args()
    result, python = {}, {}
    for path in sorted(args.traces):  # one trace in memory at a time: each is large
        events, name = _load(path), os.path.basename(path)
        result[name] = summarize_steps(events)
        if args.python_out:
            python[name] = python_self_ms(events)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    if args.python_out:
        with open(args.python_out, "w") as f:
            json.dump(python, f, indent=1)
    for name, rows in result.items():  # a mixed profile (--profile-mixed) wants mixed > 0
        print(f"{name}: {sum(is_mixed(r['step']) for r in rows)} mixed of {len(rows)} steps")
        for r in rows:
            print(f"  {r['step'][:48]:48s} gpu {r['gpu_span_ms']:8.2f}  nccl {r['nccl_ms']:7.2f}"
                  f"  idle {r['idle_ms']:7.2f}")


if __name__ == "__main__":
    main()
