"""A quick check of layouts against one GPU: engines on a small model, greedy tokens with
their top-5 log-probabilities and seeded samples, judged by vLLM's top-5 rule.

The full checks are ``tests/engine`` (teacher-forced scores, feature cases, serving);
this one starts each engine once, with prompts of 5 to 9,000 tokens, and writes one JSON::

    python scripts/engine_smoke.py build DIR configs/models/qwen2-mqa-1kv.json  # random weights
    eval "$(python tests/engine/shared_gpu.py mps start)"; eval "$(python tests/engine/shared_gpu.py env)"
    python scripts/engine_smoke.py matrix DIR OUT.json pcp1 pcp2 pcp2-dcp2 ...  # pcp1 first
    python scripts/engine_smoke.py repeat OUT.json A.json.d B.json.d ...  # runs of one layout

``SMOKE_KNOBS`` and ``SMOKE_ENGINE_ARGS`` (JSON) add knobs and engine arguments to every
layout of a run.

A layout is judged against ``pcp1`` (``chunked-*`` against ``chunked-pcp1``, ``*-graphs``
against ``pcp1-graphs``, ``*-fp8`` against ``pcp1-fp8``). ``SMOKE_MAX_LEN`` (default
16384) caps the model length; prompts longer than it are left out.
"""
from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import time

SPLIT_ALL = {"pcp_min_split_tokens": 2}
LAYOUTS = {
    "pcp1": {}, "pcp1-graphs": {"eager": False}, "pcp1-fp8": {"kv": "fp8"},
    "chunked-pcp1": {"chunk": 2048},
    "pcp2": {"pcp": 2}, "pcp2-split2": {"pcp": 2, "knobs": SPLIT_ALL},
    "pcp2-paged": {"pcp": 2, "knobs": {**SPLIT_ALL, "pcp_split_attention": "paged"}},
    "pcp2-shard": {"pcp": 2, "knobs": {**SPLIT_ALL, "pcp_decode_policy": "shard"}},
    "pcp2-graphs": {"pcp": 2, "eager": False, "knobs": SPLIT_ALL},
    "pcp2-fp8": {"pcp": 2, "kv": "fp8", "knobs": SPLIT_ALL},
    "chunked-pcp2": {"pcp": 2, "chunk": 2048, "knobs": SPLIT_ALL},
    "pcp4": {"pcp": 4, "knobs": SPLIT_ALL}, "pcp8": {"pcp": 8, "knobs": SPLIT_ALL},
    "tp2-pcp2": {"tp": 2, "pcp": 2, "knobs": SPLIT_ALL},
    "pcp2-dcp2": {"pcp": 2, "dcp": 2, "knobs": SPLIT_ALL},
    "pcp2-dcp2-i8": {"pcp": 2, "dcp": 2, "interleave": 8, "knobs": SPLIT_ALL},
    "chunked-pcp2-dcp2": {"pcp": 2, "dcp": 2, "chunk": 2048, "knobs": SPLIT_ALL},
    "pcp4-dcp4": {"pcp": 4, "dcp": 4, "knobs": SPLIT_ALL},
    "tp2-dcp2": {"tp": 2, "dcp": 2},  # vLLM's own DCP inside TP
}
PROMPT_LENS = (5, 37, 300, 3001, 9000)


def build(model_dir: str, config_json: str) -> None:
    """A model of ``config_json``'s shape with random bf16 weights (seed 0)."""
    import torch
    import transformers

    torch.manual_seed(0)
    config = transformers.AutoConfig.for_model(**json.load(open(config_json)))
    transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).save_pretrained(
        model_dir)


def _engine_args(model_dir: str, layout: dict, max_len: int) -> dict:
    chunk = layout.get("chunk")
    args = dict(model=model_dir, skip_tokenizer_init=True, dtype="bfloat16", seed=0,
                max_model_len=max_len, max_num_batched_tokens=chunk or max_len,
                enforce_eager=layout.get("eager", True), attention_backend="FLASHINFER",
                kv_cache_memory_bytes=2 << 30, gpu_memory_utilization=0.1,
                tensor_parallel_size=layout.get("tp", 1),
                prefill_context_parallel_size=layout.get("pcp", 1),
                decode_context_parallel_size=layout.get("dcp", 1),
                kv_cache_dtype=layout.get("kv", "auto"),
                additional_config={**layout.get("knobs", {}),
                                   **json.loads(os.environ.get("SMOKE_KNOBS", "{}"))})
    if chunk:
        args["enable_chunked_prefill"] = True
    # extra engine arguments, e.g. '{"kernel_config": {"enable_flashinfer_autotune": false}}'
    args.update(json.loads(os.environ.get("SMOKE_ENGINE_ARGS", "{}")))
    if layout.get("interleave"):
        args["cp_kv_cache_interleave_size"] = layout["interleave"]
    return args


def run(model_dir: str, name: str, out: str) -> None:
    """One engine of layout ``name``: greedy (24 tokens, top-5) and seeded samples."""
    # vLLM's engine core in this process: a generate call's requests all reach the scheduler
    # before its first step, so two runs of a layout take the same steps (a core process of
    # its own starts stepping on the first request that arrives)
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    from vllm import LLM, SamplingParams

    max_len = int(os.environ.get("SMOKE_MAX_LEN", 16384))
    start = time.time()
    llm = LLM(**_engine_args(model_dir, LAYOUTS[name], max_len))
    rng = random.Random(1)
    prompts = [{"prompt_token_ids": [rng.randrange(3, 30000) for _ in range(n)]}
               for n in PROMPT_LENS if n < max_len - 32]
    greedy = SamplingParams(temperature=0, max_tokens=24, logprobs=5, ignore_eos=True,
                            detokenize=False)
    sampled = SamplingParams(temperature=0.8, n=4, max_tokens=16, seed=123, ignore_eos=True,
                             detokenize=False)
    result = {"layout": name, "start_s": round(time.time() - start, 1), "greedy": [
        {"tokens": list(c.token_ids),
         "top": [{str(t): p.logprob for t, p in pos.items()} for pos in c.logprobs]}
        for c in (o.outputs[0] for o in llm.generate(prompts, greedy, use_tqdm=False))]}
    result["sampled"] = [[list(c.token_ids) for c in o.outputs]
                         for o in llm.generate(prompts[2:4], sampled, use_tqdm=False)]
    if LAYOUTS[name].get("pcp", 1) > 1:
        result["step_counts"] = llm.collective_rpc("pcp_step_counts")
    json.dump(result, open(out, "w"))


def first_difference(a: list, b: list) -> int | None:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)


def judge(base: dict, other: dict) -> dict:
    """Per greedy prompt: equal, or the first differing token and whether each side's
    token is among the other's top 5 (vLLM's rule); seeded samples equal or not."""
    prompts = []
    for a, b in zip(base["greedy"], other["greedy"]):
        ta, tb = a["tokens"], b["tokens"]
        first = first_difference(ta, tb)
        prompts.append({"equal": first is None} if first is None else {
            "equal": False, "first_difference": first,
            "top5": str(ta[first]) in b["top"][first] and str(tb[first]) in a["top"][first]})
    return {"prompt_lens": list(PROMPT_LENS[:len(prompts)]), "greedy": prompts,
            "greedy_pass": all(p["equal"] or p["top5"] for p in prompts),
            "samples_equal": base["sampled"] == other["sampled"],
            "step_counts": other.get("step_counts")}


def schedule(raw: dict) -> dict | None:
    """A PCP run's steps and split steps (rank 0's counts): two runs that took different
    steps computed different batches; None for one GPU (no counts)."""
    counts = (raw.get("step_counts") or [None])[0]
    return counts and {k: counts[k] for k in ("steps", "split_steps")}


def repeat(out: str, *runs: str) -> None:
    """Two or more matrix folders of the same layouts, each run against the first: per
    layout and greedy prompt, the first token and the first position whose top-5
    log-probabilities differ (None: equal), whether the seeded samples are equal, and each
    run's :func:`schedule`."""
    first, layouts = runs[0], {}
    for name in sorted(f[:-5] for f in os.listdir(first) if f.endswith(".json")):
        base = json.load(open(os.path.join(first, name + ".json")))
        for run in runs[1:]:
            path = os.path.join(run, name + ".json")
            if not os.path.exists(path):
                continue
            other = json.load(open(path))
            layouts.setdefault(name, []).append({"runs": [first, run], "greedy": [
                {"first_token": first_difference(a["tokens"], b["tokens"]),
                 "first_top5_logprobs": first_difference(a["top"], b["top"])}
                for a, b in zip(base["greedy"], other["greedy"])],
                "samples_equal": base["sampled"] == other["sampled"],
                "step_counts": [schedule(base), schedule(other)]})
    json.dump({"prompt_lens": list(PROMPT_LENS), "layouts": layouts}, open(out, "w"), indent=1)


def baseline(name: str) -> str:
    for prefix, suffix in (("chunked-", ""), ("", "-graphs"), ("", "-fp8")):
        if name.startswith(prefix) and name.endswith(suffix) and (prefix or suffix):
            return f"{prefix}pcp1{suffix}"
    return "pcp1"


def matrix(model_dir: str, out: str, *names: str, parallel: int = 4) -> None:
    """Run ``names`` (``parallel`` engines at a time) and judge each against its baseline."""
    work = out + ".d"
    os.makedirs(work, exist_ok=True)
    pending, running, codes = list(names), {}, {}
    while pending or running:
        while pending and len(running) < parallel:
            name = pending.pop(0)
            log = open(os.path.join(work, name + ".log"), "w")
            running[name] = subprocess.Popen(
                [sys.executable, __file__, "run", model_dir, name,
                 os.path.join(work, name + ".json")], stdout=log, stderr=subprocess.STDOUT)
        for name, proc in list(running.items()):
            if proc.poll() is not None:
                codes[name] = running.pop(name).returncode
        time.sleep(2)
    raw = {n: json.load(open(os.path.join(work, n + ".json"))) for n in names if codes[n] == 0}
    json.dump({"exit_codes": codes, "layouts": {
        n: judge(raw[baseline(n)], raw[n]) for n in raw if n != baseline(n) and baseline(n) in raw}},
        open(out, "w"), indent=1)


if __name__ == "__main__":
    {"build": build, "run": run, "matrix": matrix, "repeat": repeat}[sys.argv[1]](*sys.argv[2:])
