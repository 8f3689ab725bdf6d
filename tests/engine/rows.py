"""The engine checks' result files (tests/gpu/results schemas) from the rows their tests
write (``WORK/rows/TEST.json``: ``kind``, ``key``, ``session``, ``runs``, what it judged).

A file already in ``--results-dir`` is cut back into rows (:func:`committed_rows`), one per
kind and engine; a session's rows replace those of the same kind and engine, the rest stay
with their revisions (``meta.runs_by_git_rev``). So a slice run into ``tests/gpu/results``
updates what it re-ran and keeps the rest, unless the file ran on another vLLM than this
host's (its ``meta.vllm``): then the session's rows replace the whole file."""
import json
from pathlib import Path

import judge
import results

FILES = ("exactness-pcp.json", "exactness-dcp.json", "exactness-features.json",
         "exactness-teacher.json", "memory.json", "repeatability.json",
         "sampled-agreement.json")
AGREEMENT_FIELDS = ("decode_tokens", "sampled_token_checks", "passed", "errors")


def meta_extra(rows: list[dict]) -> dict:
    """``ranks_shared_gpus`` where ranks shared GPUs, ``runs_by_git_rev`` where engines ran
    at more than one revision (an engine that rows took from two runs: under both),
    ``gpus_by_git_rev`` and a ``gpu`` naming each where they ran on more than one GPU,
    ``commands`` where rows came from more than one (a committed row: all its file's)."""
    runs = [r for row in rows for r in row["runs"]]
    shared = {r["config"]: r["shared_gpus"] for r in runs if r.get("shared_gpus")}
    mps = {r["config"] for r in runs if r.get("shared_gpus") and r.get("mps")}
    revs: dict[str, set] = {}
    gpus: dict[str, str] = {}
    for run in runs:
        for rev in run.get("git_revs") or [run.get("git_rev") or "unknown"]:
            revs.setdefault(rev, set()).add(":".join((run["model"], run["variant"], run["config"])))
            if (run.get("gpus") or {}).get(rev):
                gpus.setdefault(rev, run["gpus"][rev])
    by_rev = {rev: sorted(keys) for rev, keys in sorted(revs.items())}
    extra = _gpus_by_rev(gpus)
    commands = sorted({c for row in rows for c in row.get("commands") or [row.get("command")]
                       if c})
    if len(commands) > 1:
        extra["commands"] = commands
    if shared:
        extra["ranks_shared_gpus"] = results.shared_gpus(shared, mps)
    if len(by_rev) > 1:
        extra["runs_by_git_rev"] = by_rev
    return extra


def _gpus_by_rev(gpus: dict[str, str]) -> dict:
    """Where runs of one file ran on different GPUs: ``gpus_by_git_rev`` and a ``gpu`` that
    names each GPU with its revisions (``"1 x H100 (ccc), 1 x H200 (aaa, bbb)"``)."""
    if len(set(gpus.values())) < 2:
        return {}
    names = {gpu: sorted(rev[:7] for rev, g in gpus.items() if g == gpu)
             for gpu in sorted(set(gpus.values()))}
    return {"gpu": ", ".join(f"{gpu} ({', '.join(revs)})" for gpu, revs in names.items()),
            "gpus_by_git_rev": dict(sorted(gpus.items()))}


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


def _stock_sharding(key) -> bool:
    """An engine of vLLM's own -tp 2 (no PCP, no DCP: the plugin stays out), whose feature
    cases the file shows beside one GPU's floor, never among the plugin's comparisons."""
    return key[2] == judge.EXPERT_SHARDING_FLOOR


def features(rows: list[dict], floors: list[dict] = ()) -> dict:
    """The feature cases by case name, the refusals apart, and the floors' feature cases
    (one GPU against itself: a floor row's ``features``; vLLM's -tp 2: its ``cases``)."""
    floor_cases = ([{"cases": r["features"]} for r in floors]
                   + [r for r in rows if _stock_sharding(r["key"])])
    rows = [r for r in rows if not _stock_sharding(r["key"])]
    cases = [c for r in rows for c in r["cases"] if c["case"] != "refusal"]
    refusals = [c for r in rows for c in r["cases"] if c["case"] == "refusal"]
    seconds = [c["seconds_to_failure"] for c in refusals if c["seconds_to_failure"] is not None]
    return _cases(rows, {**judge.summarize(cases), "by_case": {
        name: judge.summarize([c for c in cases if c["case"] == name])
        for name in sorted({c["case"] for c in cases})},
        "refusals": {"cases": len(refusals), "passed": sum(c["passed"] for c in refusals),
                     "max_seconds_to_failure": max(seconds, default=None)}}, floor_cases)


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


def repeatability(rows: list[dict]) -> dict:
    """Each engine run twice: the cases both ran, those that differ."""
    runs = [{"model": m, "variant": v, "config": c, "cases": r["compared"], "differ": r["differ"]}
            for r in rows for m, v, c in [r["key"]]]
    return {"summary": {"engines": len(runs), "repeatable": judge.verdict(
        bool(r["cases"]) and not r["differ"] for r in runs)}, "runs": runs}


def agreement(rows: list[dict]) -> dict:
    """Each engine's agreement case: decode lengths, steps checked per rank, the verdict."""
    runs = [{"model": m, "variant": v, "config": c, **{f: r.get(f) for f in AGREEMENT_FIELDS}}
            for r in rows for m, v, c in [r["key"]]]
    return {"summary": {"engines": len(runs),
                        "agree": judge.verdict(r["passed"] for r in runs)}, "runs": runs}


def assemble(rows: list[dict]) -> dict[str, tuple[list[dict], dict]]:
    """``{file name: (the rows it holds, its payload without meta)}`` of the files fed."""
    def kind(*kinds):
        return sorted((r for r in rows if r["kind"] in kinds), key=lambda r: r["key"])

    greedy, floors = kind("greedy"), kind("floor")
    feature_floors = [r for r in floors if r.get("features")]
    exactness = lambda chosen: _cases(  # noqa: E731
        chosen, judge.summarize([c for r in chosen for c in r["cases"]]), floors)
    files = {  # name: (its rows, the floors' rows it also holds, how it is built)
        "exactness-pcp.json": ([r for r in greedy if r["dcp"] == 1], floors, exactness),
        "exactness-dcp.json": ([r for r in greedy if r["dcp"] > 1], floors, exactness),
        "exactness-features.json": (kind("features", "refusal"), feature_floors,
                                    lambda r: features(r, feature_floors)),
        "exactness-teacher.json": (kind("teacher"), floors, lambda r: teacher(r, floors)),
        "memory.json": (kind("memory"), [], memory),
        "repeatability.json": (kind("repeat"), [], repeatability),
        "sampled-agreement.json": (kind("agreement"), [], agreement)}
    return {name: (chosen + extra, build(chosen))
            for name, (chosen, extra, build) in files.items() if chosen}


def _key(model: str, label: str) -> tuple[tuple, str | None]:
    """``(model, variant, layout)`` and the baseline of a case's ``config`` label:
    "pcp2 vs pcp1, chunked", "pcp2, unchunked" (a refusal), "pcp2 vs pcp1" (teacher)."""
    head, sep, variant = label.rpartition(", ")
    head, variant = (head, variant) if sep else (label, "chunked")
    layout, _, base = head.partition(" vs ")
    return (model, variant, layout), base or None


def _by_key(cases: list[dict]) -> dict[tuple, list[dict]]:
    out: dict[tuple, list[dict]] = {}
    for case in cases:
        out.setdefault(_key(case["model"], case["config"])[0], []).append(case)
    return out


def _cut_cases(doc: dict, add, kind_of, floor_field: str = "cases", **fields) -> None:
    """``add(kind_of(cases), key, base, **fields, ...)`` per engine of ``cases``,
    ``add("floor", ...)`` per engine of ``noise_floor_cases`` (as its ``floor_field``)."""
    skipped = _by_key(doc.get("not_compared", []))
    for key, cases in _by_key(doc.get("cases", [])).items():
        add(kind_of(cases), key, _key(key[0], cases[0]["config"])[1], cases=cases,
            not_compared=skipped.get(key, []), **fields)
    for key, cases in _by_key(doc.get("noise_floor_cases", [])).items():
        base = _key(key[0], cases[0]["config"])[1]
        if floor_field == "features" and _stock_sharding(key):
            add("features", key, base, cases=cases)  # test_features' row, shown as a floor
        else:
            add("floor", key, base, **{floor_field: cases})


def _cut_teacher(doc: dict, add) -> None:
    """``add`` per model's layout (a teacher row) and floor (a floor row's ``teacher``)."""
    scored = {"teacher": _by_key(doc["cases"]), "floor": _by_key(doc["noise_floor_cases"])}
    for model, by in doc["summary"]["models"].items():
        for kind, group in (("teacher", "configs"), ("floor", "noise_floor")):
            for label, pooled in by[group].items():
                (_, _, config), base = _key(model, label)
                key = (model, "chunked", config)
                row = {"model": model, "config": config, "base": base, "pooled": pooled,
                       "cases": scored[kind].get(key, [])}
                add(kind, key, base, **(row if kind == "teacher" else {"teacher": row}))


def _cut(name: str, doc: dict, add) -> None:
    """``add(kind, key, base, **fields)`` for each engine's part of the file ``name``."""
    if name in ("memory.json", "repeatability.json", "sampled-agreement.json"):
        for r in doc["runs"]:
            key = (r["model"], r["variant"], r["config"])
            if name == "memory.json":
                add("memory", key, ranks=r["ranks"])
            elif name == "repeatability.json":
                add("repeat", key, compared=r["cases"], differ=r["differ"])
            else:
                add("agreement", key, **{f: r.get(f) for f in AGREEMENT_FIELDS})
    elif name == "exactness-teacher.json":
        _cut_teacher(doc, add)
    elif name == "exactness-features.json":
        _cut_cases(doc, add, lambda cases: "refusal" if {c["case"] for c in cases} == {"refusal"}
                   else "features", floor_field="features")
    else:
        _cut_cases(doc, add, lambda _: "greedy", dcp=1 if name == "exactness-pcp.json" else 2)


def _adder(out: dict, meta: dict):
    """``add(kind, key, base, **fields)`` into ``out``: a row with the runs of ``key`` and
    its ``base`` at their revisions in ``meta`` (``git_revs`` all of them where the file lists
    an engine under several: a baseline its rows took from more than one run)."""
    revs: dict[str, list] = {}
    for rev, keys in (meta.get("runs_by_git_rev") or {}).items():
        for k in keys:
            revs.setdefault(k, []).append(rev)
    shared = meta.get("ranks_shared_gpus") or {}
    gpus = meta.get("gpus_by_git_rev") or {}

    def run(model, variant, config):
        listed = revs.get(f"{model}:{variant}:{config}") or [meta.get("git_rev")]
        return {"model": model, "variant": variant, "config": config, "git_rev": listed[-1],
                "git_revs": listed if len(listed) > 1 else None,
                "gpus": {rev: gpus.get(rev, meta.get("gpu")) for rev in listed},
                "shared_gpus": str(shared["gpus"]) if config in shared.get("configs", ()) else None,
                "mps": config in shared.get("mps_configs", ())}

    def add(kind, key, base=None, /, **fields):
        runs = [run(*key)] + ([run(*key[:2], base)] if base else [])
        row = out.setdefault((kind, key), {
            "kind": kind, "key": list(key), "session": None, "command": meta.get("command"),
            "commands": meta.get("commands"),  # the file's: which one ran the row is not kept
            "runs": runs, "cases": [], "teacher": None})
        if row["runs"] is not runs:  # a floor that more than one file holds: all their revisions
            row["runs"] = [_union(kept, new) for kept, new in zip(row["runs"], runs)]
        row.update(fields)
    return add


def _union(kept: dict, new: dict) -> dict:
    """``kept`` (a run) with the revisions of ``new`` (the same engine in another file)."""
    revs = sorted({*(kept.get("git_revs") or [kept["git_rev"]]),
                   *(new.get("git_revs") or [new["git_rev"]])})
    return {**kept, "git_revs": revs if len(revs) > 1 else None,
            "gpus": {**(new.get("gpus") or {}), **(kept.get("gpus") or {})}}


def committed_docs(results_dir: str, vllm: str | None = None) -> dict[str, dict]:
    """The result files in ``results_dir`` by name; with ``vllm``, only those that ran on
    that vLLM version."""
    docs = {}
    for name in FILES:
        path = Path(results_dir, name)
        if path.exists():
            doc = json.loads(path.read_text())
            if vllm is None or doc["meta"].get("vllm") == vllm:
                docs[name] = doc
    return docs


def committed_rows(results_dir: str, vllm: str | None = None,
                   docs: dict[str, dict] | None = None) -> list[dict]:
    """The rows the result files in ``results_dir`` hold (or ``docs``, as
    :func:`committed_docs` reads them): a row per kind and engine, its runs at the revisions
    of the file's ``meta``, ``session`` None; with ``vllm``, only those of files that ran on
    that vLLM version."""
    out: dict[tuple, dict] = {}
    for name, doc in (committed_docs(results_dir, vllm) if docs is None else docs).items():
        _cut(name, doc, _adder(out, doc["meta"]))
    return list(out.values())


def write_results(work_dir: str, results_dir: str, session: str | None,
                  host: dict | None = None, **meta_fields) -> list[str]:
    """The paths of the result files that hold a row of ``session`` from ``work_dir``, each
    merged into its file already in ``results_dir`` where that ran on the vLLM of ``host``
    (:func:`results.versions` of this one when None); ``meta_fields`` go into their ``meta``
    (results.meta's ``command``, or a field of its own). Each run keeps the GPU it ran on
    (a fresh one: ``host``'s), and a merged file its ``note`` unless ``meta_fields`` has one."""
    host = results.versions() if host is None else host
    rows = [json.loads(p.read_text()) for p in sorted(Path(work_dir, "rows").glob("*.json"))]
    for run in (run for row in rows for run in row["runs"]):
        run.setdefault("gpus", {rev: host.get("gpu")
                                for rev in run.get("git_revs") or [run.get("git_rev")]})
    fresh = {(r["kind"], tuple(r["key"])) for r in rows}
    docs = committed_docs(results_dir, host.get("vllm"))
    rows += [r for r in committed_rows(results_dir, docs=docs)
             if (r["kind"], tuple(r["key"])) not in fresh]
    paths = []
    for name, (used, payload) in assemble(rows).items():
        if not any(r.get("session") == session for r in used):
            continue
        extra = {**meta_extra(used), **meta_fields}
        note = docs.get(name, {}).get("meta", {}).get("note")
        if note and "note" not in extra:
            extra["note"] = note
        if name == "exactness-teacher.json":
            extra["measure"] = judge.TEACHER_MEASURE
        paths.append(results.write(results_dir, name,
                                   {"meta": results.meta(host=host, **extra), **payload}))
    return paths
