"""One engine: a layout's ``vllm.LLM`` runs its case groups, then scores a teacher's greedy
outputs after the prompts; writes raw JSON. engines.py runs it:

    python tests/engine/worker.py --model DIR --layout pcp2 --variant chunked \
        --groups standard,features --max-tokens 32 [--teacher RAW.json|self] --out F.json"""
import argparse
import hashlib
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import cases as C  # noqa: E402
import layouts  # noqa: E402
from judge import ENGINE_START_MARK  # noqa: E402

VARIANTS = {"unchunked": None, "chunked": 2048}  # max_num_batched_tokens (None: model length)
KV_CACHE_BYTES = 2 << 30  # a fixed pool (and a low gpu_memory_utilization): engines share GPUs
ARRIVAL_DECODE_TOKENS = 64  # a scored "arrival" case's short request decodes meanwhile


def record(completion, prompt=None, prompt_logprobs=None, text: bool = False) -> dict:
    """One choice: tokens, top logprobs, each prompt token's logprob (from the second on)."""
    out = {"token_ids": list(completion.token_ids),
           "logprobs": [{str(t): float(lp.logprob) for t, lp in pos.items()}
                        for pos in completion.logprobs]}
    if prompt_logprobs is not None:
        out["prompt_logprobs"] = [float(pos[tok].logprob)
                                  for tok, pos in zip(prompt[1:], prompt_logprobs[1:])]
    if text and completion.text:
        out["text"] = completion.text
    return out


def send(llm, kind: str, prompts: list[list[int]], params: list) -> list:
    """RequestOutputs of a case's prompts (a SamplingParams each) sent as its kind says."""
    inputs = [{"prompt_token_ids": p} for p in prompts]
    if kind == "batch":
        return llm.generate(inputs, params, use_tqdm=False)
    if kind == "prefix":
        return [llm.generate([i], [sp], use_tqdm=False)[0] for i, sp in zip(inputs, params)]
    engine, done = llm.llm_engine, {}
    engine.add_request("short", inputs[0], params[0])
    for _ in range(4):
        done.update({o.request_id: o for o in engine.step() if o.finished})
    engine.add_request("long", inputs[1], params[1])
    while engine.has_unfinished_requests():
        done.update({o.request_id: o for o in engine.step() if o.finished})
    return [done["short"], done["long"]]


def _timed(case: dict, start: float, **result) -> dict:  # the case's result, timed
    result = {"case": case["case"], **result, "seconds": round(time.perf_counter() - start, 3)}
    print(f"case {case['case']}: {result['seconds']} s", flush=True)
    return result


def run_case(llm, case: dict, params) -> dict:
    """An exactness case (``params`` for each prompt)."""
    start = time.perf_counter()
    outs = send(llm, case["kind"], case["prompts"], [params] * len(case["prompts"]))
    return _timed(case, start, prompt_lens=[len(p) for p in case["prompts"]],
                  outputs=[record(o.outputs[0]) for o in outs])


def feature_params(case: dict, max_tokens: int) -> list:
    """A SamplingParams per prompt: greedy, 5 logprobs, ``max_tokens`` (the case's own if it
    has one) whatever the model emits, then the case's ``sampling`` (a list: one per prompt)."""
    from vllm import SamplingParams
    from vllm.sampling_params import StructuredOutputsParams

    sampling = case.get("sampling", {})
    params = []
    for own in sampling if isinstance(sampling, list) else [sampling] * len(case["prompts"]):
        fields = {"temperature": 0.0, "max_tokens": case.get("max_tokens", max_tokens),
                  "logprobs": 5, "ignore_eos": True, "detokenize": False, **own}
        if "structured_outputs" in fields:
            fields["structured_outputs"] = StructuredOutputsParams(**fields["structured_outputs"])
        params.append(SamplingParams(**fields))
    return params


def run_feature_case(llm, case: dict, max_tokens: int) -> dict:
    """One generate call of the case's prompts (:func:`feature_params`); the choices by
    index."""
    def preemptions() -> int:
        return sum(m.value for m in llm.get_metrics() if m.name == "vllm:num_preemptions")

    params = feature_params(case, max_tokens)
    start, before = time.perf_counter(), preemptions()
    outs = send(llm, "batch", case["prompts"], params)
    return _timed(case, start, kind=case["kind"], prompt_lens=[len(p) for p in case["prompts"]],
                  choices=params[0].n,
                  outputs=[record(choice, prompt, out.prompt_logprobs, text=True)
                           for prompt, out in zip(case["prompts"], outs)
                           for choice in sorted(out.outputs, key=lambda c: c.index)],
                  preemptions=preemptions() - before,
                  **({"rule": case["rule"]} if "rule" in case else {}))


def given_token_logprobs(prompt_logprobs, token_ids: list[int], start: int,
                         cached: int = 0) -> list[float]:
    """The logprob of each of ``token_ids[start:]`` in ``prompt_logprobs`` (entry 0 empty; on
    Model Runner V2 a prefix hit's ``cached`` tokens have none: entry 0 is token ``cached``'s)."""
    offset = len(token_ids) - len(prompt_logprobs)
    if offset not in (0, cached) or (offset and start <= offset):
        raise ValueError(f"{len(prompt_logprobs)} prompt logprobs for {len(token_ids)} tokens "
                         f"({cached} cached, scored from {start})")
    return [float(prompt_logprobs[i - offset][token_ids[i]].logprob)
            for i in range(start, len(token_ids))]


def score_cases(llm, cases: list[dict], teacher: str, out: dict) -> list[dict]:
    """Each continuation token's logprob after the prompts it follows (the teacher's greedy
    outputs, ``self``: this run's) on an emptied prefix cache. A "prefix" case's second prompt
    reads the first's cached blocks (else skipped under prompt_logprobs)."""
    from vllm import SamplingParams
    score = {"temperature": 0.0, "max_tokens": 1, "prompt_logprobs": 0, "detokenize": False}
    special = {("prefix", 1): {"skip_reading_prefix_cache": False},
               ("arrival", 0): {"max_tokens": ARRIVAL_DECODE_TOKENS, "ignore_eos": True}}
    source = out if teacher == "self" else json.loads(Path(teacher).read_text())
    if source.get("returncode") or "results" not in source:
        raise ValueError(f"{teacher}: no successful run to take continuations from")
    if not llm.reset_prefix_cache():
        raise RuntimeError("the prefix cache could not be reset before scoring")
    continuations = {r["case"]: [o["token_ids"] for o in r["outputs"]] for r in source["results"]}
    results = []
    for case in (c for c in cases if c["case"] in continuations):
        tokens, lens = continuations[case["case"]], [len(p) for p in case["prompts"]]
        full = [list(p) + list(c) for p, c in zip(case["prompts"], tokens)]
        params = [SamplingParams(**{**score, **special.get((case["kind"], i), {})})
                  for i in range(len(full))]
        start = time.perf_counter()
        outs = send(llm, case["kind"], full, params)
        cached = [o.num_cached_tokens or 0 for o in outs]
        if any(c > n for c, n in zip(cached, lens)):
            raise RuntimeError(f"case {case['case']}: cache hits {cached} reach past the prompts")
        results.append(_timed(
            case, start, prompt_lens=lens, cached_tokens=cached,
            scores=[given_token_logprobs(o.prompt_logprobs, f, n, c)
                    for o, f, n, c in zip(outs, full, lens, cached)],
            continuation_digests=[hashlib.sha1(",".join(map(str, t)).encode()).hexdigest()[:16]
                                  for t in tokens]))
    return results


def _per_rank(llm, method: str, *args) -> list | None:
    """Each rank's answer to the PCP worker's ``method``; None where the engine runs vLLM's
    own worker (PCP 1), which has none. Asked anyway, each rank would reply with a failure:
    the executor raises at the first and leaves the others' unread, for later calls to
    take as their answers."""
    if llm.llm_engine.vllm_config.parallel_config.prefill_context_parallel_size == 1:
        return None
    try:
        return llm.collective_rpc(method, args=args)
    except Exception as exc:  # the cases stay recorded
        print(f"{method} on every rank failed: {exc!r}", file=sys.stderr, flush=True)
        return None


def run_groups(llm, args, groups: list[str], max_prompt_len: int, vocab_size: int, tokenizer):
    """The groups, then the scoring; each rank's ``memory`` at the start and after each phase."""
    out, phases = {}, {}
    at_start = _per_rank(llm, "pcp_memory", True)
    cases = C.build_cases(max_prompt_len, vocab_size)
    if "standard" in groups:
        from vllm import SamplingParams
        greedy = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, logprobs=5,
                                ignore_eos=True)
        out["results"] = [run_case(llm, case, greedy) for case in cases]
        phases["standard"] = _per_rank(llm, "pcp_memory", True)
    if features := [g for g in groups if g != "standard"]:
        vocab = min(vocab_size, len(tokenizer)) if tokenizer is not None else vocab_size
        out["feature_results"] = [
            run_feature_case(llm, case, args.max_tokens) for group in features
            for case in C.feature_cases(group, max_prompt_len, vocab, tokenizer is not None)]
        phases["features"] = _per_rank(llm, "pcp_memory", True)
    if args.teacher:
        try:
            out["scores"] = score_cases(llm, cases, args.teacher, out)
        except (RuntimeError, ValueError) as exc:  # the cases above stay recorded
            out["scores_error"] = repr(exc)
        phases["scoring"] = _per_rank(llm, "pcp_memory", True)
    out["memory"] = at_start and {"at_start": at_start, "phases": phases}
    return out


def engine_kwargs(layout: str, hf: dict, variant: str, max_tokens: int,
                  groups: list[str], tokenizer: bool) -> dict:
    """``vllm.LLM`` arguments: the layout's, every prefill split at PCP > 1, the fixed ones."""
    lay = layouts.LAYOUTS[layout]
    model_len = lay.max_model_len or min(hf["max_position_embeddings"], 32768 + 2 * max_tokens)
    kwargs = layouts.engine_kwargs(layout)
    if knobs := {"pcp_min_split_tokens": 2, **lay.knobs} if lay.pcp > 1 else dict(lay.knobs):
        kwargs["additional_config"] = knobs
    if groups != ["standard"]:
        kwargs["disable_log_stats"] = False  # the preemption count
    head_dim = hf.get("head_dim") or hf["hidden_size"] // hf["num_attention_heads"]
    token_bytes = hf["num_hidden_layers"] * 2 * hf["num_key_value_heads"] * head_dim * 2  # bf16
    pool = ({"gpu_memory_utilization": lay.gpu_memory_utilization} if lay.gpu_memory_utilization
            else {"gpu_memory_utilization": 0.05,
                  "kv_cache_memory_bytes": lay.pool_tokens * token_bytes or KV_CACHE_BYTES})
    return {"skip_tokenizer_init": not tokenizer, "dtype": "bfloat16", "max_model_len": model_len,
            "max_num_batched_tokens": VARIANTS[variant] or model_len, "max_num_seqs": 16,
            "seed": 0, "enable_prefix_caching": True, **pool,
            "enable_flashinfer_autotune": False, **kwargs}


def engine_facts(llm, layout: str) -> dict:
    """What the engine ran on: its KV capacity, the GPUs its ranks shared (set by the
    shared-GPU plugin), vLLM's version and runner, each PCP rank's step counts and
    sampled-token checks."""
    import vllm

    config = llm.llm_engine.vllm_config
    cache = config.cache_config
    return {"kv_capacity_tokens": cache.num_gpu_blocks * cache.block_size
            * layouts.LAYOUTS[layout].dcp,
            "shared_gpus": os.environ.get("VLLM_PCP_TEST_SHARED_GPUS_ENGAGED"),
            "vllm_version": vllm.__version__,
            "model_runner_v2": bool(config.use_v2_model_runner),
            "step_counts": _per_rank(llm, "pcp_step_counts"),
            "sampled_token_checks": _per_rank(llm, "pcp_sampled_token_checks")}


def shut_down(llm) -> None:
    """On Ray, the engine's executor and ranks, stopped while Ray still runs. Left to the
    exit, Ray's own shutdown (registered when ``ray`` is first imported, after the
    finalizers vLLM's imports make) runs first; the executor's finalizer then calls
    ``ray.kill``, which starts Ray again against the head that is gone (``RAY_ADDRESS``)
    and waits for it forever. Other executors stop at the exit, through that finalizer."""
    if llm.llm_engine.vllm_config.parallel_config.distributed_executor_backend == "ray":
        llm.llm_engine.engine_core.shutdown()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    for flag in ("--model", "--layout", "--variant", "--out"):
        ap.add_argument(flag, required=True)
    ap.add_argument("--groups", default="standard")
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--teacher", default="")
    args = ap.parse_args()
    # read by vLLM at start: the layout's variables and no runner choice (Model Runner V2)
    os.environ.pop(layouts.RUNNER_VAR, None)
    os.environ.update(layouts.LAYOUTS[args.layout].env)
    # vLLM's engine core in this process: a generate call's requests all reach the scheduler
    # before its first step, an arrival case's after exactly 4 steps, so every case's steps
    # are the same from run to run (a core process of its own takes them as they come)
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    groups = [g for g in args.groups.split(",") if g and g != "none"]
    hf = json.loads(Path(args.model, "config.json").read_text())
    tokenizer = os.path.exists(os.path.join(args.model, "tokenizer.json"))
    kwargs = engine_kwargs(args.layout, hf, args.variant, args.max_tokens, groups, tokenizer)
    from vllm import LLM
    print(ENGINE_START_MARK, time.time(), flush=True)
    llm = LLM(model=args.model, **kwargs)
    out = run_groups(llm, args, groups, kwargs["max_model_len"] - args.max_tokens - 8,
                     hf["vocab_size"], llm.get_tokenizer() if tokenizer else None)
    Path(args.out + ".part").write_text(json.dumps({**engine_facts(llm, args.layout), **out}))
    os.replace(args.out + ".part", args.out)  # whole: the harness waits a while for the exit
    shut_down(llm)


if __name__ == "__main__":
    main()
