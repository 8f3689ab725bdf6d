"""Pure helpers of the exactness checks: prompts, cases and the pass rule.

The pass rule is vLLM's ``check_logprobs_close``: two greedy runs agree if
their tokens are identical, or if at the first differing position each side's
token is among the other side's top-k logprobs.
"""
from __future__ import annotations

import numpy as np

MAX_TOKENS = 32
SINGLE_LENGTHS = (1, 7, 100, 1000, 4097, 16384, 32768)
MIXED_LENGTHS = (3, 150, 2500, 12000)


def random_prompt(length: int, vocab_size: int, seed: int) -> list[int]:
    rng = np.random.default_rng(seed)
    return rng.integers(100, vocab_size - 100, size=length).tolist()


def build_cases(max_prompt_len: int, vocab_size: int) -> list[dict]:
    """Cases as plain data. ``kind``: "batch" (one generate call over
    ``prompts``), "prefix" (two calls, the second reusing the first's prefix),
    "arrival" (a long prompt arrives while a short one decodes)."""
    cases = []
    for n in SINGLE_LENGTHS:
        if n <= max_prompt_len:
            cases.append({"case": f"len_{n}", "kind": "batch",
                          "prompts": [random_prompt(n, vocab_size, n)]})
    mixed = [min(n, max_prompt_len) for n in MIXED_LENGTHS]
    cases.append({"case": "mixed_batch", "kind": "batch",
                  "prompts": [random_prompt(n, vocab_size, 7 + i) for i, n in enumerate(mixed)]})
    prefix_len = min(6000, max_prompt_len // 2)
    base = random_prompt(prefix_len, vocab_size, 99)
    cases.append({"case": "prefix_hit", "kind": "prefix", "prompts": [
        base, base[: prefix_len * 5 // 6] + random_prompt(prefix_len // 4, vocab_size, 98)]})
    cases.append({"case": "decode_during_prefill", "kind": "arrival", "prompts": [
        random_prompt(50, vocab_size, 5),
        random_prompt(min(20000, max_prompt_len), vocab_size, 6)]})
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
