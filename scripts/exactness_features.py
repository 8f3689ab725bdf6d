"""The feature cases of the exactness checks: what a user combines with ``-pcp`` / ``-dcp``.

Cases are plain data built here and run by scripts/exactness_worker.py
(``--cases GROUP``); scripts/check_exactness.py ``features`` runs them against
``-pcp 1`` and judges them. Every case is one ``LLM.generate`` call over its
``prompts`` (all submitted together, so they are scheduled from the same step on),
with ``sampling`` overriding the greedy defaults of :func:`sampling_fields`:

- ``sampled_n4``: ``n = 4`` at temperature 0.8 with a fixed seed (vLLM 0.26.0 refuses
  ``n > 1`` at temperature 0); each choice must equal one GPU's token for token;
- ``burst``: greedy requests sharing a long prefix, so that later ones hit blocks the
  first one writes in the same step;
- ``split_N``, ``split_odd_even_batch``: split prompts of odd and even lengths;
- ``prompt_logprobs``: the log-probability of every prompt token;
- ``json_schema``: a JSON schema through ``StructuredOutputsParams(json=...)`` (what an
  OpenAI ``response_format`` of type ``json_schema`` becomes); needs a tokenizer;
- ``repetition_penalty``, ``presence_frequency_penalty``: greedy with penalties;
- ``preemption``: more requests than a small KV pool holds to the end, so vLLM preempts
  some and recomputes them (its own engine: see :data:`PREEMPT_CAPACITY_TOKENS`).

A configuration vLLM or the plugin must refuse at start-up is judged from the
worker's log by :func:`refusal_record`.
"""
from __future__ import annotations

import json
import math
import re
import time

import numpy as np

from exactness_lib import random_prompt
from gpu_runs import error_lines

SAMPLED = {"n": 4, "temperature": 0.8, "top_p": 0.95, "seed": 1234}
SAMPLED_LENGTHS = (9001, 16384)
BURST_PREFIX = 6001
BURST_SUFFIXES = (1, 2, 17, 64, 129, 500, 1001, 2048)
SPLIT_LENGTHS = (5, 6, 4096, 4097, 12000, 12001)
PROMPT_LOGPROB_LENGTHS = (1000, 4097)
PENALTY_LENGTHS = (777, 3000)
JSON_LENGTHS = (501, 2000)
JSON_SCHEMA = {"type": "object",
               "properties": {"name": {"type": "string", "maxLength": 12},
                              "count": {"type": "integer", "minimum": 0, "maximum": 999},
                              "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]},
                                       "maxItems": 3}},
               "required": ["name", "count", "tags"], "additionalProperties": False}
# |difference| of a prompt token's log-probability above which a position fails
PROMPT_LOGPROB_LIMIT = 1.0

# Preemption: a KV pool of PREEMPT_CAPACITY_TOKENS (the scheduler's tokens; a DCP rank
# holds 1/DCP of them) takes every prompt of the case but not every prompt with its
# PREEMPT_MAX_TOKENS outputs; max_model_len stays under the pool (vLLM's start-up check)
PREEMPT_CAPACITY_TOKENS = 12288
PREEMPT_MAX_MODEL_LEN = 4096
PREEMPT_REQUESTS = 6
PREEMPT_MAX_TOKENS = 128
PREEMPT_SLACK_TOKENS = 400
BLOCK_TOKENS = 16  # vLLM's block; a DCP scheduler block spans BLOCK_TOKENS x DCP tokens

CASE_GROUPS = ("features", "same-step", "preemption", "none")
SAME_STEP_CASES = ("sampled_n4", "burst")

# Refusals: the worker prints ENGINE_START_MARK and the time just before it builds the
# engine; a refusal must come within REFUSAL_LIMIT_S of it, and a run still going after
# REFUSAL_TIMEOUT_S is killed as a hang
ENGINE_START_MARK = "exactness-worker engine start at"
REFUSAL_LIMIT_S = 120.0
REFUSAL_TIMEOUT_S = 300
SLIDING_WINDOW_PATTERN = r"sliding[- ]window"


def _prompts(lengths, vocab_size: int, max_prompt_len: int, seed: int) -> list[list[int]]:
    return [random_prompt(min(n, max_prompt_len), vocab_size, seed + i)
            for i, n in enumerate(lengths)]


def sampled_case(max_prompt_len: int, vocab_size: int) -> dict:
    """``n = 4`` seeded sampling on long prompts; every choice compared exactly."""
    return {"case": "sampled_n4", "kind": "sampled", "rule": "exact",
            "prompts": _prompts(SAMPLED_LENGTHS, vocab_size, max_prompt_len, 200),
            "sampling": dict(SAMPLED)}


def burst_case(max_prompt_len: int, vocab_size: int) -> dict:
    """Greedy requests that share a long prefix, submitted together."""
    prefix_len = min(BURST_PREFIX, max_prompt_len // 2)
    prefix = random_prompt(prefix_len, vocab_size, 300)
    room = max_prompt_len - prefix_len
    return {"case": "burst", "kind": "burst", "prefix_len": prefix_len,
            "prompts": [prefix + random_prompt(min(s, room), vocab_size, 310 + i)
                        for i, s in enumerate(BURST_SUFFIXES)]}


def split_cases(max_prompt_len: int, vocab_size: int) -> list[dict]:
    """Each odd and even length alone, then all of them in one batch."""
    lengths = [n for n in SPLIT_LENGTHS if n <= max_prompt_len]
    singles = [{"case": f"split_{n}", "kind": "split",
                "prompts": [random_prompt(n, vocab_size, 400 + n)]} for n in lengths]
    batch = {"case": "split_odd_even_batch", "kind": "split",
             "prompts": _prompts(lengths, vocab_size, max_prompt_len, 450)}
    return singles + [batch]


def sampling_cases(max_prompt_len: int, vocab_size: int, with_json: bool) -> list[dict]:
    """prompt_logprobs, penalties and (with a tokenizer) a JSON schema."""
    cases = [{"case": "prompt_logprobs", "kind": "prompt_logprobs",
              "prompts": _prompts(PROMPT_LOGPROB_LENGTHS, vocab_size, max_prompt_len, 500),
              "sampling": {"prompt_logprobs": 5}},
             {"case": "repetition_penalty", "kind": "penalty",
              "prompts": _prompts(PENALTY_LENGTHS, vocab_size, max_prompt_len, 600),
              "sampling": {"repetition_penalty": 1.3}},
             {"case": "presence_frequency_penalty", "kind": "penalty",
              "prompts": _prompts(PENALTY_LENGTHS, vocab_size, max_prompt_len, 650),
              "sampling": {"presence_penalty": 0.5, "frequency_penalty": 0.5}}]
    if with_json:
        cases.append({"case": "json_schema", "kind": "json_schema",
                      "prompts": _prompts(JSON_LENGTHS, vocab_size, max_prompt_len, 700),
                      "sampling": {"structured_outputs": {"json": JSON_SCHEMA},
                                   "ignore_eos": False, "detokenize": True,
                                   "max_tokens": 96}})
    return cases


def preemption_lengths(capacity: int = PREEMPT_CAPACITY_TOKENS,
                       requests: int = PREEMPT_REQUESTS) -> list[int]:
    """Prompt lengths, odd and even, that fill ``capacity`` but for the slack."""
    per = (capacity - PREEMPT_SLACK_TOKENS) // requests
    offsets = [(-1) ** i * 17 * i for i in range(requests)]
    return [per + o for o in offsets]


def blocks_needed(lengths, block: int) -> int:
    """Blocks of ``block`` tokens that sequences of ``lengths`` tokens take."""
    return sum(math.ceil(n / block) for n in lengths)


def preemption_case(vocab_size: int, capacity: int = PREEMPT_CAPACITY_TOKENS) -> dict:
    """Requests whose prompts all fit the pool (counted in DCP = 2 blocks, plus vLLM's
    null block) while prompts and outputs together do not (counted in one-rank
    blocks): vLLM admits them all, then preempts some while they decode."""
    lengths = preemption_lengths(capacity)
    fits = (blocks_needed(lengths, 2 * BLOCK_TOKENS) + 1) * 2 * BLOCK_TOKENS <= capacity
    overflows = blocks_needed([n + PREEMPT_MAX_TOKENS for n in lengths],
                              BLOCK_TOKENS) * BLOCK_TOKENS > capacity
    if not (fits and overflows):
        raise ValueError(f"preemption prompts {lengths} do not preempt in {capacity} tokens")
    return {"case": "preemption", "kind": "preemption",
            "prompts": [random_prompt(n, vocab_size, 800 + i) for i, n in enumerate(lengths)],
            "sampling": {"max_tokens": PREEMPT_MAX_TOKENS}}


def build_feature_cases(group: str, max_prompt_len: int, vocab_size: int,
                        with_json: bool = False) -> list[dict]:
    """The cases of ``group`` (one of :data:`CASE_GROUPS`)."""
    if group == "features":
        return ([sampled_case(max_prompt_len, vocab_size), burst_case(max_prompt_len, vocab_size)]
                + split_cases(max_prompt_len, vocab_size)
                + sampling_cases(max_prompt_len, vocab_size, with_json))
    if group == "same-step":
        return [sampled_case(max_prompt_len, vocab_size), burst_case(max_prompt_len, vocab_size)]
    if group == "preemption":
        return [preemption_case(vocab_size)]
    if group == "none":
        return []
    raise ValueError(f"unknown case group {group!r} (known: {', '.join(CASE_GROUPS)})")


def sampling_fields(case: dict, max_tokens: int) -> dict:
    """SamplingParams fields of ``case``: greedy, 5 logprobs, ``max_tokens`` tokens
    whatever the model emits, no detokenizing; then the case's own ``sampling``."""
    fields = {"temperature": 0.0, "max_tokens": max_tokens, "logprobs": 5,
              "ignore_eos": True, "detokenize": False}
    return {**fields, **case.get("sampling", {})}


def sampling_params(case: dict, max_tokens: int):
    """vLLM 0.26.0's SamplingParams for ``case`` (structured outputs as
    ``StructuredOutputsParams``)."""
    from vllm import SamplingParams
    from vllm.sampling_params import StructuredOutputsParams

    fields = sampling_fields(case, max_tokens)
    if "structured_outputs" in fields:
        fields["structured_outputs"] = StructuredOutputsParams(**fields["structured_outputs"])
    return SamplingParams(**fields)


def completion_record(completion, prompt: list[int] | None = None,
                      prompt_logprobs=None) -> dict:
    """One choice as the worker records it: its tokens and each position's top
    logprobs; with ``prompt_logprobs``, the log-probability of each prompt token from
    the second on; the text when vLLM detokenized it."""
    out = {"token_ids": list(completion.token_ids),
           "logprobs": [{str(t): float(lp.logprob) for t, lp in pos.items()}
                        for pos in completion.logprobs]}
    if prompt_logprobs is not None:
        out["prompt_logprobs"] = [float(pos[tok].logprob)
                                  for tok, pos in zip(prompt[1:], prompt_logprobs[1:])]
    if completion.text:
        out["text"] = completion.text
    return out


def preemptions(llm) -> int:
    """Requests vLLM has preempted so far (its stats: ``disable_log_stats=False``)."""
    return sum(m.value for m in llm.get_metrics() if m.name == "vllm:num_preemptions")


def run_case(llm, case: dict, max_tokens: int) -> dict:
    """One generate call over the case's prompts; the choices of each prompt in
    order of their index."""
    params = sampling_params(case, max_tokens)
    start, before = time.perf_counter(), preemptions(llm)
    outs = llm.generate([{"prompt_token_ids": p} for p in case["prompts"]], params,
                        use_tqdm=False)
    records = [completion_record(choice, prompt, out.prompt_logprobs)
               for prompt, out in zip(case["prompts"], outs)
               for choice in sorted(out.outputs, key=lambda c: c.index)]
    result = {"case": case["case"], "kind": case["kind"],
              "prompt_lens": [len(p) for p in case["prompts"]], "choices": params.n,
              "outputs": records, "preemptions": preemptions(llm) - before,
              "seconds": round(time.perf_counter() - start, 3)}
    if "rule" in case:
        result["rule"] = case["rule"]
    return result


def run_feature_group(llm, group: str, max_prompt_len: int, vocab_size: int,
                      max_tokens: int, tokenizer=None) -> list[dict]:
    """Build and run the cases of ``group``. With a tokenizer the prompt ids stay
    inside its vocabulary and the JSON-schema case runs too."""
    if tokenizer is not None:
        vocab_size = min(vocab_size, len(tokenizer))
    results = []
    for case in build_feature_cases(group, max_prompt_len, vocab_size, tokenizer is not None):
        results.append(run_case(llm, case, max_tokens))
        print(f"case {case['case']}: {results[-1]['seconds']} s, "
              f"{results[-1]['preemptions']} preemptions", flush=True)
    return results


def add_feature_args(ap) -> None:
    """The worker's flags for the feature cases."""
    ap.add_argument("--cases", type=_case_groups, default="standard",
                    help="comma-separated groups, run in turn on the one engine: "
                         "standard (exactness_lib.build_cases) and the groups of "
                         "exactness_features cases")
    ap.add_argument("--kv-cache-dtype", default="", help="vLLM's kv_cache_dtype (fp8)")
    ap.add_argument("--tokenizer", default="",
                    help="tokenizer directory for a model without one (the JSON case)")
    ap.add_argument("--max-model-len", type=int, default=0,
                    help="vLLM's max_model_len (default: what the longest case needs)")


def _case_groups(value: str) -> str:
    """``--cases``: known groups, comma-separated."""
    unknown = [g for g in value.split(",") if g not in ("standard", *CASE_GROUPS)]
    if unknown:
        raise ValueError(f"unknown case groups {unknown}")
    return value


def engine_feature_args(args) -> dict:
    """LLM keyword arguments of the feature flags; the stats count preemptions."""
    out = {}
    if args.tokenizer:
        out["tokenizer"] = args.tokenizer
    if args.kv_cache_dtype:
        out["kv_cache_dtype"] = args.kv_cache_dtype
    if args.cases.split(",") != ["standard"]:
        out["disable_log_stats"] = False
    return out


def prompt_logprob_stats(outputs: list[dict], base_outputs: list[dict]) -> dict:
    """max and p99 of |difference| of the prompt tokens' log-probabilities, the
    positions above :data:`PROMPT_LOGPROB_LIMIT`, and whether every output has as
    many positions as its baseline."""
    diffs, match = [], bool(outputs) and len(outputs) == len(base_outputs)
    for a, b in zip(outputs, base_outputs):
        pa, pb = a.get("prompt_logprobs"), b.get("prompt_logprobs")
        if pa is None or pb is None or len(pa) != len(pb):
            match = False
            continue
        diffs += [abs(x - y) for x, y in zip(pa, pb)]
    d = np.array(diffs or [0.0])
    return {"max_abs_prompt_logprob_diff": round(float(d.max()), 6),
            "p99_abs_prompt_logprob_diff": round(float(np.percentile(d, 99)), 6),
            "prompt_positions": len(diffs),
            "prompt_positions_over_limit": int((d > PROMPT_LOGPROB_LIMIT).sum()),
            "prompt_positions_match": match}


def json_valid(text) -> bool:
    """Whether ``text`` is an object with exactly the keys :data:`JSON_SCHEMA` requires."""
    try:
        value = json.loads(text)
    except (TypeError, ValueError):
        return False
    return isinstance(value, dict) and set(value) == set(JSON_SCHEMA["required"])


def judge_feature_case(case: dict, result: dict, base: dict) -> dict:
    """``case`` (compared by vLLM's top-k rule) with its kind's rules on top:
    ``exact`` (n = 4) allows no divergence at all; prompt logprobs within
    :data:`PROMPT_LOGPROB_LIMIT` at every position; preemption must have happened;
    a JSON output that parses on one GPU must parse here too."""
    outs, base_outs = result["outputs"], base["outputs"]
    passed = case["passed"] and len(outs) == len(base_outs)
    case["kind"] = result["kind"]
    if result.get("rule") == "exact":
        case.update(rule="exact", choices=result.get("choices"))
        passed = passed and case["first_divergence"] is None
    if result["kind"] == "prompt_logprobs":
        stats = prompt_logprob_stats(outs, base_outs)
        case.update(stats)
        passed = (passed and stats["prompt_positions_match"]
                  and stats["prompt_positions_over_limit"] == 0)
    if result["kind"] == "preemption":
        case.update(preemptions=result.get("preemptions"),
                    baseline_preemptions=base.get("preemptions"))
        passed = passed and bool(result.get("preemptions"))
    if result["kind"] == "json_schema":
        valid = [json_valid(o.get("text")) for o in outs]
        base_valid = [json_valid(o.get("text")) for o in base_outs]
        case.update(json_valid=sum(valid), baseline_json_valid=sum(base_valid))
        passed = passed and all(v or not b for v, b in zip(valid, base_valid))
    case["passed"] = bool(passed)
    return case


_BULLET = re.compile(r"^(?:.*?\] )?\s+(- \S.*)$")
# pydantic's ValidationError of a VllmConfig puts the refusal on the lines under its own
_VALUE_ERROR = re.compile(r"^(?:.*?\] )?\s+Value error, (\S.*)$")
_START = re.compile(re.escape(ENGINE_START_MARK) + r" ([\d.]+)")


def error_blocks(log: str) -> list[str]:
    """Each distinct exception line of ``log`` with the ``  - `` lines right under it
    (a refusal that lists several settings), first seen first."""
    blocks, current = [], None
    for line in log.splitlines():
        found = error_lines(line, limit=1)
        under = _BULLET.match(line) or _VALUE_ERROR.match(line)
        if found:
            current = [found[0]]
            blocks.append(current)
        elif current is not None and under:
            current.append(under.group(1))
        else:
            current = None
    return list(dict.fromkeys("\n".join(b) for b in blocks))


def refusal_record(log: str, returncode: int, timed_out: bool, process_seconds: float,
                   ended_at: float, pattern: str) -> dict:
    """What a run that should stop at start-up did: ``refused`` when it exited with an
    error naming ``pattern`` (a regular expression) before any timeout;
    ``seconds_to_failure`` from the worker's :data:`ENGINE_START_MARK` to its exit
    (``ended_at``, the epoch time), ``process_seconds`` with the imports."""
    blocks = error_blocks(log)
    message = next((b for b in blocks if re.search(pattern, b, re.IGNORECASE)), None)
    start = _START.search(log)
    return {"refused": bool(returncode) and not timed_out and message is not None,
            "message": message or (blocks[0] if blocks else None),
            "errors": error_lines(log),
            "seconds_to_failure": round(ended_at - float(start.group(1)), 1) if start else None,
            "process_seconds": round(process_seconds, 1), "timed_out": timed_out,
            "returncode": returncode}


def rejudge_refusal(record: dict, log: str, pattern: str) -> dict:
    """:func:`refusal_record`'s verdict on a run judged before, from its log: a later
    revision's reading of the same log (the times and exit status are the run's)."""
    blocks = error_blocks(log)
    message = next((b for b in blocks if re.search(pattern, b, re.IGNORECASE)), None)
    refused = bool(record["returncode"]) and not record["timed_out"] and message is not None
    return {**record, "refused": refused, "message": message or record["message"]}


def refusal_case(model: str, label: str, record: dict,
                 limit_s: float = REFUSAL_LIMIT_S) -> dict:
    """A result case (the schema of exactness-pcp.json) for a run that should be
    refused: passed when it was, within ``limit_s`` of the engine's start."""
    seconds = record["seconds_to_failure"]
    passed = record["refused"] and seconds is not None and seconds <= limit_s
    return {"model": model, "config": label, "case": "refusal", "prompt_lens": [],
            "first_divergence": None, "max_abs_logprob_diff": None, "passed": bool(passed),
            "error": record["message"], "errors": record["errors"],
            "seconds_to_failure": seconds, "process_seconds": record["process_seconds"],
            "timed_out": record["timed_out"]}
