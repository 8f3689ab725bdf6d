"""The teacher-forced measure of check_exactness.py: ``run --teacher`` (the worker
flags of :func:`_teacher_args`) and ``teacher`` (exactness-teacher.json from its raw
files). The shared helpers of check_exactness.py (BASELINE, _load_runs, _meta) are
imported where they are used: check_exactness.py imports this module."""
from __future__ import annotations

import json
import os

import numpy as np

from exactness_lib import TEACHER_SOURCE, abs_logprob_diffs, diff_stats, teacher_goal

# Teacher-forced floors: one GPU against itself, configuration -> its baseline.
# the floors shown: the one-GPU floors the goal takes, and vLLM's own -tp 2 (sharded
# weights round otherwise; MoE's experts are sharded over the ranks under -pcp too)
GOAL_FLOORS = ("pcp1-graphs", "pcp1-flash-attn")
# run for MoE models only: vLLM shards their experts over the PCP ranks as over TP ranks,
# so where a model ran it, vLLM's own expert sharding is one of the goal's floors
EXPERT_SHARDING_FLOOR = "tp2"
TEACHER_FLOORS = {"pcp1-graphs": "pcp1", "pcp1-flash-attn": "pcp1", "tp2": "pcp1"}
# The goal: at most this many times the larger floor, at max and at p99 (the configurations
# of several ranks; with -dcp the merge of partial states rounds once more)
TEACHER_GOALS = {**{c: 1.0 for c in ("pcp2", "pcp2-graphs", "pcp4", "pcp8", "tp2-pcp2")},
                 **{c: 1.5 for c in ("pcp2-dcp2-i1", "pcp2-dcp2-i8", "pcp2-dcp2-i16",
                                     "pcp2-dcp2-i8-graphs", "pcp4-dcp4-i1", "pcp4-dcp4-i8",
                                     "tp2-dcp2-i1", "tp2-dcp2-i8", "tp2-pcp2-dcp2-i1",
                                     "tp4-pcp2-dcp2-i8")}}
TEACHER_MEASURE = ("teacher-forced: the pcp1-v1 greedy output of each prompt (chunked, eager) "
                   "appended to it and scored with prompt_logprobs=0; per case, over the "
                   "continuation positions of its prompts, |logprob of the given token - the "
                   "baseline's|: max, p99 (linear interpolation), positions over 1.0")


def _teacher_args(args, model: str, variant: str) -> list[str]:
    """Worker flags of ``run --teacher RAW``: score RAW's continuations of ``model`` (or,
    for ``self``, the engine's own), in the source's variant only (prompt_logprobs of an
    unchunked 32K prompt would hold its logits over the whole vocabulary at once)."""
    teacher = getattr(args, "teacher", "")
    if not teacher or variant != TEACHER_SOURCE["variant"]:
        return []
    if teacher == "self":
        return ["--teacher", "self"]
    return ["--teacher", os.path.abspath(teacher), "--teacher-model", model]


def _teacher_base(config: str) -> str | None:
    from check_exactness import BASELINE

    return TEACHER_FLOORS.get(config) or BASELINE.get(config)


def _scored_other_continuations(res: dict, base_res: dict) -> str | None:
    """Why two scorings of a case are of different continuations, None where both
    scored the same ones, or where either one predates the digests."""
    ours, theirs = res.get("continuation_digests"), base_res.get("continuation_digests")
    if ours is None or theirs is None or ours == theirs:
        return None
    return ("the baseline scored other continuations (its outputs changed between the "
            "run that scored them and the run this one scored)")


def _teacher_case_rows(model: str, label: str, run: dict, base: dict) -> tuple[list, list]:
    """One row per scored case of ``run`` against the same case of ``base``, and each
    case's |logprob differences| (None where the two scorings disagree in shape); a case
    the baseline did not score on the same prompts gets a row with ``not_compared`` and
    no differences."""
    from check_exactness import comparable

    rows, diffs = [], []
    base_cases = {res["case"]: res for res in base["scores"]}
    for res in run["scores"]:
        row = {"model": model, "config": label, "case": res["case"],
               "prompt_lens": res["prompt_lens"]}
        reason = comparable(res, base_cases) or _scored_other_continuations(
            res, base_cases[res["case"]])
        if reason:
            rows.append({**row, "not_compared": reason})
            continue
        try:
            case_diffs = abs_logprob_diffs(res["scores"], base_cases[res["case"]]["scores"])
        except ValueError as exc:
            rows.append({**row, "error": str(exc)})
            diffs.append(None)
            continue
        rows.append({**row, **diff_stats(case_diffs)})
        diffs.append(case_diffs)
    return rows, diffs


def _teacher_rows(runs: dict) -> tuple[list, list, dict]:
    """Rows of every configuration against its baseline, rows of the floors, and per
    (model, configuration) the differences of each of its cases (None: a run or case
    failed)."""
    rows, floor_rows, pooled = [], [], {}
    for (model, variant, config), run in sorted(runs.items()):
        base_config = _teacher_base(config)
        base = runs.get((model, variant, base_config or ""))
        if base is None:
            continue
        label = f"{config} vs {base_config}, {variant}"
        if run["returncode"] or base["returncode"]:
            failed = run if run["returncode"] else base
            new, diffs = [{"model": model, "config": label, "case": "engine",
                           "prompt_lens": [], "errors": failed.get("errors", []),
                           "error": failed.get("log_tail", "")[-1500:]}], [None]
        else:
            new, diffs = _teacher_case_rows(model, label, run, base)
        (floor_rows if config in TEACHER_FLOORS else rows).extend(new)
        pooled.setdefault((model, config), []).extend(diffs)
    return rows, floor_rows, pooled


def _pooled_stats(case_diffs: list) -> dict | None:
    """:func:`exactness_lib.diff_stats` over all positions of a configuration's cases;
    None if one of them failed."""
    if any(d is None for d in case_diffs):
        return None
    return {"cases": len(case_diffs), **diff_stats(np.concatenate(case_diffs))}


def _model_summary(pooled: dict) -> dict:
    """One model's configurations (config -> the differences of its cases): each one's
    pooled stats (None: failed), the floors apart, and the goal over the layouts this
    model ran (a model's own floors: rounding depends on its shape)."""
    stats = {config: _pooled_stats(diffs) for config, diffs in pooled.items()}
    measured = {c: s for c, s in stats.items() if c not in TEACHER_FLOORS}
    factors = {c: f for c, f in TEACHER_GOALS.items() if c in measured}
    return {"noise_floor": {f"{c} vs {TEACHER_FLOORS[c]}": stats[c]
                            for c in TEACHER_FLOORS if c in stats},
            "configs": {f"{c} vs {_teacher_base(c)}": s for c, s in measured.items()},
            "goal": teacher_goal(_goal_floors(stats), measured, factors)}


def _goal_floors(stats: dict) -> dict:
    """The floors a model's goal takes: both one-GPU floors (None where one did not
    run), and :data:`EXPERT_SHARDING_FLOOR` where the model ran it; a MoE model that ran
    that floor alone is held to it alone."""
    floors = {c: stats.get(c) for c in GOAL_FLOORS}
    if EXPERT_SHARDING_FLOOR in stats:
        floors = {c: f for c, f in floors.items() if c in stats}
        floors[EXPERT_SHARDING_FLOOR] = stats[EXPERT_SHARDING_FLOOR]
    return floors


def _teacher_summary(pooled: dict) -> dict:
    """Per model :func:`_model_summary`; ``goal_met`` over the models (False if one
    misses it, None if one has no verdict); ``not_measured``: the goal's layouts no
    model ran."""
    models = sorted({model for model, _ in pooled})
    per = {m: _model_summary({c: d for (mm, c), d in pooled.items() if mm == m})
           for m in models}
    mets = [s["goal"]["met"] for s in per.values()]
    ran = {c for _, c in pooled}
    return {"models": per,
            "goal_met": False if False in mets else None if None in mets or not mets
            else True,
            "not_measured": sorted(c for c in TEACHER_GOALS if c not in ran)}


def teacher(args) -> None:
    """exactness-teacher.json from raw files of ``run --teacher``: per case the teacher-forced
    differences against the one-GPU scoring, the one-GPU floors, and the goal."""
    from check_exactness import _load_runs, _meta

    runs, host = _load_runs(args.raw, getattr(args, "models", ""))
    runs = {key: run for key, run in runs.items() if run["returncode"] or "scores" in run}
    rows, floor_rows, pooled = _teacher_rows(runs)
    summary = _teacher_summary(pooled)
    result = {"meta": {**_meta(args, host, runs), "measure": TEACHER_MEASURE},
              "summary": summary,
              "cases": rows, "noise_floor_cases": floor_rows}
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    print(json.dumps(summary))


def add_teacher_parser(sub) -> None:
    """``teacher``: exactness-teacher.json from raw files of ``run --teacher``."""
    from check_exactness import add_result_args

    t = sub.add_parser("teacher", help="exactness-teacher.json from raw files of run --teacher")
    add_result_args(t)
    t.add_argument("--date", default="", help="date of the GPU run (default: today)")
