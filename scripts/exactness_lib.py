"""Pure helpers of the exactness checks: prompts, cases, the pass rule and the
teacher-forced measure.

The pass rule is vLLM's ``check_logprobs_close``: two greedy runs agree if
their tokens are identical, or if at the first differing position each side's
token is among the other side's top-k logprobs.
"""
from __future__ import annotations

import hashlib

import numpy as np

MAX_TOKENS = 32
# 4099 = 2 x 2048 + 3: chunked prefill leaves a 3-token chunk, which at -pcp 4 -dcp 4 and 8
# splits into fewer tokens than ranks (a step with ranks without tokens; with a whole cache
# on every rank the chunk is computed whole, as one GPU attends it)
SINGLE_LENGTHS = (1, 7, 100, 1000, 4097, 4099, 16384, 32768)
MIXED_LENGTHS = (3, 150, 2500, 12000)


def random_prompt(length: int, vocab_size: int, seed: int) -> list[int]:
    rng = np.random.default_rng(seed)
    return rng.integers(100, vocab_size - 100, size=length).tolist()


def text_prompt(corpus: list[int], questions: list[list[int]], length: int,
                seed: int) -> list[int]:
    """``length`` tokens of real text: a window of ``corpus`` (token ids of
    worked examples) followed by one of ``questions``, cut from the front.

    Random ids on random weights give near-ties at almost every token; real text
    on a real model shows how often its own preferences are that close (the
    baseline margin at each divergence says so)."""
    question = questions[seed % len(questions)]
    body = max(0, length - len(question))
    if body > len(corpus):
        raise ValueError(f"a {length}-token prompt needs a longer corpus ({len(corpus)})")
    start = (seed * 7919) % (len(corpus) - body + 1)
    return (corpus[start:start + body] + question)[-length:]


def render_gsm8k(rows: list[dict]) -> tuple[str, list[str]]:
    """GSM8K rows (``question``, ``answer``) as a worked-example corpus and, from
    the last 16 rows, open questions."""
    worked = "".join(f"Question: {r['question']}\nAnswer: {r['answer']}\n\n" for r in rows[:-16])
    return worked, [f"Question: {r['question']}\nAnswer:" for r in rows[-16:]]


def build_cases(max_prompt_len: int, vocab_size: int, make_prompt=None) -> list[dict]:
    """Cases as plain data. ``kind``: "batch" (one generate call over
    ``prompts``), "prefix" (two calls, the second reusing the first's prefix),
    "arrival" (a long prompt arrives while a short one decodes).
    ``make_prompt(length, seed)`` gives the token ids (default: random ids)."""
    prompt = make_prompt or (lambda n, seed: random_prompt(n, vocab_size, seed))
    cases = []
    for n in SINGLE_LENGTHS:
        if n <= max_prompt_len:
            cases.append({"case": f"len_{n}", "kind": "batch",
                          "prompts": [prompt(n, n)]})
    mixed = [min(n, max_prompt_len) for n in MIXED_LENGTHS]
    cases.append({"case": "mixed_batch", "kind": "batch",
                  "prompts": [prompt(n, 7 + i) for i, n in enumerate(mixed)]})
    prefix_len = min(6000, max_prompt_len // 2)
    base = prompt(prefix_len, 99)
    cases.append({"case": "prefix_hit", "kind": "prefix", "prompts": [
        base, base[: prefix_len * 5 // 6] + prompt(prefix_len // 4, 98)]})
    cases.append({"case": "decode_during_prefill", "kind": "arrival", "prompts": [
        prompt(50, 5),
        prompt(min(20000, max_prompt_len), 6)]})
    return cases


def _top_k(logprobs: dict, k: int) -> set[int]:
    ranked = sorted(logprobs.items(), key=lambda kv: kv[1], reverse=True)
    return {int(tok) for tok, _ in ranked[:k]}


def compare_outputs(a: dict, b: dict, top_k: int = 5) -> dict:
    """Compare two greedy outputs ``{"token_ids": [...], "logprobs": [{tok: lp}]}``.

    Returns ``first_divergence`` (None if identical), ``max_abs_logprob_diff``
    of the chosen tokens before it, ``passed``, and at a divergence inside the
    top-k ``baseline_margin``: how much more ``b`` (the baseline) preferred its
    own token to ``a``'s there (small: a near tie that rounding can flip).
    """
    ta, tb = a["token_ids"], b["token_ids"]
    la, lb = a["logprobs"], b["logprobs"]
    first = next((i for i, (x, y) in enumerate(zip(ta, tb)) if x != y), None)
    if first is None and len(ta) != len(tb):
        first = min(len(ta), len(tb))
    upto = min(len(ta), len(tb)) if first is None else first
    diffs = [abs(la[i][str(ta[i])] - lb[i][str(tb[i])]) for i in range(upto)]
    if first is None:
        passed = True
    elif first >= min(len(ta), len(tb)):
        passed = False
    else:
        passed = ta[first] in _top_k(lb[first], top_k) and tb[first] in _top_k(la[first], top_k)
    out = {"first_divergence": first,
           "max_abs_logprob_diff": round(max(diffs, default=0.0), 6),
           "passed": bool(passed)}
    if passed and first is not None:
        out["baseline_margin"] = round(lb[first][str(tb[first])] - lb[first][str(ta[first])], 6)
    return out


# The teacher-forced measure: one fixed continuation (the one-GPU greedy output) appended
# to each prompt and scored with prompt_logprobs by every configuration. A rounding
# difference moves the log-probability of the given token a little at the positions after
# it, and never changes which tokens later positions see, so nothing cascades.
TEACHER_SOURCE = {"config": "pcp1-v1", "variant": "chunked"}
OVER_LIMIT = 1.0  # a position whose |logprob difference| exceeds this fails the goal


def teacher_continuations(raw: dict, model: str) -> dict[str, dict]:
    """The continuations of ``model`` to score, ``case -> {"prompt_lens", "token_ids"}``
    (one token list per prompt), from the :data:`TEACHER_SOURCE` run of a raw file of
    ``check_exactness.py run``."""
    for run in raw["runs"]:
        if (run["model"] == model and run["config"] == TEACHER_SOURCE["config"]
                and run["variant"] == TEACHER_SOURCE["variant"] and not run["returncode"]):
            return continuations_of(run["results"])
    raise ValueError(f"no successful {TEACHER_SOURCE} run of {model} to take continuations from")


def continuations_of(results: list[dict]) -> dict[str, dict]:
    """``case -> {"prompt_lens", "token_ids"}`` of the standard cases' greedy outputs."""
    return {res["case"]: {"prompt_lens": res["prompt_lens"],
                          "token_ids": [out["token_ids"] for out in res["outputs"]]}
            for res in results}


def continuation_digest(token_ids: list[int]) -> str:
    """A short digest of one continuation's token ids: a scoring records what it scored,
    so that two scorings of different continuations (a baseline's outputs that changed
    between runs) are never compared."""
    return hashlib.sha1(",".join(map(str, token_ids)).encode()).hexdigest()[:16]


def teacher_prompts(prompts: list[list[int]], continuations: list[list[int]]) -> list[list[int]]:
    """Each prompt followed by its continuation."""
    if len(prompts) != len(continuations):
        raise ValueError(f"{len(prompts)} prompts, {len(continuations)} continuations")
    return [list(p) + list(c) for p, c in zip(prompts, continuations)]


def abs_logprob_diffs(scores: list[list[float]], base_scores: list[list[float]]) -> np.ndarray:
    """|difference| of the given token's logprob at each scored position of a case (its
    prompts one after the other), ``scores`` against ``base_scores``."""
    if [len(s) for s in scores] != [len(s) for s in base_scores]:
        raise ValueError(f"scored positions differ: {[len(s) for s in scores]} vs "
                         f"{[len(s) for s in base_scores]}")
    flat = [np.asarray(s, dtype=np.float64) for s in scores]
    base = [np.asarray(s, dtype=np.float64) for s in base_scores]
    empty = [np.zeros(0)]
    return np.abs(np.concatenate(flat or empty) - np.concatenate(base or empty))


def diff_stats(diffs: np.ndarray) -> dict:
    """Max, 99th percentile (linear interpolation) and the count over :data:`OVER_LIMIT`
    of |logprob differences|."""
    if not len(diffs):
        return {"positions": 0, "max_abs_logprob_diff": None, "p99_abs_logprob_diff": None,
                "positions_over_1": 0}
    return {"positions": int(len(diffs)),
            "max_abs_logprob_diff": round(float(np.max(diffs)), 6),
            "p99_abs_logprob_diff": round(float(np.percentile(diffs, 99)), 6),
            "positions_over_1": int(np.sum(diffs > OVER_LIMIT))}


def larger_floor(floors: dict[str, dict | None]) -> dict | None:
    """The larger one-GPU floor at max and at p99 (each taken on its own), or None when a
    floor is missing or has no positions."""
    if not floors or any(f is None or not f["positions"] for f in floors.values()):
        return None
    return {key: max(f[key] for f in floors.values())
            for key in ("max_abs_logprob_diff", "p99_abs_logprob_diff")}


def teacher_goal(floors: dict[str, dict | None], measured: dict[str, dict | None],
                 factors: dict[str, float]) -> dict:
    """The goal as booleans: each configuration of ``factors`` at most ``factor`` times the
    larger floor at max and at p99 (None: not run, or no floor to compare with; False: its
    run failed), no position over :data:`OVER_LIMIT` in any measured configuration, and
    ``met``: False if a check is, else None if a check is, else True. ``floors`` and
    ``measured``: config -> :func:`diff_stats`, or None for a failed run."""
    floor = larger_floor(floors)
    checks: dict[str, bool | None] = {}
    for config, factor in factors.items():
        if config not in measured or floor is None:
            checks[config] = None
        elif measured[config] is None or not measured[config]["positions"]:
            checks[config] = False
        else:
            checks[config] = all(measured[config][key] <= factor * floor[key] for key in floor)
    stats = [s for s in measured.values() if s is not None]
    checks["no_position_over_1"] = (not any(s["positions_over_1"] for s in stats)
                                    if stats else None)
    values = list(checks.values())
    checks["met"] = False if False in values else None if None in values else True
    return {"larger_floor": floor, "factors": dict(factors), **checks}
