"""memory.json: each rank's peak on the engine checks' split steps against what vLLM's
profile run set aside for them (issue: the profile never runs a split step, so the
runner holds ``vllm_pcp.pcp.memory.split_step_reserve_bytes`` through it).

    python3 scripts/memory_report.py --raw RAW.json [RAW.json ...] --out memory.json \
        --git-rev REV --command "..."

Reads the ``memory`` of each run of ``check_exactness.py run`` (the worker resets each
rank's peak once the engine is up, runs its cases, and reads it again). Per rank:

- ``step_peak_bytes``: the cases' peak of torch allocations above what the rank held
  when they began (weights, KV cache, buffers): the steps' transient memory;
- ``profile_peak_bytes``: vLLM's profile run's peak above its start, the reserve held,
  which is what vLLM keeps out of the KV cache for activations;
- ``fits``: the first at most the second.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

GIB = 1 << 30


def rank_rows(memory: dict) -> list[dict]:
    """One row per rank of a run's ``memory`` (``at_start`` and ``after_cases``)."""
    rows = []
    for start, end in zip(memory["at_start"], memory["after_cases"]):
        step = end["peak_allocated_bytes"] - start["allocated_bytes"]
        profile = start["profile_peak_bytes"]
        rows.append({"step_peak_gib": round(step / GIB, 4),
                     "profile_peak_gib": None if profile is None else round(profile / GIB, 4),
                     "split_step_reserve_gib": round(start["split_step_reserve_bytes"] / GIB, 4),
                     "fits": None if profile is None else step <= profile})
    return rows


def report(runs: dict) -> dict:
    """``{"summary", "runs"}`` of the runs that recorded memory."""
    out = []
    for (model, variant, config), run in sorted(runs.items()):
        if run.get("memory"):
            out.append({"model": model, "variant": variant, "config": config,
                        "ranks": rank_rows(run["memory"])})
    ranks = [r for run in out for r in run["ranks"] if r["fits"] is not None]
    return {"summary": {"runs": len(out), "ranks": len(ranks),
                        "ranks_that_fit": sum(r["fits"] for r in ranks),
                        "goal_met": bool(ranks) and all(r["fits"] for r in ranks)},
            "runs": out}


def main() -> None:
    from check_exactness import _load_runs, _meta

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--raw", nargs="+", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--git-rev", default="unknown")
    ap.add_argument("--command", default="")
    ap.add_argument("--note", default="")
    ap.add_argument("--date", default="")
    args = ap.parse_args()
    runs, host = _load_runs(args.raw)
    result = {"meta": _meta(args, host, runs), **report(runs)}
    result["meta"]["date"] = args.date or datetime.date.today().isoformat()
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    print(json.dumps(result["summary"]))


if __name__ == "__main__":
    main()
