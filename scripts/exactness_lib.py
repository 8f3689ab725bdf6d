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
