"""Engines of several ranks against one GPU (pcp1-v1, the V1 runner): same greedy tokens
and logprobs, feature cases, teacher-forced scores (run_gpu_checks.sh engine-proof).

Three steps, each its own command:

    python scripts/check_exactness.py models --out-dir /tmp/pcp-models --layers 4
    python scripts/check_exactness.py run --jobs qwen2.5-3b-shape:chunked:pcp1-v1:standard+features \
        --teacher self --raw $OUT/raw-base.json
    python scripts/check_exactness.py run --jobs qwen2.5-3b-shape:chunked:pcp2:standard+features \
        --teacher $OUT/raw-base.json --raw $OUT/raw-proof.json
    python scripts/check_exactness.py compare --raw raw-base.json raw-proof.json \
        --git-rev REV --command "..." --out tests/gpu/results/exactness-pcp.json

``models`` builds random-weight models from ``configs/models/*.json``
(transformers init, seed 0); ``run`` starts one engine per job (``--jobs``, or every
model x variant x config) in its own process (scripts/exactness_worker.py), which runs
its case groups and then, with ``--teacher``, scores the one-GPU greedy outputs of the
baseline run (``self``: its own) appended to the prompts; ``compare`` applies the pass
rule of exactness_lib.compare_outputs to every case, ``teacher`` the teacher-forced
measure (scripts/exactness_teacher.py) to the scores.

The feature cases (scripts/exactness_features.py) also run on engines of their own
(``features run``: a configuration's group, baseline and pool; a run that must be
refused is timed from its log and killed if it hangs); ``features compare`` judges every
feature result with the rules of its kind (n = 4 exact, prompt logprobs, preemption):

    python scripts/check_exactness.py features run --models qwen2.5-3b-shape \
        --variants chunked --configs pcp2-preempt,pcp2-dcp2-i1-fp8 --raw raw-features.json
    python scripts/check_exactness.py features compare --raw raw-*.json \
        --git-rev REV --command "..." --out tests/gpu/results/exactness-features.json
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)
from exactness_features_cli import (_feature_tokenizer_args, add_features_parser,  # noqa: E402
                                    feature_configs, features)
from exactness_lib import compare_outputs  # noqa: E402
from exactness_teacher import _teacher_args, add_teacher_parser, teacher  # noqa: E402
from gpu_runs import RAW_KEYS, check_env, run_worker, versions  # noqa: E402
from kv_capacity import kv_capacity  # noqa: E402
from layouts import SMALL_POOL_TOKENS, worker_flags  # noqa: E402,F401

# the layouts (scripts/layouts.py) this script runs, as exactness_worker.py flags
CONFIGS = {name: worker_flags(name) for name in (
    "pcp1", "pcp2", "pcp1-graphs", "pcp2-graphs", "pcp2-ray", "tp2",
    "pcp1-v1", "pcp1-v1-graphs",  # the baselines: one GPU on the plugin's V1 runner
    "pcp1-flash-attn",  # the noise floor: one GPU, FlashAttention against FlashInfer
    "pcp2-dcp2-i1", "pcp2-dcp2-i8", "pcp2-dcp2-i16", "pcp2-dcp2-i8-graphs",
    "pcp2-dcp2-i8-queries", "pcp2-dcp2-i8-keys",  # one context exchange forced
    "tp2-dcp2-i1", "tp2-dcp2-i8", "tp2-dcp2-i16", "tp2-dcp2-i8-graphs",
    "pcp2-dcp2-i8-smallpool", "pcp4", "pcp4-dcp4-i1", "pcp4-dcp4-i8", "pcp8",
    "tp2-pcp2", "tp2-pcp2-dcp2-i1", "tp4-pcp2-dcp2-i8")}
# Every configuration of several ranks against one GPU on the V1 model runner, which the
# plugin runs on (vLLM 0.26.0 runs V2 at PCP = 1): CUDA graphs against CUDA graphs
BASELINE = {c: "pcp1-v1-graphs" if c.endswith("-graphs") else "pcp1-v1"
            for c in CONFIGS if c not in ("pcp1", "pcp1-graphs", "pcp1-v1", "pcp1-v1-graphs",
                                          "pcp1-flash-attn")}
# the feature cases' own configurations (their baselines: exactness_features_cli)
CONFIGS.update(feature_configs())
# The noise floor: one GPU against itself, (variant, config) vs (variant, config). CUDA
# graphs with torch.compile, or another chunk size, compute the same model with other
# roundings in another order; any exact change of kernel or partition is measured against it.
FLOOR_PAIRS = ((("chunked", "pcp1"), ("chunked", "pcp1-v1")),  # V2 against V1
               (("unchunked", "pcp1"), ("unchunked", "pcp1-v1")),
               (("chunked", "pcp1-flash-attn"), ("chunked", "pcp1")),  # another kernel
               (("chunked", "pcp1-graphs"), ("chunked", "pcp1")),
               (("unchunked", "pcp1-graphs"), ("unchunked", "pcp1")),
               (("chunked", "pcp1"), ("unchunked", "pcp1")),
               (("chunked", "pcp1-graphs"), ("unchunked", "pcp1-graphs")),
               # vLLM's own -tp 2: sharded weights round otherwise (MoE's experts are
               # sharded over the ranks under -pcp too)
               (("chunked", "tp2"), ("chunked", "pcp1")))
TEXT_SUFFIX = "-text"
FULL_DEPTH_SUFFIX = "-full"
TEXT_DATA = os.path.join(os.environ.get("DATA_GSM8K", "/tmp/gsm8k"), "train.jsonl")
SHARED_MODELS = {"smollm2": "/tmp/models/smollm2-135m",
                 "qwen2.5-coder-0.5b": "/tmp/models/qwen2.5-coder-0.5b"}
# Tokenizers for random models without one (same vocabulary): the feature cases' JSON schema.
# None: the JSON-schema case runs on the real models, with their own tokenizers (a tokenizer
# that appears between a baseline's run and another's would give them different cases).
FEATURE_TOKENIZERS: dict[str, str] = {}


def build_models(out_dir: str, layers: int, device: str = "cuda",
                 only: list[str] | None = None) -> None:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    for name in sorted(os.listdir(os.path.join(ROOT, "configs", "models"))):
        target = os.path.join(out_dir, name.removesuffix(".json"))
        if only and name.removesuffix(".json") not in only:
            continue
        if os.path.exists(os.path.join(target, "config.json")):
            continue
        path = os.path.join(ROOT, "configs", "models", name)
        with open(path) as f:
            fields = json.load(f)
        fields["num_hidden_layers"] = min(fields["num_hidden_layers"], layers)
        config = AutoConfig.for_model(fields.pop("model_type"), **fields)
        torch.manual_seed(0)
        with torch.device(device):
            model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
        model.save_pretrained(target)
        print(f"built {target}: {sum(p.numel() for p in model.parameters()) / 1e6:.0f} M params")
        del model


def _model_dir(name: str, models_dir: str) -> str:
    """A model's folder: a shared real model, else ``models_dir/NAME``; ``NAME-full``
    is NAME with all the layers of its config, in ``models_dir-full`` (``models
    --out-dir DIR-full --layers 1000``)."""
    name = name.removesuffix(TEXT_SUFFIX)
    if name.endswith(FULL_DEPTH_SUFFIX):
        return os.path.join(models_dir + FULL_DEPTH_SUFFIX, name.removesuffix(FULL_DEPTH_SUFFIX))
    return SHARED_MODELS.get(name) or os.path.join(models_dir, name)


def _prompt_args(name: str, text_data: str) -> list[str]:
    """A model named ``NAME-text`` runs NAME on GSM8K text instead of random ids."""
    return ["--text-prompts", text_data] if name.endswith(TEXT_SUFFIX) else []


def _run_one(args, tmp: str, model: str, variant: str, config: str, env: dict) -> dict:
    out = os.path.join(tmp, f"{model}-{variant}-{config}-t{args.max_tokens}.json")
    cases = getattr(args, "job_cases", {}).get((model, variant, config), args.cases)
    cmd = [sys.executable, os.path.join(HERE, "exactness_worker.py"),
           "--model", _model_dir(model, args.models_dir), "--variant", variant,
           "--gpu-memory-utilization", str(args.gpu_memory_utilization),
           "--max-tokens", str(args.max_tokens), "--out", out, *CONFIGS[config],
           "--cases", cases, *_prompt_args(model, getattr(args, "text_data", TEXT_DATA)),
           *_teacher_args(args, model, variant), *_feature_tokenizer_args(model, cases)]
    if args.kv_cache_gib:
        cmd += ["--kv-cache-memory-bytes", str(int(args.kv_cache_gib * (1 << 30)))]
    if getattr(args, "max_model_len", 0):
        cmd += ["--max-model-len", str(args.max_model_len)]
    return run_worker(cmd, out, "results",
                      {"model": model, "variant": variant, "config": config},
                      check_env(env), extra=RAW_KEYS)


def _lanes(jobs: list, overlap: bool, lanes: int, gpus: int,
           one_gpu_lanes: int | None = None) -> list[tuple[list, dict]]:
    """Split ``jobs`` into lanes that run at once, each with its environment.
    Without ``overlap`` one lane runs everything in turn; with it, one-GPU jobs
    get ``one_gpu_lanes`` lanes (default ``lanes``; spread over the GPUs, last
    GPU first) and the others ``lanes``."""
    if not overlap:
        return [(jobs, {})]
    one_gpu = {c for c in CONFIGS if CONFIGS[c][:2] == ["--pcp", "1"]}
    single = [j for j in jobs if j[2] in one_gpu]
    multi = [j for j in jobs if j[2] not in one_gpu]
    singles = one_gpu_lanes or lanes
    out = [(single[i::singles], {"CUDA_VISIBLE_DEVICES": str(max(0, gpus - 1 - i % gpus))})
           for i in range(singles)]
    out += [(multi[i::lanes], {}) for i in range(lanes)]
    return [(lane_jobs, env) for lane_jobs, env in out if lane_jobs]


def _jobs(args) -> list[tuple[str, str, str]]:
    """``(model, variant, config)`` of every engine: ``--jobs`` in its order, else every
    model x variant x config; a job's own case groups go to ``args.job_cases``."""
    spec = getattr(args, "jobs", "")
    if not spec:
        return [(m, v, c) for m in args.models.split(",") for v in args.variants.split(",")
                for c in args.configs.split(",")]
    jobs, args.job_cases = [], {}
    for item in spec.split(","):
        model, variant, config, *cases = item.split(":")
        if config not in CONFIGS or len(cases) > 1:
            raise SystemExit(f"--jobs {item!r}: MODEL:VARIANT:CONFIG[:GROUP+GROUP], "
                             f"CONFIG one of {', '.join(CONFIGS)}")
        jobs.append((model, variant, config))
        if cases:
            args.job_cases[jobs[-1]] = cases[0].replace("+", ",")
    return jobs


def run(args, run_one=None) -> None:
    """One engine per (model, variant, config), in lanes (see ``_lanes``); ``run_one``
    runs a job (default :func:`_run_one`)."""
    import threading
    from concurrent.futures import ThreadPoolExecutor

    raw = {"versions": versions(), "git_rev": os.environ.get("GIT_REV"), "runs": []}
    tmp = f"/tmp/exactness-{os.getpid()}"
    os.makedirs(tmp, exist_ok=True)
    jobs = _jobs(args)
    lanes = _lanes(jobs, args.overlap, args.lanes, _gpu_count(),
                   getattr(args, "one_gpu_lanes", None))
    lock, failed = threading.Lock(), threading.Event()

    def lane(lane_and_env):
        lane_jobs, env = lane_and_env
        for job in lane_jobs:
            if failed.is_set():
                return
            entry = (run_one or _run_one)(args, tmp, *job, env)
            with lock:
                raw["runs"].append(entry)
                with open(args.raw, "w") as f:
                    json.dump(raw, f)
            if entry["returncode"] and args.fail_fast:
                print(entry["log_tail"])
                failed.set()

    with ThreadPoolExecutor(len(lanes)) as pool:
        list(pool.map(lane, lanes))


def _gpu_count() -> int:
    import torch

    return torch.cuda.device_count()


def _truncate(output: dict, tokens: int) -> dict:
    return {"token_ids": output["token_ids"][:tokens], "logprobs": output["logprobs"][:tokens]}


def comparable(res: dict, base_cases: dict) -> str | None:
    """Why the result ``res`` cannot be held to ``base_cases`` (by case name), None if it
    can: the baseline did not run the case, or ran it on other prompts (an earlier run's
    baseline at another ``max_model_len``)."""
    base = base_cases.get(res["case"])
    if base is None:
        return "the baseline did not run this case"
    if base["prompt_lens"] != res["prompt_lens"]:
        return f"the baseline ran prompts of {base['prompt_lens']} tokens"
    return None


def _compare_run(model: str, label: str, run: dict, base: dict, tokens: int,
                 not_compared: list | None = None) -> list[dict]:
    """One case per result of ``run`` against the same case of ``base``; a case that
    :func:`comparable` rejects goes to ``not_compared`` instead."""
    cases = []
    base_cases = {c["case"]: c for c in base["results"]}
    for res in run["results"]:
        reason = comparable(res, base_cases)
        if reason:
            if not_compared is not None:
                not_compared.append({"model": model, "config": label, "case": res["case"],
                                     "prompt_lens": res["prompt_lens"], "reason": reason})
            continue
        pairs = zip(res["outputs"], base_cases[res["case"]]["outputs"])
        if tokens:
            pairs = [(_truncate(a, tokens), _truncate(b, tokens)) for a, b in pairs]
        per_prompt = [compare_outputs(a, b) for a, b in pairs]
        diverged = [p["first_divergence"] for p in per_prompt
                    if p["first_divergence"] is not None]
        case = {"model": model, "config": label, "case": res["case"],
                "prompt_lens": res["prompt_lens"],
                "first_divergence": min(diverged) if diverged else None,
                "max_abs_logprob_diff": max(p["max_abs_logprob_diff"] for p in per_prompt),
                "passed": all(p["passed"] for p in per_prompt)}
        margins = [p["baseline_margin"] for p in per_prompt if "baseline_margin" in p]
        if margins:
            case["max_baseline_margin"] = max(margins)
        cases.append(case)
    return cases


def _load_runs(paths: list[str], models: str = "") -> tuple[dict, dict]:
    """The runs of raw files by (model, variant, config), a later file's replacing an
    earlier one's, each with its ``git_rev`` (its own, else its file's), and the versions of
    the last file;
    ``models`` (comma-separated): only theirs."""
    runs, host, only = {}, {}, set(filter(None, models.split(",")))
    for path in paths:
        with open(path) as f:
            data = json.load(f)
        host = data["versions"]
        for run in data["runs"]:
            if not only or run["model"] in only:
                runs[(run["model"], run["variant"], run["config"])] = {
                    **run, "git_rev": run.get("git_rev") or data.get("git_rev")}
    return runs, host


def runs_by_git_rev(runs: dict) -> dict | None:
    """``{git_rev: ["model:variant:config", ...]}`` where the runs come from raw files of
    more than one revision, else None."""
    by_rev: dict[str, list] = {}
    for (model, variant, config), run in sorted(runs.items()):
        by_rev.setdefault(run.get("git_rev") or "unknown", []).append(
            f"{model}:{variant}:{config}")
    return by_rev if len(by_rev) > 1 else None


def _meta(args, host: dict, runs: dict | None = None) -> dict:
    """A result file's ``meta``: revision, command, GPU, versions, date, how many GPUs the
    ranks of the engines shared (``runs``: their raw entries) and the note."""
    meta = {"git_rev": args.git_rev, "command": args.command, "gpu": host.get("gpu"),
            "vllm": host.get("vllm"), "flashinfer": host.get("flashinfer"),
            "torch": host.get("torch"), "date": args.date or datetime.date.today().isoformat()}
    shared = shared_gpus(runs or {})
    if shared:
        meta["ranks_shared_gpus"] = shared
    by_rev = runs_by_git_rev(runs or {})
    if by_rev:
        meta["runs_by_git_rev"] = by_rev
    if args.note:
        meta["note"] = args.note
    return meta


def shared_gpus(runs: dict) -> dict | None:
    """``{"gpus", "configs"}``: the configurations whose ranks shared ``gpus`` GPUs
    (tests/engine/shared_gpu.py), None when none did."""
    shared = {run["config"]: run["shared_gpus"] for run in runs.values()
              if run.get("shared_gpus")}
    if not shared:
        return None
    return {"gpus": max(int(v) for v in shared.values()), "configs": sorted(shared),
            "note": "every rank of these engines ran on the same GPU(s) and talked over "
                    "NCCL's network transport on the loopback interface: outputs, not speed"}


def compare(args) -> None:
    runs, host = _load_runs(args.raw, getattr(args, "models", ""))
    runs = {key: run for key, run in runs.items() if run["returncode"] or "results" in run}
    cases, not_compared = [], []
    for (model, variant, config), run in sorted(runs.items()):
        base = runs.get((model, variant, BASELINE.get(config, "")))
        if base is None or not _in_layouts(config, getattr(args, "layouts", "all")):
            continue
        label = f"{config} vs {BASELINE[config]}, {variant}"
        if run["returncode"] or base["returncode"]:
            failed = run if run["returncode"] else base
            cases.append({"model": model, "config": label, "case": "engine",
                          "prompt_lens": [], "first_divergence": None,
                          "max_abs_logprob_diff": None, "passed": False,
                          "errors": failed.get("errors", []),
                          "error": failed.get("log_tail", "")[-1500:]})
            continue
        cases += _compare_run(model, label, run, base, args.tokens, not_compared)
    meta = _meta(args, host, runs)
    if args.tokens:
        meta["compared_tokens"] = args.tokens
    summary = _summarize(cases)
    text = [c for c in cases if c["model"].endswith(TEXT_SUFFIX)]
    if text:  # real models on real text
        summary["text_prompts"] = _summarize(text)
    floor = _noise_floor(runs, args.tokens)
    if floor:
        summary["noise_floor"] = _summarize(floor)
    if not_compared:
        summary["not_compared"] = len(not_compared)
    result = {"meta": meta, "summary": summary, "cases": cases}
    if floor:
        result["noise_floor_cases"] = floor
    if not_compared:
        result["not_compared"] = not_compared
    bench_runs = []
    if args.bench_raw:
        with open(args.bench_raw) as f:
            bench_runs = json.load(f)["runs"]
    capacity = kv_capacity(runs, bench_runs, args.serve_logs)
    if capacity:
        result["kv_capacity"] = capacity
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    print(json.dumps(summary))


def _in_layouts(config: str, layouts: str) -> bool:
    """Whether ``config`` is one of ``layouts``: ``all``, ``dcp1`` (a whole KV cache on
    every rank) or ``dcp`` (the KV cache sharded)."""
    if layouts == "all":
        return True
    from layouts import LAYOUTS

    sharded = LAYOUTS[config].dcp > 1 if config in LAYOUTS else "-dcp" in config
    return sharded == (layouts == "dcp")


def _noise_floor(runs: dict, tokens: int) -> list[dict]:
    """One GPU against itself (:data:`FLOOR_PAIRS`), case by case as in ``cases``."""
    cases = []
    for model in sorted({m for m, _, _ in runs}):
        for (variant, config), (base_variant, base_config) in FLOOR_PAIRS:
            run = runs.get((model, variant, config))
            base = runs.get((model, base_variant, base_config))
            if run and base and not run["returncode"] and not base["returncode"]:
                label = (f"{config} vs {base_config}, {variant}" if variant == base_variant
                         else f"{config}, {variant} vs {base_variant}")
                cases += _compare_run(model, label, run, base, tokens)
    return cases


def _summarize(cases: list[dict]) -> dict:
    return {"cases": len(cases), "passed": sum(c["passed"] for c in cases),
            "no_divergence": sum(c["passed"] and c["first_divergence"] is None
                                 for c in cases),
            "max_baseline_margin_at_divergence": max(
                (c["max_baseline_margin"] for c in cases if "max_baseline_margin" in c),
                default=None)}


def add_run_args(parser, models: dict, configs: str) -> None:
    """The flags ``run`` and ``features run`` share; ``--models`` takes ``models``."""
    parser.add_argument("--models", **models)
    parser.add_argument("--models-dir", default="/tmp/pcp-models")
    parser.add_argument("--variants", default="unchunked,chunked")
    parser.add_argument("--configs", default=configs)
    parser.add_argument("--raw", required=True)
    parser.add_argument("--fail-fast", action="store_true")
    parser.add_argument("--overlap", action="store_true",
                        help="run one-GPU configurations on the last GPU beside the others")
    parser.add_argument("--jobs", default="",
                        help="MODEL:VARIANT:CONFIG[:GROUP+GROUP],...: these engines in this "
                             "order (with their own case groups) instead of every model x "
                             "variant x config")
    parser.add_argument("--cases", default="standard",
                        help="the worker's case groups, comma-separated (standard, features, "
                             "same-step, preemption, none), all on each engine")


def add_result_args(parser) -> None:
    """The flags of a subcommand that writes a result file from raw files."""
    parser.add_argument("--raw", nargs="+", required=True)
    parser.add_argument("--git-rev", required=True)
    parser.add_argument("--command", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--note", default="", help="stored as meta.note")
    parser.add_argument("--models", default="",
                        help="only these models' runs (comma-separated; default: all)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    m = sub.add_parser("models")
    m.add_argument("--out-dir", default="/tmp/pcp-models")
    m.add_argument("--layers", type=int, default=4)
    m.add_argument("--device", default="cuda")
    m.add_argument("--only", default="", help="comma-separated model names (default: all)")
    r = sub.add_parser("run")
    add_run_args(r, {"default": ""}, "pcp1-v1,pcp2")
    r.add_argument("--lanes", type=int, default=1,
                   help="with --overlap: lanes of jobs on several GPUs")
    r.add_argument("--one-gpu-lanes", type=int, default=None,
                   help="with --overlap: lanes of one-GPU jobs (default: --lanes)")
    r.add_argument("--kv-cache-gib", type=float, default=0.0,
                   help="fixed KV pool per engine; skips vLLM's memory profiling, which "
                        "other engines on the same GPU would disturb")
    r.add_argument("--gpu-memory-utilization", type=float, default=0.85)
    r.add_argument("--max-tokens", type=int, default=32, help="greedy tokens per prompt")
    r.add_argument("--max-model-len", type=int, default=0,
                   help="every engine's max_model_len (default: the worker's, from the "
                        "model and --max-tokens); past a model's own positions it needs "
                        "VLLM_ALLOW_LONG_MAX_MODEL_LEN=1")
    r.add_argument("--text-data", default=TEXT_DATA,
                   help="GSM8K JSONL for models named NAME-text (real-text prompts)")
    r.add_argument("--teacher", default="",
                   help="a raw file of a pcp1-v1 run: score its greedy outputs appended to "
                        "the prompts (prompt_logprobs) after the --cases; 'self': each "
                        "engine its own; chunked runs only; --max-tokens as there")
    c = sub.add_parser("compare")
    add_result_args(c)
    c.add_argument("--tokens", type=int, default=0,
                   help="compare only the first N generated tokens of each output")
    c.add_argument("--layouts", choices=("all", "dcp1", "dcp"), default="all",
                   help="only configurations with a whole KV cache per rank (dcp1) or a "
                        "sharded one (dcp); the one-GPU noise floor in either")
    c.add_argument("--date", default="", help="date of the GPU run (default: today)")
    c.add_argument("--bench-raw", default="",
                   help="bench_pcp.py raw run whose KV pools (pcp2, pcp2-dcp2) go into kv_capacity")
    c.add_argument("--serve-logs", nargs=2, metavar=("PCP2_LOG", "PCP2_DCP2_LOG"),
                   help="vllm serve logs whose KV pools go into kv_capacity (first choice)")
    add_teacher_parser(sub)
    add_features_parser(sub)
    args = ap.parse_args()
    if args.cmd == "models":
        build_models(args.out_dir, args.layers, args.device,
                     [n for n in args.only.split(",") if n])
    elif args.cmd == "run":
        run(args)
    elif args.cmd == "features":
        features(args)
    elif args.cmd == "teacher":
        teacher(args)
    else:
        compare(args)


if __name__ == "__main__":
    main()
