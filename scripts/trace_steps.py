"""Per-step summary of torch-profiler traces: where each engine step's time goes, per rank.

    python scripts/trace_steps.py profile-pcp2-dcp2/*.pt.trace.json.gz --out steps.json

vLLM's worker wraps every step in an ``execute_context_...`` annotation; the trace holds it
twice, as a host span (``user_annotation``) and as the GPU span from its first to its last
kernel (``gpu_user_annotation``). For each step and trace file this writes the host span,
the GPU span, the GPU time covered by kernels (their union), NCCL kernels, FlashInfer
kernels, and the GPU span left idle. NCCL time well above the peer rank's for the same
step is waiting for that rank, not moving bytes. The traces are too big to bring back from
the GPU host; this summary is small.
"""
from __future__ import annotations

import argparse
import gzip
import json
import os

STEP_PREFIX = "execute_context_"


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


def _load(path: str) -> list[dict]:
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt") as f:
        return json.load(f)["traceEvents"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("traces", nargs="+")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    result = {os.path.basename(p): summarize_steps(_load(p)) for p in sorted(args.traces)}
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    for name, rows in result.items():
        print(name)
        for r in rows:
            print(f"  {r['step'][:48]:48s} gpu {r['gpu_span_ms']:8.2f}  nccl {r['nccl_ms']:7.2f}"
                  f"  idle {r['idle_ms']:7.2f}")


if __name__ == "__main__":
    main()
