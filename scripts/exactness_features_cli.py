"""The feature cases of check_exactness.py (scripts/exactness_features.py):
``features run`` runs each configuration's case group (a run that must be refused is
timed from its log and killed if it hangs), ``features compare`` judges them against
one GPU. The shared helpers of check_exactness.py (CONFIGS, run, _compare_run, ...)
are imported where they are used: check_exactness.py imports this module."""
from __future__ import annotations

import json
import os
import sys

from exactness_features import (PREEMPT_CAPACITY_TOKENS, PREEMPT_MAX_MODEL_LEN,
                                REFUSAL_TIMEOUT_S, SLIDING_WINDOW_PATTERN,
                                judge_feature_case, refusal_case, refusal_record,
                                rejudge_refusal)
from gpu_runs import RAW_KEYS, check_env, run_worker
from layouts import CONTEXT_EXCHANGES as FEATURE_EXCHANGES
from layouts import worker_flags


def feature_configs() -> dict:
    """Engine flags of the configurations only the feature cases use (check_exactness.CONFIGS
    takes them in): layouts of scripts/layouts.py, and some of them with a feature's flags."""
    return {
        **{f"pcp2-dcp2-i{i}-{way}": worker_flags(f"pcp2-dcp2-i{i}-{way}")
           for i in (1, 16) for way in FEATURE_EXCHANGES},
        # fp8 against one GPU's fp8 at -pcp; refused with -dcp (the plugin's DCP runs
        # unquantized caches)
        **{f"{name}-fp8": [*worker_flags(name), "--kv-cache-dtype", "fp8"]
           for name in ("pcp1-v1", "pcp2", "pcp4", "pcp2-dcp2-i1")},
        # the same scheduler pool of PREEMPT_CAPACITY_TOKENS everywhere: a DCP rank holds
        # 1/DCP of it
        **{f"{name}-preempt": [*worker_flags(name), "--kv-pool-tokens",
                               str(PREEMPT_CAPACITY_TOKENS // dcp),
                               "--max-model-len", str(PREEMPT_MAX_MODEL_LEN)]
           for name, dcp in (("pcp1-v1", 1), ("pcp2", 1), ("pcp4", 1), ("pcp2-dcp2-i1", 2),
                             ("pcp2-dcp2-i16", 2))}}


FEATURE_DEFAULT_CONFIGS = ",".join(
    ["pcp1-v1", "pcp2", *(f"pcp2-dcp2-i{i}-{way}" for i in (1, 16) for way in FEATURE_EXCHANGES),
     "pcp1-v1-fp8", "pcp2-fp8", "pcp2-dcp2-i1-fp8",
     *(f"{name}-preempt" for name in ("pcp1-v1", "pcp2", "pcp2-dcp2-i1", "pcp2-dcp2-i16"))])
# What must stop at start-up, by model (every configuration) or by configuration, and a
# regular expression the error must match
FEATURE_REFUSED_MODELS = {"mistral-swa512": SLIDING_WINDOW_PATTERN}
FEATURE_REFUSED_CONFIGS = {"pcp2-dcp2-i1-fp8": r"--kv-cache-dtype fp8"}


def _feature_group(config: str) -> str:
    """The worker's ``--cases`` group of a configuration: the preemption case in the
    small pool, the same-step cases for a forced context exchange, else every case."""
    if config.endswith("-preempt"):
        return "preemption"
    if config.endswith(("-queries", "-keys")):
        return "same-step"
    return "features"


def _feature_baseline(config: str) -> str | None:
    """The one-GPU configuration a feature configuration is compared with (None: it
    is one): one GPU on the V1 runner, whose seeded samples the plugin's runner draws."""
    for suffix in ("-preempt", "-fp8"):
        if config.endswith(suffix):
            return None if config == "pcp1-v1" + suffix else "pcp1-v1" + suffix
    return None if config == "pcp1-v1" else "pcp1-v1"


def _refusal_pattern(model: str, config: str) -> str | None:
    """What ``config`` on ``model`` must be refused with, or None."""
    return FEATURE_REFUSED_MODELS.get(model) or FEATURE_REFUSED_CONFIGS.get(config)


def _feature_tokenizer_args(model: str, cases: str = "features") -> list[str]:
    """A tokenizer for a random model's JSON-schema case, where its groups run it."""
    from check_exactness import FEATURE_TOKENIZERS

    path = FEATURE_TOKENIZERS.get(model) if "features" in cases.split(",") else None
    return ["--tokenizer", path] if path and os.path.isdir(path) else []


def _run_feature_one(args, tmp: str, model: str, variant: str, config: str,
                     env: dict) -> dict:
    """One engine of ``features run``: the case group of ``config``. A run that must
    be refused runs no case and is judged by its log (:func:`_run_refusal`)."""
    from check_exactness import CONFIGS, HERE, _model_dir

    out = os.path.join(tmp, f"{model}-{variant}-{config}-features.json")
    pattern = _refusal_pattern(model, config)
    cmd = [sys.executable, os.path.join(HERE, "exactness_worker.py"),
           "--model", _model_dir(model, args.models_dir), "--variant", variant,
           "--gpu-memory-utilization", str(args.gpu_memory_utilization),
           "--max-tokens", str(args.max_tokens), "--out", out,
           # a configuration's own --max-model-len (the preemption pool's) comes later, wins
           *(["--max-model-len", str(args.max_model_len)] if args.max_model_len else []),
           *CONFIGS[config],
           "--cases", "none" if pattern else _feature_group(config),
           *_feature_tokenizer_args(model)]
    if args.kv_cache_gib:
        cmd += ["--kv-cache-memory-bytes", str(int(args.kv_cache_gib * (1 << 30)))]
    entry = {"model": model, "variant": variant, "config": config}
    if pattern:
        return _run_refusal(cmd, entry, check_env(env), pattern, args.refusal_timeout)
    return run_worker(cmd, out, "feature_results", entry, check_env(env), extra=RAW_KEYS)


def _run_refusal(cmd: list[str], entry: dict, env: dict, pattern: str,
                 timeout: float) -> dict:
    """Run a worker that must stop at start-up; after ``timeout`` seconds its process
    group is killed (a hang). ``returncode`` is 0 when it was refused as it must be."""
    import signal
    import subprocess
    import time

    start = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, **env}, start_new_session=True)
    try:
        log, timed_out = proc.communicate(timeout=timeout)[0], False
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        log, timed_out = proc.communicate()[0], True
    record = refusal_record(log, proc.returncode, timed_out, time.perf_counter() - start,
                            time.time(), pattern)
    print(entry["model"], entry["variant"], entry["config"],
          "refused" if record["refused"] else "NOT refused",
          record["seconds_to_failure"], record["message"], flush=True)
    return {**entry, "returncode": 0 if record["refused"] else 1, "refusal": record,
            "log_tail": log[-6000:]}


def _feature_cases(model: str, label: str, run: dict, base: dict, tokens: int,
                   not_compared: list | None = None) -> list[dict]:
    """The cases of ``run`` against ``base``: vLLM's top-k rule, then each kind's own
    (:func:`exactness_features.judge_feature_case`); an engine that failed is one case;
    one the baseline did not run on the same prompts goes to ``not_compared``."""
    from check_exactness import _compare_run, comparable

    if run["returncode"] or base["returncode"]:
        failed = run if run["returncode"] else base
        return [{"model": model, "config": label, "case": "engine", "prompt_lens": [],
                 "first_divergence": None, "max_abs_logprob_diff": None, "passed": False,
                 "errors": failed.get("errors", []),
                 "error": failed.get("log_tail", "")[-1500:]}]
    base_results = {res["case"]: res for res in base["feature_results"]}
    reasons = [comparable(res, base_results) for res in run["feature_results"]]
    shared = [res for res, why in zip(run["feature_results"], reasons) if not why]
    cases = _compare_run(model, label, {**run, "results": shared},
                         {**base, "results": base["feature_results"]}, tokens)
    cases = [judge_feature_case(case, res, base_results[res["case"]])
             for case, res in zip(cases, shared)]
    if not_compared is not None:
        not_compared += [{"model": model, "config": label, "case": res["case"],
                          "prompt_lens": res["prompt_lens"], "reason": why}
                         for res, why in zip(run["feature_results"], reasons) if why]
    return cases


def _feature_summary(cases: list[dict]) -> dict:
    """:func:`_summarize` of the compared cases, per case name, and of the refusals."""
    from check_exactness import _summarize

    refusals = [c for c in cases if c["case"] == "refusal"]
    compared = [c for c in cases if c["case"] != "refusal"]
    by_case: dict[str, list] = {}
    for case in compared:
        by_case.setdefault(case["case"], []).append(case)
    seconds = [c["seconds_to_failure"] for c in refusals if c["seconds_to_failure"] is not None]
    return {**_summarize(compared),
            "by_case": {name: _summarize(group) for name, group in sorted(by_case.items())},
            "refusals": {"cases": len(refusals), "passed": sum(c["passed"] for c in refusals),
                         "max_seconds_to_failure": max(seconds, default=None)}}


def features_compare(args) -> None:
    """exactness-features.json from raw files of ``features run``, in the schema of
    exactness-pcp.json (meta, summary, cases); refusals are cases named "refusal"."""
    from check_exactness import _load_runs, _meta

    runs, host = _load_runs(args.raw, getattr(args, "models", ""))
    runs = {key: run for key, run in runs.items()
            if run["returncode"] or "refusal" in run or "feature_results" in run}
    cases, not_compared = [], []
    for (model, variant, config), run in sorted(runs.items()):
        if "refusal" in run:
            record, pattern = run["refusal"], _refusal_pattern(model, config)
            if run.get("log_tail") and pattern:
                record = rejudge_refusal(record, run["log_tail"], pattern)
            cases.append(refusal_case(model, f"{config}, {variant}", record))
            continue
        base_config = _feature_baseline(config)
        base = runs.get((model, variant, base_config or ""))
        if base is not None:
            cases += _feature_cases(model, f"{config} vs {base_config}, {variant}", run, base,
                                    args.tokens, not_compared)
    meta = _meta(args, host, runs)
    if args.tokens:
        meta["compared_tokens"] = args.tokens
    summary = _feature_summary(cases)
    result = {"meta": meta, "summary": summary, "cases": cases}
    if not_compared:
        summary["not_compared"] = len(not_compared)
        result["not_compared"] = not_compared
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    print(json.dumps(summary))


def features(args) -> None:
    """``features run``: :func:`run` with :func:`_run_feature_one`; ``features compare``."""
    from check_exactness import CONFIGS, run

    if args.features_cmd == "compare":
        features_compare(args)
        return
    unknown = [c for c in args.configs.split(",") if c not in CONFIGS]
    if unknown:
        raise SystemExit(f"unknown configurations {unknown} (features: {FEATURE_DEFAULT_CONFIGS})")
    run(args, run_one=_run_feature_one)


def add_features_parser(sub) -> None:
    """``features run`` (the flags of ``run``) and ``features compare``."""
    from check_exactness import add_result_args, add_run_args

    fsub = sub.add_parser("features", help="the feature cases against -pcp 1").add_subparsers(
        dest="features_cmd", required=True)
    r = fsub.add_parser("run")
    add_run_args(r, {"default": "qwen2.5-3b-shape"}, FEATURE_DEFAULT_CONFIGS)
    r.add_argument("--lanes", type=int, default=1)
    r.add_argument("--one-gpu-lanes", type=int, default=None)
    r.add_argument("--kv-cache-gib", type=float, default=0.0)
    r.add_argument("--gpu-memory-utilization", type=float, default=0.85)
    r.add_argument("--max-tokens", type=int, default=32)
    r.add_argument("--max-model-len", type=int, default=0,
                   help="as for run: every engine's max_model_len but the preemption pool's")
    r.add_argument("--refusal-timeout", type=float, default=REFUSAL_TIMEOUT_S,
                   help="seconds after which a run that must be refused counts as hung")
    c = fsub.add_parser("compare")
    add_result_args(c)
    c.add_argument("--date", default="", help="date of the GPU run (default: today)")
    c.add_argument("--tokens", type=int, default=0,
                   help="compare only the first N generated tokens of each output")
