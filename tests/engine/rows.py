"""The engine checks' result files (tests/gpu/results schemas) from the rows their tests
write (``WORK/rows/TEST.json``: ``kind``, ``key``, ``session``, ``runs``, what it judged)."""
import json
from pathlib import Path

import judge
import results

SHARED_NOTE = ("every rank of these engines ran on the same GPU(s) and talked over "
               "NCCL's network transport on the loopback interface: outputs, not speed")


def meta_extra(rows: list[dict]) -> dict:
    """``ranks_shared_gpus`` where ranks shared GPUs, ``runs_by_git_rev`` where engines ran
    at more than one revision."""
    runs = {(r["model"], r["variant"], r["config"]): r for row in rows for r in row["runs"]}
    shared = {r["config"]: r["shared_gpus"] for r in runs.values() if r.get("shared_gpus")}
    by_rev: dict[str, list] = {}
    for key, run in sorted(runs.items()):
        by_rev.setdefault(run.get("git_rev") or "unknown", []).append(":".join(key))
    extra = {}
    if shared:
        extra["ranks_shared_gpus"] = {"gpus": max(map(int, shared.values())),
                                      "configs": sorted(shared), "note": SHARED_NOTE}
    if len(by_rev) > 1:
        extra["runs_by_git_rev"] = by_rev
    return extra


def _cases(rows: list[dict], summary: dict, floors: list[dict] = ()) -> dict:
    """``summary`` with the cases' rows, the noise floor's and those not compared."""
    out = {"summary": summary, "cases": [c for r in rows for c in r["cases"]]}
    floor = [c for r in floors for c in r["cases"]]
    skipped = [c for r in rows for c in r.get("not_compared", [])]
    if floor:
        summary["noise_floor"] = judge.summarize(floor)
        out["noise_floor_cases"] = floor
    if skipped:
        summary["not_compared"] = len(skipped)
        out["not_compared"] = skipped
    return out


def features(rows: list[dict]) -> dict:
    """The feature cases by case name, and the refusals apart."""
    cases = [c for r in rows for c in r["cases"] if c["case"] != "refusal"]
    refusals = [c for r in rows for c in r["cases"] if c["case"] == "refusal"]
    seconds = [c["seconds_to_failure"] for c in refusals if c["seconds_to_failure"] is not None]
    return _cases(rows, {**judge.summarize(cases), "by_case": {
        name: judge.summarize([c for c in cases if c["case"] == name])
        for name in sorted({c["case"] for c in cases})},
        "refusals": {"cases": len(refusals), "passed": sum(c["passed"] for c in refusals),
                     "max_seconds_to_failure": max(seconds, default=None)}})


def teacher(rows: list[dict], floors: list[dict]) -> dict:
    """Per model its floors, its layouts' pooled stats and their goal (its own floors)."""
    stats: dict[str, dict] = {}
    for r in rows + [r["teacher"] for r in floors if r.get("teacher")]:
        stats.setdefault(r["model"], {})[r["config"]] = (r["base"], r["pooled"])
    models = {}
    for model, by in sorted(stats.items()):
        pooled = {c: s for c, (_, s) in by.items()}
        measured = {c: s for c, s in pooled.items() if c not in judge.TEACHER_FLOORS}
        factors = {c: f for c, f in judge.TEACHER_GOALS.items() if c in measured}
        models[model] = {
            "noise_floor": {f"{c} vs {by[c][0]}": pooled[c] for c in judge.TEACHER_FLOORS
                            if c in by},
            "configs": {f"{c} vs {by[c][0]}": s for c, s in measured.items()},
            "goal": judge.teacher_goal(pooled, measured, factors)}
    ran = {c for by in stats.values() for c in by}
    return {"summary": {"models": models,
                        "goal_met": judge.verdict(m["goal"]["met"] for m in models.values()),
                        "not_measured": sorted(c for c in judge.TEACHER_GOALS if c not in ran)},
            "cases": [c for r in rows for c in r["cases"]],
            "noise_floor_cases": [c for r in floors if r.get("teacher")
                                  for c in r["teacher"]["cases"]]}


def memory(rows: list[dict]) -> dict:
    """Each engine's ranks, and whether they all fit."""
    runs = [{"model": m, "variant": v, "config": c, "ranks": r["ranks"]}
            for r in rows if r["ranks"] for m, v, c in [r["key"]]]
    ranks = [x for run in runs for x in run["ranks"]]
    judged = [x for x in ranks if x["fits"] is not None]
    return {"summary": {"runs": len(runs), "ranks": len(ranks), "ranks_judged": len(judged),
                        "ranks_that_fit": sum(x["fits"] for x in judged),
                        "goal_met": judge.verdict(x["fits"] for x in ranks)},
            "runs": runs}


def assemble(rows: list[dict]) -> dict[str, tuple[list[dict], dict]]:
    """``{file name: (the rows it holds, its payload without meta)}`` of the files fed."""
    def kind(*kinds):
        return sorted((r for r in rows if r["kind"] in kinds), key=lambda r: r["key"])

    greedy, floors = kind("greedy"), kind("floor")
    exactness = lambda chosen: _cases(  # noqa: E731
        chosen, judge.summarize([c for r in chosen for c in r["cases"]]), floors)
    files = {  # name: (its rows, the floors' rows it also holds, how it is built)
        "exactness-pcp.json": ([r for r in greedy if r["dcp"] == 1], floors, exactness),
        "exactness-dcp.json": ([r for r in greedy if r["dcp"] > 1], floors, exactness),
        "exactness-features.json": (kind("features", "refusal"), [], features),
        "exactness-teacher.json": (kind("teacher"), floors, lambda r: teacher(r, floors)),
        "memory.json": (kind("memory"), [], memory)}
    return {name: (chosen + extra, build(chosen))
            for name, (chosen, extra, build) in files.items() if chosen}


def write_results(work_dir: str, results_dir: str, session: str | None) -> list[str]:
    """The paths of the result files of the rows in ``work_dir`` (if this session wrote one)."""
    rows = [json.loads(p.read_text()) for p in sorted(Path(work_dir, "rows").glob("*.json"))]
    if not any(r.get("session") == session for r in rows):
        return []
    paths = []
    for name, (used, payload) in assemble(rows).items():
        extra = meta_extra(used)
        if name == "exactness-teacher.json":
            extra["measure"] = judge.TEACHER_MEASURE
        paths.append(results.write(results_dir, name, {"meta": results.meta(**extra), **payload}))
    return paths
