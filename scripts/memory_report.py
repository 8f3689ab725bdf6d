"""memory.json: each rank's peak on the engine checks' split steps against what vLLM's
profile run set aside for them (issue: the profile never runs a split step, so the
runner holds ``vllm_pcp.pcp.memory.split_step_reserve_bytes`` through it).

    python3 scripts/memory_report.py --raw RAW.json [RAW.json ...] --out memory.json \
        --git-rev REV --command "..."

Reads the ``memory`` of each run of ``check_exactness.py run``: each rank's memory once
the engine is up, then after each phase (standard cases, feature cases, teacher-forced
scoring), its peak reset between them. A phase that asked for prompt logprobs (the
scoring, the ``prompt_logprobs`` feature case) is not judged: vLLM then computes the
logits of a whole chunk (about 2.5 x tokens x vocabulary x 4 bytes), on one GPU alike,
and its profile run never sizes them. Per rank:

- ``step_peak_gib``: the judged phases' largest peak of torch allocations above what the
  rank held when the phase began (weights, KV cache, buffers): the split steps' own;
- ``profile_peak_gib``: vLLM's profile run's peak above its start, the reserve held,
  which is what vLLM keeps out of the KV cache for activations;
- ``fits``: the first at most the second (None: no phase judged);
- ``prompt_logprobs_peak_gib``: the other phases' largest peak, for the record.

A run recorded as one phase over every case (``after_cases``) is judged only where it
asked for no prompt logprobs.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

GIB = 1 << 30


def _asked_prompt_logprobs(run: dict, phase: str) -> bool:
    """Whether ``phase`` of ``run`` (``all``: a run recorded as one phase) asked vLLM
    for prompt logprobs."""
    features = any(res.get("case") == "prompt_logprobs"
                   for res in run.get("feature_results") or [])
    return {"standard": False, "features": features, "scoring": True,
            "all": features or "scores" in run}[phase]


def rank_rows(run: dict) -> list[dict]:
    """One row per rank of a run's ``memory``."""
    memory = run["memory"]
    phases = memory.get("phases") or {"all": memory["after_cases"]}
    rows = []
    for rank, start in enumerate(memory["at_start"]):
        profile = start["profile_peak_bytes"]
        judged, other, begin = [], [], start
        for phase, ends in phases.items():
            peak = ends[rank]["peak_allocated_bytes"] - begin["allocated_bytes"]
            (other if _asked_prompt_logprobs(run, phase) else judged).append(peak)
            begin = ends[rank]
        step = max(judged) if judged else None
        rows.append({
            "step_peak_gib": None if step is None else round(step / GIB, 4),
            "profile_peak_gib": None if profile is None else round(profile / GIB, 4),
            "split_step_reserve_gib": round(start["split_step_reserve_bytes"] / GIB, 4),
            "fits": None if step is None or profile is None else step <= profile,
            **({"prompt_logprobs_peak_gib": round(max(other) / GIB, 4)} if other else {})})
    return rows


def report(runs: dict) -> dict:
    """``{"summary", "runs"}`` of the runs that recorded memory; ``goal_met`` is None
    while some rank could not be judged and none was over."""
    out = []
    for (model, variant, config), run in sorted(runs.items()):
        if run.get("memory"):
            out.append({"model": model, "variant": variant, "config": config,
                        "ranks": rank_rows(run)})
    rows = [r for run in out for r in run["ranks"]]
    judged = [r for r in rows if r["fits"] is not None]
    fit = sum(r["fits"] for r in judged)
    goal = (False if fit < len(judged) else None if len(judged) < len(rows) or not rows
            else True)
    return {"summary": {"runs": len(out), "ranks": len(rows), "ranks_judged": len(judged),
                        "ranks_that_fit": fit, "goal_met": goal},
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
