"""Run the exactness cases on one engine configuration and write raw outputs.

Usage (one process per engine; the orchestrator is check_exactness.py):
    python scripts/exactness_worker.py --model DIR --pcp 2 --variant chunked --out F.json
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from exactness_lib import (MAX_TOKENS, build_cases, continuation_digest,  # noqa: E402
                           continuations_of, render_gsm8k, teacher_continuations,
                           teacher_prompts, text_prompt)
from exactness_features import (ENGINE_START_MARK, add_feature_args,  # noqa: E402
                                engine_feature_args, run_feature_group)
from kv_capacity import kv_bytes_per_token, pool_tokens  # noqa: E402
from layouts import NO_ALLREDUCE_FUSION  # noqa: E402

# set in the engine's processes when its ranks share GPUs (tests/engine/shared_gpu.py)
SHARED_GPUS_ENGAGED = "VLLM_PCP_TEST_SHARED_GPUS_ENGAGED"

from vllm_pcp.config import CONTEXT_EXCHANGES  # noqa: E402

VARIANTS = {"unchunked": None, "chunked": 2048}
TEACHER_KINDS = ("batch", "prefix", "arrival")
ARRIVAL_DECODE_TOKENS = 64  # the short request decodes through the long prompt's prefill


def _record(completion) -> dict:
    return {"token_ids": list(completion.token_ids),
            "logprobs": [{str(t): float(lp.logprob) for t, lp in pos.items()}
                         for pos in completion.logprobs]}


def _arrival_outputs(llm, prompts, params_per_prompt) -> list:
    """The RequestOutputs of a long prompt that arrives while a short request is
    decoding (``prompts``: short, long; one SamplingParams each)."""
    engine = llm.llm_engine
    engine.add_request("short", {"prompt_token_ids": prompts[0]}, params_per_prompt[0])
    done = {}
    for _ in range(4):
        done.update({o.request_id: o for o in engine.step() if o.finished})
    engine.add_request("long", {"prompt_token_ids": prompts[1]}, params_per_prompt[1])
    while engine.has_unfinished_requests():
        done.update({o.request_id: o for o in engine.step() if o.finished})
    return [done[name] for name in ("short", "long")]


def _run_arrival(llm, prompts, params) -> list[dict]:
    """A long prompt arrives while a short request is decoding."""
    return [_record(o.outputs[0]) for o in _arrival_outputs(llm, prompts, [params, params])]


def run_cases(llm, cases, max_tokens: int = MAX_TOKENS) -> list[dict]:
    from vllm import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, logprobs=5,
                            ignore_eos=True)
    results = []
    for case in cases:
        start = time.perf_counter()
        prompts = [{"prompt_token_ids": p} for p in case["prompts"]]
        if case["kind"] == "batch":
            outs = [_record(o.outputs[0]) for o in llm.generate(prompts, params, use_tqdm=False)]
        elif case["kind"] == "prefix":
            outs = [_record(llm.generate([p], params, use_tqdm=False)[0].outputs[0])
                    for p in prompts]
        else:
            outs = _run_arrival(llm, case["prompts"], params)
        results.append({"case": case["case"], "prompt_lens": [len(p) for p in case["prompts"]],
                        "outputs": outs, "seconds": round(time.perf_counter() - start, 3)})
        print(f"case {case['case']}: {results[-1]['seconds']} s", flush=True)
    return results


def given_token_logprobs(prompt_logprobs, token_ids: list[int], start: int,
                         cached: int = 0) -> list[float]:
    """The logprob of each of ``token_ids[start:]`` at its position, from a RequestOutput's
    ``prompt_logprobs`` (vLLM 0.26.0: entry 0 is empty, entry i maps its token to its
    Logprob, with ``prompt_logprobs=0`` that token alone; a list of dicts or a
    FlatLogprobs). The V1 runner gives an entry per prompt token; Model Runner V2 none for
    the ``cached`` tokens of a prefix-cache hit: its entry 0 is then token ``cached``'s."""
    offset = len(token_ids) - len(prompt_logprobs)
    if offset not in (0, cached) or (offset and start <= offset):
        raise ValueError(f"{len(prompt_logprobs)} prompt logprobs for {len(token_ids)} tokens "
                         f"({cached} cached, scored from {start})")
    return [float(prompt_logprobs[i - offset][token_ids[i]].logprob)
            for i in range(start, len(token_ids))]


def _score_params(kind: str, prompts: int) -> list:
    """SamplingParams per prompt of a scoring case: one greedy token and the logprob of
    each given prompt token. The second prompt of a "prefix" case reads the first's cached
    blocks (vLLM skips the cache under prompt_logprobs unless told not to; the positions
    it leaves unscored lie inside the shared prefix, before any scored one); the short
    request of an "arrival" case decodes while the long prompt's prefill runs."""
    from vllm import SamplingParams

    score = {"temperature": 0.0, "max_tokens": 1, "prompt_logprobs": 0, "detokenize": False}
    params = [SamplingParams(**score) for _ in range(prompts)]
    if kind == "prefix":
        params[1] = SamplingParams(**score, skip_reading_prefix_cache=False)
    elif kind == "arrival":
        params[0] = SamplingParams(**{**score, "max_tokens": ARRIVAL_DECODE_TOKENS},
                                   ignore_eos=True)
    return params


def _teacher_outputs(llm, kind: str, prompts: list[list[int]], params: list) -> list:
    """The RequestOutputs of one scoring case, sent as :func:`run_cases` sends its kind."""
    if kind == "batch":
        return llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    if kind == "prefix":
        return [llm.generate([{"prompt_token_ids": p}], [sp], use_tqdm=False)[0]
                for p, sp in zip(prompts, params)]
    return _arrival_outputs(llm, prompts, params)


def score_cases(llm, cases, continuations: dict[str, dict]) -> list[dict]:
    """Each case's prompts with their continuations (:func:`exactness_lib.teacher_continuations`)
    scored: per prompt the logprob of each continuation token. Cases without a continuation,
    or of a kind other than :data:`TEACHER_KINDS`, are left out."""
    results = []
    for case in cases:
        source = continuations.get(case["case"])
        if source is None or case["kind"] not in TEACHER_KINDS:
            print(f"case {case['case']}: not scored (no continuation or kind {case['kind']})")
            continue
        prompt_lens = [len(p) for p in case["prompts"]]
        if source["prompt_lens"] != prompt_lens:
            raise ValueError(f"case {case['case']}: prompts of {prompt_lens} tokens, the "
                             f"continuations' of {source['prompt_lens']} (same --max-tokens?)")
        full = teacher_prompts(case["prompts"], source["token_ids"])
        start = time.perf_counter()
        outs = _teacher_outputs(llm, case["kind"], full, _score_params(case["kind"], len(full)))
        cached = [o.num_cached_tokens or 0 for o in outs]
        if any(c > n for c, n in zip(cached, prompt_lens)):
            raise RuntimeError(f"case {case['case']}: cache hits {cached} reach past the prompts")
        results.append({"case": case["case"], "prompt_lens": prompt_lens,
                        "scores": [given_token_logprobs(o.prompt_logprobs, f, n, c)
                                   for o, f, n, c in zip(outs, full, prompt_lens, cached)],
                        "cached_tokens": cached,
                        "continuation_digests": [continuation_digest(c)
                                                 for c in source["token_ids"]],
                        "seconds": round(time.perf_counter() - start, 3)})
        print(f"case {case['case']}: scored in {results[-1]['seconds']} s", flush=True)
    return results


def text_prompts(tokenizer, path: str, rows: int = 1016):
    """``make_prompt`` of :func:`exactness_lib.build_cases` over GSM8K text
    (a JSONL of ``question`` / ``answer``), tokenized by the model's tokenizer."""
    with open(path) as f:
        data = [json.loads(line) for line, _ in zip(f, range(rows))]
    worked, questions = render_gsm8k(data)
    corpus = tokenizer.encode(worked, add_special_tokens=False)
    question_ids = [tokenizer.encode(q, add_special_tokens=False) for q in questions]
    return lambda n, seed: text_prompt(corpus, question_ids, n, seed)


def _knobs(args) -> dict:
    """Every prefill of a PCP run is split (the default leaves prompts under 8192
    tokens whole, which would compare one-GPU work with one-GPU work)."""
    knobs = {"pcp_min_split_tokens": 2} if args.pcp > 1 else {}
    if getattr(args, "dcp_context_exchange", None):
        knobs["pcp_dcp_context_exchange"] = args.dcp_context_exchange
    return knobs


def _compilation(args) -> dict:
    """TP > 1 with torch.compile: without vLLM's all-reduce + RMSNorm fusion
    (:data:`layouts.NO_ALLREDUCE_FUSION`), as in the bench."""
    if args.tp > 1 and args.cuda_graphs:
        return {"compilation_config": NO_ALLREDUCE_FUSION}
    return {}


def _parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--pcp", type=int, default=1)
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--variant", choices=sorted(VARIANTS), default="unchunked")
    ap.add_argument("--cuda-graphs", action="store_true")
    ap.add_argument("--ray", action="store_true", help="Ray as the distributed executor")
    ap.add_argument("--v1-runner", action="store_true",
                    help="vLLM's V1 model runner (the plugin's) at PCP = 1 too")
    ap.add_argument("--dcp", type=int, default=1, help="decode context parallel size")
    ap.add_argument("--interleave", type=int, default=1, help="--cp-kv-cache-interleave-size")
    ap.add_argument("--dcp-context-exchange", choices=CONTEXT_EXCHANGES,
                    help="the plugin knob pcp_dcp_context_exchange (default: its default)")
    ap.add_argument("--max-tokens", type=int, default=MAX_TOKENS)
    ap.add_argument("--text-prompts", default="",
                    help="GSM8K JSONL: prompts of real text (default: random token ids)")
    ap.add_argument("--attention-backend", default="FLASHINFER",
                    help="the same kernel on both sides of a comparison; PCP runs on "
                         "FLASHINFER, while vLLM picks FLASH_ATTN for PCP = 1 on Hopper")
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.85)
    ap.add_argument("--kv-cache-memory-bytes", type=int, default=None,
                    help="fixed KV pool (vLLM's kv_cache_memory_bytes); for engines "
                         "sharing a GPU")
    ap.add_argument("--kv-pool-tokens", type=int, default=0,
                    help="fixed KV pool of this many tokens per rank (overrides "
                         "--kv-cache-memory-bytes)")
    ap.add_argument("--teacher", default="",
                    help="a raw file of check_exactness.py run: score its one-GPU greedy "
                         "outputs appended to the prompts (prompt_logprobs) after the "
                         "--cases; 'self': this engine's own outputs of the standard "
                         "cases; --max-tokens as in that run")
    ap.add_argument("--teacher-model", default="",
                    help="with --teacher: the model's name in that file")
    add_feature_args(ap)
    ap.add_argument("--out", required=True)
    return ap.parse_args()


def _per_rank(llm, method: str, *args) -> list | None:
    """Each rank's answer to the plugin worker's ``method`` (``collective_rpc``): its
    :class:`vllm_pcp.pcp.counts.PCPStepCounts` (``pcp_step_counts``), the steps whose
    sampled tokens it held equal across the PCP ranks (``pcp_sampled_token_checks``), its
    memory (``pcp_memory``); None where the plugin's worker does not run (one GPU)."""
    try:
        return llm.collective_rpc(method, args=args)
    except Exception:  # the stock worker has no such method
        return None


def run_groups(llm, args, cases, max_prompt_len: int, vocab_size: int,
               tokenizer) -> dict:
    """The ``--cases`` groups on one engine, then ``--teacher``'s scoring: the worker's
    output keys ``results`` (standard cases), ``feature_results``, ``scores``, and
    ``memory``: each rank's memory at the start and after each of the three, its peak
    reset between them (scripts/memory_report.py tells the split steps' peak from that
    of vLLM's prompt-logprob logits, which the scoring computes)."""
    groups = [g for g in args.cases.split(",") if g and g != "none"]
    out: dict = {}
    at_start = _per_rank(llm, "pcp_memory", True)
    phases = {}
    if "standard" in groups:
        out["results"] = run_cases(llm, cases, args.max_tokens)
        phases["standard"] = _per_rank(llm, "pcp_memory", True)
    features = [g for g in groups if g != "standard"]
    if features:
        out["feature_results"] = [
            res for g in features for res in run_feature_group(
                llm, g, max_prompt_len, vocab_size, args.max_tokens, tokenizer)]
        phases["features"] = _per_rank(llm, "pcp_memory", True)
    if args.teacher:
        try:
            out["scores"] = _score(llm, args, cases, out)
        except (RuntimeError, ValueError) as exc:  # the cases above stay recorded
            out["scores_error"] = repr(exc)
        phases["scoring"] = _per_rank(llm, "pcp_memory", True)
    out["memory"] = at_start and {"at_start": at_start, "phases": phases}
    return out


def _score(llm, args, cases, out: dict) -> list[dict]:
    """``--teacher``'s scoring, on a prefix cache emptied of what the cases above
    cached (their outputs would be hits past the prompts)."""
    if args.teacher == "self":  # this engine's own greedy outputs, scored
        if "results" not in out:
            raise ValueError("--teacher self scores the standard cases: add them to --cases")
        continuations = continuations_of(out["results"])
    else:
        with open(args.teacher) as f:
            continuations = teacher_continuations(json.load(f), args.teacher_model)
    if not llm.reset_prefix_cache():
        raise RuntimeError("the prefix cache could not be reset before scoring")
    return score_cases(llm, cases, continuations)


def main() -> None:
    args = _parse_args()
    if args.v1_runner:  # read by vLLM when it picks the runner
        os.environ["VLLM_USE_V2_MODEL_RUNNER"] = "0"
    from vllm import LLM

    with open(os.path.join(args.model, "config.json")) as f:
        hf = json.load(f)
    max_model_len = (args.max_model_len
                     or min(hf["max_position_embeddings"], 32768 + 2 * args.max_tokens))
    if max_model_len > hf["max_position_embeddings"]:  # VLLM_ALLOW_LONG_MAX_MODEL_LEN
        raise SystemExit(f"--max-model-len {max_model_len}: past the model's "
                         f"{hf['max_position_embeddings']} positions its rotary table has no "
                         "rows (vLLM reads past its end: eager engines silently)")
    if args.kv_pool_tokens:
        args.kv_cache_memory_bytes = args.kv_pool_tokens * kv_bytes_per_token(hf)
    has_tokenizer = bool(args.tokenizer) or os.path.exists(
        os.path.join(args.model, "tokenizer.json"))
    print(ENGINE_START_MARK, time.time(), flush=True)
    llm = LLM(model=args.model, skip_tokenizer_init=not has_tokenizer, dtype="bfloat16",
              prefill_context_parallel_size=args.pcp, tensor_parallel_size=args.tp,
              enforce_eager=not args.cuda_graphs, max_model_len=max_model_len,
              max_num_batched_tokens=VARIANTS[args.variant] or max_model_len,
              max_num_seqs=16, gpu_memory_utilization=args.gpu_memory_utilization, seed=0,
              enable_prefix_caching=True, attention_backend=args.attention_backend,
              distributed_executor_backend="ray" if args.ray else None,
              decode_context_parallel_size=args.dcp,
              cp_kv_cache_interleave_size=args.interleave,
              kv_cache_memory_bytes=args.kv_cache_memory_bytes,
              enable_flashinfer_autotune=False,  # kernel tactics: speed, on both sides
              additional_config=_knobs(args), **_compilation(args),
              **engine_feature_args(args))
    kv_capacity_tokens = pool_tokens(llm.llm_engine.vllm_config.cache_config, args.dcp)
    make_prompt = (text_prompts(llm.get_tokenizer(), args.text_prompts)
                   if args.text_prompts else None)
    max_prompt_len = max_model_len - args.max_tokens - 8
    cases = build_cases(max_prompt_len, hf["vocab_size"], make_prompt)
    out = run_groups(llm, args, cases, max_prompt_len, hf["vocab_size"],
                     llm.get_tokenizer() if has_tokenizer else None)
    with open(args.out, "w") as f:
        json.dump({"model": args.model, "pcp": args.pcp, "tp": args.tp,
                   "variant": args.variant, "cuda_graphs": args.cuda_graphs,
                   "attention_backend": args.attention_backend, "ray": args.ray,
                   "dcp": args.dcp, "interleave": args.interleave,
                   "v1_runner": args.v1_runner, "kv_capacity_tokens": kv_capacity_tokens,
                   "teacher": args.teacher, "step_counts": _per_rank(llm, "pcp_step_counts"),
                   "sampled_token_checks": _per_rank(llm, "pcp_sampled_token_checks"),
                   "shared_gpus": os.environ.get(SHARED_GPUS_ENGAGED), **out}, f)


if __name__ == "__main__":
    main()
