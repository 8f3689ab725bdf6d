"""The engine checks' cases as data (pure). Kinds: "batch" and the features': one generate
call; "prefix": a call per prompt; "arrival": a long prompt arrives while a short one decodes."""
import math

import numpy as np

from layouts import PREEMPT_POOL_TOKENS

# 4099 = 2 x 2048 + 3: chunked prefill leaves a 3-token chunk, fewer tokens than 4 or 8 ranks
SINGLE_LENGTHS = (1, 7, 100, 1000, 4097, 4099, 16384, 32768)
MIXED_LENGTHS = (3, 150, 2500, 12000)
SAMPLED = {"n": 4, "temperature": 0.8, "top_p": 0.95, "seed": 1234}
BURST_SUFFIXES = (1, 2, 17, 64, 129, 500, 1001, 2048)
SPLIT_LENGTHS = (5, 6, 4096, 4097, 12000, 12001)
JSON_SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 12},
    "count": {"type": "integer", "minimum": 0, "maximum": 999},
    "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3}},
    "required": ["name", "count", "tags"], "additionalProperties": False}
# preemption: prompts that fill the pool but for the slack, outputs that overflow it
PREEMPT_REQUESTS, PREEMPT_MAX_TOKENS, PREEMPT_SLACK_TOKENS = 6, 128, 400
BLOCK_TOKENS = 16  # vLLM's block; a DCP scheduler block spans BLOCK_TOKENS x DCP tokens
# "agreement": a greedy and a seeded request decoding side by side for this many steps
AGREEMENT_DECODE_TOKENS = 256
AGREEMENT_SEEDED = {"temperature": 0.8, "top_p": 0.95, "seed": 4321}
# "budget": each case and its prompts, together the longest prompt the engine takes
BUDGET_PROMPTS = {"budget_longest": 1, "budget_full_step": 4}


def random_prompt(length: int, vocab_size: int, seed: int) -> list[int]:
    return np.random.default_rng(seed).integers(100, vocab_size - 100, size=length).tolist()


def _prompts(lengths, vocab_size: int, max_prompt_len: int, seed: int) -> list[list[int]]:
    return [random_prompt(min(n, max_prompt_len), vocab_size, seed + i)
            for i, n in enumerate(lengths)]


def build_cases(max_prompt_len: int, vocab_size: int) -> list[dict]:
    """Single prompts, a mixed batch, a prefix hit, a decode during a long prefill."""
    cases = [{"case": f"len_{n}", "kind": "batch", "prompts": [random_prompt(n, vocab_size, n)]}
             for n in SINGLE_LENGTHS if n <= max_prompt_len]
    cases.append({"case": "mixed_batch", "kind": "batch",
                  "prompts": _prompts(MIXED_LENGTHS, vocab_size, max_prompt_len, 7)})
    prefix_len = min(6000, max_prompt_len // 2)
    base = random_prompt(prefix_len, vocab_size, 99)
    cases.append({"case": "prefix_hit", "kind": "prefix", "prompts": [
        base, base[: prefix_len * 5 // 6] + random_prompt(prefix_len // 4, vocab_size, 98)]})
    cases.append({"case": "decode_during_prefill", "kind": "arrival", "prompts": [
        random_prompt(50, vocab_size, 5),
        random_prompt(min(20000, max_prompt_len), vocab_size, 6)]})
    return cases


def preemption_case(vocab_size: int, capacity: int = PREEMPT_POOL_TOKENS) -> dict:
    """Prompts that all fit the pool (in DCP = 2 blocks, plus vLLM's null block) while
    prompts and outputs do not (in one-rank blocks): vLLM admits all, then preempts."""
    per = (capacity - PREEMPT_SLACK_TOKENS) // PREEMPT_REQUESTS
    lengths = [per + (-1) ** i * 17 * i for i in range(PREEMPT_REQUESTS)]
    blocks = sum(math.ceil(n / (2 * BLOCK_TOKENS)) for n in lengths) + 1
    outputs = sum(math.ceil((n + PREEMPT_MAX_TOKENS) / BLOCK_TOKENS) for n in lengths)
    if not (blocks * 2 * BLOCK_TOKENS <= capacity < outputs * BLOCK_TOKENS):
        raise ValueError(f"preemption prompts {lengths} do not preempt in {capacity} tokens")
    return {"case": "preemption", "kind": "preemption",
            "prompts": [random_prompt(n, vocab_size, 800 + i) for i, n in enumerate(lengths)],
            "sampling": {"max_tokens": PREEMPT_MAX_TOKENS}}


def feature_cases(group: str, max_prompt_len: int, vocab_size: int,
                  with_json: bool = False) -> list[dict]:
    """The cases of a group. "same-step": seeded ``n = 4`` sampling (compared exactly), and
    greedy requests sharing a long prefix sent together (later ones hit blocks the first
    writes in the same step). "features": those, each odd and even length alone then in
    one batch, prompt_logprobs, penalties, a JSON schema (with a tokenizer). "preemption".
    "agreement": a greedy and a seeded request in one batch, each its own sampling, decoding
    AGREEMENT_DECODE_TOKENS steps (the steps whose sampled tokens every PCP rank compares).
    "budget": the longest prompt the engine takes, then four of a quarter of it at once."""
    def case(name, kind, lengths, seed, **fields):
        return {"case": name, "kind": kind,
                "prompts": _prompts(lengths, vocab_size, max_prompt_len, seed), **fields}

    if group == "preemption":
        return [preemption_case(vocab_size)]
    if group == "budget":  # the longest prompt alone, then a step full of four
        return [case(name, "budget", (max_prompt_len // n,) * n, 950 + 10 * i)
                for i, (name, n) in enumerate(BUDGET_PROMPTS.items())]
    if group == "agreement":
        return [{"case": "agreement", "kind": "agreement",
                 "prompts": _prompts((3000, 3001), vocab_size, max_prompt_len, 900),
                 "sampling": [{}, dict(AGREEMENT_SEEDED)],
                 "max_tokens": AGREEMENT_DECODE_TOKENS}]

    prefix_len = min(6001, max_prompt_len // 2)
    prefix, room = random_prompt(prefix_len, vocab_size, 300), max_prompt_len - prefix_len
    cases = [{"case": "sampled_n4", "kind": "sampled", "rule": "exact", "prompts": _prompts(
                 (9001, 16384), vocab_size, max_prompt_len, 200), "sampling": dict(SAMPLED)},
             {"case": "burst", "kind": "burst", "prefix_len": prefix_len,
              "prompts": [prefix + random_prompt(min(s, room), vocab_size, 310 + i)
                          for i, s in enumerate(BURST_SUFFIXES)]}]
    if group != "features":
        return cases
    lengths = [n for n in SPLIT_LENGTHS if n <= max_prompt_len]
    cases += [{"case": f"split_{n}", "kind": "split",
               "prompts": [random_prompt(n, vocab_size, 400 + n)]} for n in lengths]
    cases += [case("split_odd_even_batch", "split", lengths, 450),
              case("prompt_logprobs", "prompt_logprobs", (1000, 4097), 500,
                   sampling={"prompt_logprobs": 5}),
              case("repetition_penalty", "penalty", (777, 3000), 600,
                   sampling={"repetition_penalty": 1.3}),
              case("presence_frequency_penalty", "penalty", (777, 3000), 650,
                   sampling={"presence_penalty": 0.5, "frequency_penalty": 0.5})]
    if with_json:
        cases.append(case("json_schema", "json_schema", (501, 2000), 700, sampling={
            "structured_outputs": {"json": JSON_SCHEMA}, "ignore_eos": False,
            "detokenize": True, "max_tokens": 96}))
    return cases
