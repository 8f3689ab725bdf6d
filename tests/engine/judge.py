"""How an engine's outputs are judged against one GPU's (pure): greedy and feature cases,
refusals at start-up, the teacher-forced measure, each rank's memory, the PCP ranks'
agreement on sampled tokens."""
import json
import re

import numpy as np

from cases import AGREEMENT_DECODE_TOKENS, BUDGET_PROMPTS, JSON_SCHEMA


def verdict(values) -> bool | None:
    """False if any is False, else None if any is None (or none is given), else True."""
    values = list(values)
    return False if False in values else None if None in values or not values else True


def _row(model: str, label: str, case: str, prompt_lens: list, **fields) -> dict:
    return {"model": model, "config": label, "case": case, "prompt_lens": prompt_lens, **fields}


def compare_outputs(a: dict, b: dict, top_k: int = 5) -> dict:
    """vLLM's ``check_logprobs_close`` of two greedy outputs: passed if identical, or if at
    the first divergence each token is in the other's top-k; ``baseline_margin`` there: how
    much more ``b`` (the baseline) preferred its token to ``a``'s (small: a near tie). A
    failed divergence keeps its evidence (``divergence``: both tokens, both top-k)."""
    def ranked(logprobs: dict) -> list[tuple[int, float]]:
        return [(int(t), v) for t, v in sorted(logprobs.items(), key=lambda kv: -kv[1])[:top_k]]

    def top(logprobs: dict) -> set[int]:
        return {t for t, _ in ranked(logprobs)}

    ta, tb, la, lb = a["token_ids"], b["token_ids"], a["logprobs"], b["logprobs"]
    shorter = min(len(ta), len(tb))
    first = next((i for i, (x, y) in enumerate(zip(ta, tb)) if x != y),
                 None if len(ta) == len(tb) else shorter)
    diffs = [abs(la[i][str(ta[i])] - lb[i][str(tb[i])])
             for i in range(shorter if first is None else first)]
    passed = first is None or (first < shorter and ta[first] in top(lb[first])
                               and tb[first] in top(la[first]))
    out = {"first_divergence": first, "max_abs_logprob_diff": round(max(diffs, default=0.0), 6),
           "passed": bool(passed)}
    if passed and first is not None:
        out["baseline_margin"] = round(lb[first][str(tb[first])] - lb[first][str(ta[first])], 6)
    elif not passed and first < shorter:
        out["divergence"] = {"position": first, "token": ta[first], "baseline_token": tb[first],
                             "top": ranked(la[first]), "baseline_top": ranked(lb[first])}
    return out


def not_comparable(res: dict, base_cases: dict) -> str | None:
    """Why a result cannot be held to the baseline's case of its name (None: it can)."""
    base = base_cases.get(res["case"])
    if base is None:
        return "the baseline did not run this case"
    if base["prompt_lens"] != res["prompt_lens"]:
        return f"the baseline ran prompts of {base['prompt_lens']} tokens"
    ours, theirs = res.get("continuation_digests"), base.get("continuation_digests")
    if ours and theirs and ours != theirs:
        return ("the baseline scored other continuations (its outputs changed between the run "
                "that scored them and the run this one scored)")
    return None


def engine_case(model: str, label: str, run: dict, base: dict) -> dict | None:
    """The one case of a comparison whose engine or baseline failed (None: neither did)."""
    failed = run if run["returncode"] else base if base["returncode"] else None
    return failed and _row(model, label, "engine", [], first_divergence=None,
                           max_abs_logprob_diff=None, passed=False, errors=failed.get("errors", []),
                           error=failed.get("log_tail", "")[-1500:])


def compare_run(model: str, label: str, run: dict, base: dict,
                key: str = "results") -> tuple[list[dict], list[dict]]:
    """Each case of ``run[key]`` by :func:`compare_outputs`; those not comparable apart."""
    if failed := engine_case(model, label, run, base):
        return [failed], []
    base_cases = {c["case"]: c for c in base.get(key) or []}
    cases, skipped = [], []
    for res in run.get(key) or []:
        row = _row(model, label, res["case"], res["prompt_lens"])
        if reason := not_comparable(res, base_cases):
            skipped.append({**row, "reason": reason})
            continue
        per = [compare_outputs(a, b)
               for a, b in zip(res["outputs"], base_cases[res["case"]]["outputs"])]
        diverged = [p["first_divergence"] for p in per if p["first_divergence"] is not None]
        row.update(first_divergence=min(diverged, default=None),
                   max_abs_logprob_diff=max(p["max_abs_logprob_diff"] for p in per),
                   passed=all(p["passed"] for p in per))
        if failed_at := [{"prompt": i, **p["divergence"]} for i, p in enumerate(per)
                         if "divergence" in p]:
            row["failed_divergences"] = failed_at
        margins = [p["baseline_margin"] for p in per if "baseline_margin" in p]
        cases.append({**row, "max_baseline_margin": max(margins)} if margins else row)
    return cases, skipped


RAW_FIELDS = (("results", "outputs"), ("feature_results", "outputs"), ("scores", "scores"))


def differing_cases(run: dict, other: dict) -> tuple[int, list[str]]:
    """How many cases two raw entries both ran, and those whose prompts or outputs (token
    ids, logprobs, prompt logprobs) or teacher-forced scores differ at all."""
    compared, differ = 0, []
    for key, field in RAW_FIELDS:
        mine = {r["case"]: r for r in other.get(key) or []}
        for res in (r for r in run.get(key) or [] if r["case"] in mine):
            compared += 1
            if (res["prompt_lens"], res[field]) != (mine[res["case"]]["prompt_lens"],
                                                    mine[res["case"]][field]):
                differ.append(f"{key}:{res['case']}")
    return compared, differ


def summarize(cases: list[dict]) -> dict:
    margins = [c["max_baseline_margin"] for c in cases if "max_baseline_margin" in c]
    return {"cases": len(cases), "passed": sum(c["passed"] for c in cases),
            "no_divergence": sum(c["passed"] and c["first_divergence"] is None for c in cases),
            "max_baseline_margin_at_divergence": max(margins, default=None)}


# --- feature cases: vLLM's top-5 rule, then each kind's own
PROMPT_LOGPROB_LIMIT = 1.0  # a prompt position further from one GPU's fails


def alike_draws(divergence: dict, limit: float = PROMPT_LOGPROB_LIMIT) -> bool:
    """Whether two seeded samples that part at ``divergence`` (:func:`compare_outputs`)
    drew from alike distributions there: each run's most likely token among the other's
    top 5 (the top-5 rule on the distributions) and every token both list within ``limit``.
    Both runs draw the same random numbers, so logits that round otherwise move a draw to
    any token, most often one outside the top 5: the top-5 rule on the drawn tokens would
    judge the draw, not the logits."""
    top, base = ({int(t): lp for t, lp in divergence[k]} for k in ("top", "baseline_top"))
    if not top or not base:
        return False
    mode, base_mode = max(top, key=top.get), max(base, key=base.get)
    return (mode in base and base_mode in top
            and all(abs(top[t] - base[t]) <= limit for t in top.keys() & base.keys()))


def alike_samples(outputs: list[dict], base_outputs: list[dict]) -> bool:
    """Seeded samples against one GPU's: as many, each equal, within the top-5 rule, or
    parting where both drew from alike distributions (:func:`alike_draws`)."""
    per = [compare_outputs(a, b) for a, b in zip(outputs, base_outputs)]
    return len(outputs) == len(base_outputs) and all(
        p["passed"] or ("divergence" in p and alike_draws(p["divergence"])) for p in per)


def compare_features(model: str, label: str, run: dict, base: dict) -> tuple[list, list]:
    """:func:`compare_run` of the feature results, then each kind's rule: ``exact``: no
    divergence (``sample_rule_passed``: :func:`alike_samples`); prompt logprobs within the
    limit; preemption happened; JSON valid if on one GPU."""
    def json_valid(text) -> bool:
        try:
            value = json.loads(text)
        except (TypeError, ValueError):
            return False
        return isinstance(value, dict) and set(value) == set(JSON_SCHEMA["required"])

    cases, skipped = compare_run(model, label, run, base, "feature_results")
    if cases and cases[0]["case"] == "engine":
        return cases, skipped
    ours, theirs = ({r["case"]: r for r in x["feature_results"]} for x in (run, base))
    for case in cases:
        result, base_result = ours[case["case"]], theirs[case["case"]]
        outs, base_outs, kind = result["outputs"], base_result["outputs"], result["kind"]
        passed = case["passed"] and len(outs) == len(base_outs)
        case["kind"] = kind
        if result.get("rule") == "exact":
            case.update(rule="exact", choices=result.get("choices"),
                        sample_rule_passed=alike_samples(outs, base_outs))
            passed = passed and case["first_divergence"] is None
        if kind == "prompt_logprobs":
            pairs = [(a["prompt_logprobs"], b["prompt_logprobs"]) for a, b in zip(outs, base_outs)]
            diffs = [abs(x - y) for a, b in pairs if len(a) == len(b) for x, y in zip(a, b)]
            match = bool(outs) and len(outs) == len(base_outs) and all(
                len(a) == len(b) for a, b in pairs)
            d = np.array(diffs or [0.0])
            case.update(max_abs_prompt_logprob_diff=round(float(d.max()), 6),
                        p99_abs_prompt_logprob_diff=round(float(np.percentile(d, 99)), 6),
                        prompt_positions=len(diffs),
                        prompt_positions_over_limit=int((d > PROMPT_LOGPROB_LIMIT).sum()),
                        prompt_positions_match=match)
            passed = passed and match and case["prompt_positions_over_limit"] == 0
        if kind == "preemption":
            case.update(preemptions=result.get("preemptions"),
                        baseline_preemptions=base_result.get("preemptions"))
            passed = passed and bool(result.get("preemptions"))
        if kind == "json_schema":
            valid, base_valid = ([json_valid(o.get("text")) for o in x] for x in (outs, base_outs))
            case.update(json_valid=sum(valid), baseline_json_valid=sum(base_valid))
            passed = passed and all(v or not b for v, b in zip(valid, base_valid))
        case["passed"] = bool(passed)
    return cases, skipped


# --- the PCP ranks' agreement on sampled tokens (VLLM_PCP_CHECK_SAMPLED_TOKENS)
def agreement_row(run: dict) -> dict:
    """The "agreement" case of ``run``: each request's decode length, the steps each rank
    checked (an engine whose ranks sampled differently stops at that step, with an error),
    and whether a greedy and a seeded request decoded AGREEMENT_DECODE_TOKENS steps side by
    side with every step checked on every rank."""
    case = next((r for r in run.get("feature_results") or [] if r["case"] == "agreement"), None)
    decoded = [len(o["token_ids"]) for o in case["outputs"]] if case else []
    checks = run.get("sampled_token_checks") or []
    passed = (not run.get("returncode") and len(decoded) == 2
              and min(decoded) >= AGREEMENT_DECODE_TOKENS and len(checks) > 1
              and min(checks) >= AGREEMENT_DECODE_TOKENS)
    return {"decode_tokens": decoded, "sampled_token_checks": checks, "passed": passed,
            "errors": (run.get("errors") or [])[:3]}


# --- the memory budget: vLLM's own KV sizing, then the largest split steps
def budget_row(run: dict) -> dict:
    """A budget engine's cases and ranks: whether every case ran (no out-of-memory error
    stops it) and every rank's split-step peak fits what vLLM's profile run held."""
    ran = {r["case"]: len(r["outputs"]) for r in run.get("feature_results") or []}
    ranks = rank_rows(run) if run.get("memory") else []
    passed = (not run.get("returncode")
              and all(ran.get(c) == n for c, n in BUDGET_PROMPTS.items())
              and bool(ranks) and all(r["fits"] is True for r in ranks))
    return {"cases_run": ran, "ranks": ranks, "passed": passed,
            "errors": (run.get("errors") or [])[:3]}


# --- refusals at start-up, read from the worker's log
ENGINE_START_MARK = "exactness-worker engine start at"  # printed with the time by worker.py
REFUSAL_LIMIT_S = 120.0
SLIDING_WINDOW_PATTERN = r"sliding[- ]window"
# "RuntimeError: ..." after any "(Worker pid=N) ERROR ... [file.py:N]" prefix
_ERROR_LINE = re.compile(r"(?:^|\s)((?:\w+\.)*\w*(?:Error|Exception): .*)$")
# a refusal's "  - setting" lines, or those under pydantic's ValidationError of a VllmConfig
_UNDER = re.compile(r"^(?:.*?\] )?\s+(?:(- \S.*)|Value error, (\S.*))$")
_START = re.compile(re.escape(ENGINE_START_MARK) + r" ([\d.]+)")


def error_blocks(log: str) -> list[str]:
    """Each distinct exception line of a log with the setting lines right under it."""
    blocks, current = [], None
    for line in log.splitlines():
        if found := _ERROR_LINE.search(line):
            blocks.append(current := [found.group(1)])
        elif current is not None and (under := _UNDER.match(line)):
            current.append(under.group(1) or under.group(2))
        else:
            current = None
    return list(dict.fromkeys("\n".join(b) for b in blocks))


def error_lines(log: str, limit: int = 8) -> list[str]:
    """The distinct exception lines, first seen first (the root cause before its tracebacks)."""
    return list(dict.fromkeys(b.split("\n", 1)[0] for b in error_blocks(log)))[:limit]


def refusal_record(log: str, returncode: int, timed_out: bool, process_seconds: float,
                   ended_at: float, pattern: str) -> dict:
    """``refused``: exited with an error matching ``pattern``, not timed out; the seconds
    from :data:`ENGINE_START_MARK` to ``ended_at`` (epoch)."""
    blocks = error_blocks(log)
    message = next((b for b in blocks if re.search(pattern, b, re.IGNORECASE)), None)
    start = _START.search(log)
    return {"refused": bool(returncode) and not timed_out and message is not None,
            "message": message or (blocks[0] if blocks else None), "errors": error_lines(log),
            "seconds_to_failure": round(ended_at - float(start.group(1)), 1) if start else None,
            "process_seconds": round(process_seconds, 1), "timed_out": timed_out,
            "returncode": returncode}


def refusal_case(model: str, label: str, record: dict, limit_s: float = REFUSAL_LIMIT_S) -> dict:
    """Passed when refused within ``limit_s`` of the engine's start."""
    seconds = record["seconds_to_failure"]
    return _row(model, label, "refusal", [], first_divergence=None, max_abs_logprob_diff=None,
                passed=bool(record["refused"] and seconds is not None and seconds <= limit_s),
                error=record["message"], errors=record["errors"], seconds_to_failure=seconds,
                process_seconds=record["process_seconds"], timed_out=record["timed_out"])


# --- the teacher-forced measure: one GPU's greedy output appended to each prompt and
# scored by every layout, so that nothing cascades from a rounding
OVER_LIMIT = 1.0  # a position whose |logprob difference| exceeds this fails the goal
TEACHER_FLOORS = {"pcp1-graphs": "pcp1", "pcp1-flash-attn": "pcp1", "tp2": "pcp1"}
GOAL_FLOORS = ("pcp1-graphs", "pcp1-flash-attn")
EXPERT_SHARDING_FLOOR = "tp2"  # vLLM shards MoE experts over PCP ranks as over TP ranks
# at most this many times the larger floor, at max and at p99 (-dcp's merge rounds once more)
TEACHER_GOALS = {**dict.fromkeys(("pcp2", "pcp2-graphs", "pcp2-paged", "pcp2-shard",
                                   "pcp2-ray", "pcp4", "pcp8", "tp2-pcp2"), 1.0),
                 **dict.fromkeys(("pcp2-dcp2-i1", "pcp2-dcp2-i8", "pcp2-dcp2-i16",
                                  "pcp2-dcp2-i8-graphs", "pcp2-dcp2-i1-ray", "pcp4-dcp4-i1",
                                  "pcp4-dcp4-i8", "tp2-dcp2-i1", "tp2-dcp2-i8",
                                  "tp2-pcp2-dcp2-i1", "tp4-pcp2-dcp2-i8"), 1.5)}
TEACHER_MEASURE = ("teacher-forced: the pcp1 greedy output of each prompt (one GPU, vLLM's "
                   "FlashInfer on Model Runner V2, chunked, eager) appended to it and scored "
                   "with prompt_logprobs=0; per case, over the continuation positions of its "
                   "prompts, |logprob of the given token - the baseline's|: max, p99 (linear "
                   "interpolation), positions over 1.0")


def diff_stats(diffs: np.ndarray) -> dict:
    """Max, 99th percentile (linear interpolation), positions over :data:`OVER_LIMIT`."""
    empty = not len(diffs)
    return {"positions": int(len(diffs)),
            "max_abs_logprob_diff": None if empty else round(float(np.max(diffs)), 6),
            "p99_abs_logprob_diff": None if empty else round(float(np.percentile(diffs, 99)), 6),
            "positions_over_1": int(np.sum(diffs > OVER_LIMIT))}


def teacher_cases(model: str, label: str, run: dict, base: dict) -> tuple[list, dict | None]:
    """A row per scored case, and :func:`diff_stats` of them all (None: a run failed)."""
    failed = engine_case(model, label, run, base) or {}
    if failed or "scores" not in run or "scores" not in base:
        error = failed.get("error") or run.get("scores_error") or base.get("scores_error")
        return [_row(model, label, "engine", [], errors=failed.get("errors", []),
                     error=error or "not scored")], None
    rows, diffs, base_cases = [], [], {res["case"]: res for res in base["scores"]}
    for res in run["scores"]:
        row = _row(model, label, res["case"], res["prompt_lens"])
        if reason := not_comparable(res, base_cases):
            rows.append({**row, "not_compared": reason})
            continue
        ours, theirs = (np.concatenate([[], *r["scores"]]) for r in (res, base_cases[res["case"]]))
        diffs.append(np.abs(ours - theirs))
        rows.append({**row, **diff_stats(diffs[-1])})
    return rows, {"cases": len(diffs), **diff_stats(np.concatenate([np.zeros(0), *diffs]))}


def teacher_goal(pooled: dict[str, dict | None], measured: dict[str, dict | None],
                 factors: dict[str, float]) -> dict:
    """Each layout of ``factors`` at most its factor times the larger floor of ``pooled``
    (the one-GPU floors, and vLLM's expert sharding where it ran) at max and p99 (None: no
    run or floor; False: failed), no position over :data:`OVER_LIMIT`, all ``met``."""
    floors = {c: pooled.get(c) for c in GOAL_FLOORS}
    if EXPERT_SHARDING_FLOOR in pooled:  # a MoE model that ran it alone: that one alone
        floors = {c: f for c, f in floors.items() if c in pooled}
        floors[EXPERT_SHARDING_FLOOR] = pooled[EXPERT_SHARDING_FLOOR]
    floor = ({key: max(f[key] for f in floors.values())
              for key in ("max_abs_logprob_diff", "p99_abs_logprob_diff")}
             if all(f and f["positions"] for f in floors.values()) else None)
    checks: dict[str, bool | None] = {}
    for config, factor in factors.items():
        stats = measured.get(config, {})
        checks[config] = (None if config not in measured or floor is None else False
                          if not stats or not stats["positions"] else
                          all(stats[key] <= factor * floor[key] for key in floor))
    stats = [s for s in measured.values() if s is not None]
    checks["no_position_over_1"] = not any(s["positions_over_1"] for s in stats) if stats else None
    checks["met"] = verdict(checks.values())
    return {"larger_floor": floor, "factors": dict(factors), **checks}


# --- memory: each rank's peak on the split steps against what vLLM's profile run set aside
GIB = 1 << 30


# vllm_pcp.pcp.counts.PCPStepCounts: a rank's steps, as pcp_step_counts returns them
STEP_COUNT_FIELDS = ("steps", "split_steps", "fresh_split_steps", "gathered_steps",
                     "steps_without_local_tokens")


def step_counts_as_expected(run: dict, decode_policy: str) -> bool | None:
    """Whether every rank's steps (``step_counts``) ran as the layout's ``decode_policy``
    says: the ranks saw the same steps and splits; some step split (the checks split
    every long prompt); each split step gathered its K/V. ``replicate``: no other step
    gathered, and every rank had tokens in every step. ``shard``: every step gathered,
    and some rank had a step without tokens (a decode alone owns one rank). None where
    the run recorded no counts of these fields (one GPU, a failed run)."""
    counts = run.get("step_counts") or []
    if not counts or any(set(STEP_COUNT_FIELDS) - set(c) for c in counts):
        return None
    same = {tuple(c[f] for f in STEP_COUNT_FIELDS[:4]) for c in counts}
    if len(same) != 1:
        return False
    steps, split, fresh, gathered = same.pop()
    if not 0 <= fresh <= split <= gathered <= steps or not split:
        return False
    idle = [c["steps_without_local_tokens"] for c in counts]
    if decode_policy == "shard":
        return gathered == steps and any(idle)
    return gathered == split and not any(idle)


def rank_rows(run: dict) -> list[dict]:
    """Per rank, the largest peak of its phases above each one's start against the profile
    run's peak; not of a phase with prompt logprobs (a whole chunk's logits, never profiled)."""
    logprobs = {"standard": False, "scoring": True, "features": any(
        r.get("case") == "prompt_logprobs" for r in run.get("feature_results") or [])}
    rows = []
    for rank, start in enumerate(run["memory"]["at_start"]):
        judged, other, begin = [], [], start
        for phase, ends in run["memory"]["phases"].items():
            peak = ends[rank]["peak_allocated_bytes"] - begin["allocated_bytes"]
            (other if logprobs[phase] else judged).append(peak)
            begin = ends[rank]
        step, profile = max(judged, default=None), start["profile_peak_bytes"]
        rows.append({
            "step_peak_gib": None if step is None else round(step / GIB, 4),
            "profile_peak_gib": None if profile is None else round(profile / GIB, 4),
            "split_step_reserve_gib": round(start["split_step_reserve_bytes"] / GIB, 4),
            "fits": None if step is None or profile is None else step <= profile,
            **({"prompt_logprobs_peak_gib": round(max(other) / GIB, 4)} if other else {})})
    return rows
