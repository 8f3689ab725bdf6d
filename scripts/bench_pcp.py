"""TTFT and decode ITL of PCP against one GPU, TP and stock vLLM, side by side.

    python scripts/bench_pcp.py run --configs pcp1-stock,pcp1,pcp2,tp2 \
        --prompt-lens 4096,32768,131072 --raw $OUT/bench-raw.json
    python scripts/bench_pcp.py report --raw bench-raw.json --git-rev REV \
        --command "..." --out-dir benchmarks/results

One engine per configuration, each in its own process, all on the same host in
one run. The model is the Qwen2.5-3B shape of configs/models with dummy weights
(36 layers, 16 q / 2 kv heads, head_dim 128). TTFT is the wall time of a
one-token generation of a fresh random prompt, prefill unchunked (``--chunk N``: vLLM's
chunked prefill at N tokens per step, so later chunks attend to earlier ones); ITL is
``(t(1 + n) - t(1)) / n`` at a 32K context, batch 1 and 8, with the prompts
already in the prefix cache so that both timings hold the same (tiny) prefill.
Medians of ``--repeats`` after one warm-up. ``pcp1-stock`` runs vLLM without
the plugin (``VLLM_PLUGINS`` names no plugin); every configuration uses
FlashInfer. With ``--parallel-one-gpu`` the one-GPU configurations run at the
same time, one per GPU (the two GPUs of one host are the same model).

TTFT also comes from vLLM's own ``vllm bench latency`` (scripts/bench_latency.py); this
script stays for what that tool cannot do: ITL at a context held in the prefix cache (it
times whole generations, cache off), the torch profiles, and the mixed-step profile.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)
from kv_capacity import pool_tokens  # noqa: E402
from layouts import LAYOUTS, engine_kwargs  # noqa: E402

# the configurations of scripts/layouts.py this bench runs (engine kwargs and env from there);
# pcp2-dcp2-queries / -keys: each way a split chunk reaches its context, forced
CONFIGS = ("pcp1-stock", "pcp1", "pcp2", "pcp2-min8k", "pcp2-split-all", "tp2", "pcp2-dcp2",
           "pcp2-dcp2-queries", "pcp2-dcp2-keys")
ONE_GPU = ("pcp1-stock", "pcp1")
ITL_CONTEXT, ITL_TOKENS, ITL_BATCHES = 32768, 128, (1, 8)
# --profile-mixed: tokens per request. The fresh prompt reaches the engine after the 8 cached
# ones; at 16 tokens (2e899bd) those had finished before it came, and no step was mixed.
MIXED_TOKENS = 64
DEFAULT_PROMPT_LENS = "4096,32768,131072"


def _model_dir(config_json: str, out_dir: str, max_len: int) -> str:
    """A dummy-weight model folder; positions cover ``max_len`` (a 128K prompt
    plus the generated tokens; unscaled RoPE does not depend on the bound)."""
    os.makedirs(out_dir, exist_ok=True)
    with open(config_json) as f:
        config = json.load(f)
    config["max_position_embeddings"] = max(config["max_position_embeddings"], max_len)
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(config, f, indent=1)
    return out_dir


def _max_len(prompt_lens: str) -> int:
    return max(int(x) for x in prompt_lens.split(",")) + ITL_TOKENS + 8


def _timed(llm, prompts, max_tokens: int) -> float:
    from vllm import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    start = time.perf_counter()
    llm.generate(prompts, params, use_tqdm=False)
    return time.perf_counter() - start


def measure(args) -> None:
    """Worker: one engine, every prompt length and ITL point."""
    import numpy as np
    from vllm import LLM

    lens = [int(x) for x in args.prompt_lens.split(",")]
    layout = LAYOUTS[args.config]
    max_len = _max_len(args.prompt_lens)
    extra = {}
    if args.profile_len or args.profile_decode:
        from vllm.config import ProfilerConfig

        extra["profiler_config"] = ProfilerConfig(
            profiler="torch", torch_profiler_dir=os.path.abspath(args.profile_dir),
            torch_profiler_with_stack=args.profile_stack, torch_profiler_use_gzip=True)
    llm = LLM(model=args.model, load_format="dummy", skip_tokenizer_init=True,
              dtype="bfloat16", max_model_len=max_len,
              max_num_batched_tokens=args.chunk or max_len,
              max_num_seqs=max(ITL_BATCHES), enable_prefix_caching=True,
              gpu_memory_utilization=0.85, attention_backend=layout.attention_backend,
              enforce_eager=args.eager, seed=0, **engine_kwargs(args.config), **extra)
    rng = np.random.default_rng(0)

    def prompts(n, batch):
        return [{"prompt_token_ids": rng.integers(100, 100_000, n).tolist()}
                for _ in range(batch)]

    cache = llm.llm_engine.vllm_config.cache_config
    rows = []

    def save() -> None:  # after every row: a later failure keeps what was measured
        with open(args.out, "w") as f:
            json.dump({"config": args.config, "rows": rows,
                       "kv_capacity_tokens": pool_tokens(cache, layout.dcp)}, f)

    save()
    for n in lens:
        _timed(llm, prompts(n, 1), 1)
        ttft = [_timed(llm, prompts(n, 1), 1) for _ in range(args.repeats)]
        rows.append({"kind": "ttft", "prompt_len": n, "ttft_s": ttft})
        save()
        print(f"{args.config} ttft {n}: {statistics.median(ttft):.4f} s", flush=True)
    cached_by_batch = _measure_itl(llm, prompts, args, rows, save)
    if args.profile_len or args.profile_decode:  # after the timings, every rank
        llm.start_profile()
        if args.profile_len and args.profile_mixed:  # a fresh prefill beside 8 decodes
            batch = max(ITL_BATCHES)
            _timed(llm, cached_by_batch[batch] + prompts(args.profile_len, 1), MIXED_TOKENS)
        elif args.profile_len:  # one fresh prefill
            _timed(llm, prompts(args.profile_len, 1), 1)
        else:  # decode steps of one request at the ITL context (its prefix cached)
            _timed(llm, cached_by_batch[1], 1 + args.profile_decode)
        llm.stop_profile()  # profiler_out_RANK.txt: kernels by CUDA time


def _measure_itl(llm, prompts, args, rows: list, save) -> dict:
    """ITL rows at ``ITL_CONTEXT`` per batch size; returns each batch's prompts."""
    cached_by_batch = {}
    for batch in ITL_BATCHES:
        cached = cached_by_batch[batch] = prompts(ITL_CONTEXT, batch)
        _timed(llm, cached, 1 + ITL_TOKENS)  # warm-up; fills the prefix cache
        itl = []
        for _ in range(args.itl_repeats):  # eager decode steps spread: more samples
            first = _timed(llm, cached, 1)
            full = _timed(llm, cached, 1 + ITL_TOKENS)
            itl.append((full - first) / ITL_TOKENS)
        rows.append({"kind": "itl", "context": ITL_CONTEXT, "batch": batch, "itl_s": itl})
        save()
        print(f"{args.config} itl batch {batch}: {statistics.median(itl) * 1e3:.2f} ms",
              flush=True)
    return cached_by_batch


def bench_model(out_dir: str = "/tmp/bench-models/qwen2.5-3b-shape",
                prompt_lens: str = DEFAULT_PROMPT_LENS) -> str:
    """The bench model's folder (config only: dummy weights), for these prompts."""
    return _model_dir(os.path.join(ROOT, "configs", "models", "qwen2.5-3b-shape.json"),
                      out_dir, _max_len(prompt_lens))


def _profile_args(args, config: str) -> list[str]:
    """The measure worker's profiler flags for ``config`` (none if it is not profiled)."""
    if not (args.profile_len or args.profile_decode) or (
            args.profile_configs and config not in args.profile_configs.split(",")):
        return []
    out_dir = os.path.join(os.path.dirname(os.path.abspath(args.raw)), f"profile-{config}")
    return (["--profile-len", str(args.profile_len), "--profile-decode",
             str(args.profile_decode), "--profile-dir", out_dir]
            + (["--profile-mixed"] if args.profile_mixed else [])
            + (["--profile-stack"] if args.profile_stack else []))


def run(args) -> None:
    model = bench_model(prompt_lens=args.prompt_lens)
    from concurrent.futures import ThreadPoolExecutor

    from gpu_runs import run_worker, versions

    raw = {"versions": versions(), "eager": args.eager, "chunk": args.chunk,
           "parallel_one_gpu": args.parallel_one_gpu, "runs": []}

    def one(config: str, env: dict) -> None:
        out = f"/tmp/bench-{config}.json"
        cmd = [sys.executable, __file__, "measure", "--config", config, "--model", model,
               "--prompt-lens", args.prompt_lens, "--repeats", str(args.repeats),
               "--itl-repeats", str(args.itl_repeats), "--chunk", str(args.chunk),
               "--out", out] + (["--eager"] if args.eager else []) + _profile_args(args, config)
        log = os.path.join(os.path.dirname(os.path.abspath(args.raw)), f"{config}.log")
        raw["runs"].append(run_worker(cmd, out, "rows", {"config": config},
                                      {**LAYOUTS[config].env, **env},
                                      extra=("kv_capacity_tokens",), log=log))
        with open(args.raw, "w") as f:
            json.dump(raw, f)

    configs = args.configs.split(",")
    together = [c for c in configs if c in ONE_GPU] if args.parallel_one_gpu else []
    with ThreadPoolExecutor(max(1, len(together))) as pool:
        list(pool.map(one, together, [{"CUDA_VISIBLE_DEVICES": str(i)}
                                      for i in range(len(together))]))
    for config in configs:
        if config not in together:
            one(config, {})


def _load_raw(paths: list[str]) -> dict:
    """Several raw runs of one revision on one host (e.g. two halves of the configs)
    as one."""
    raw = {"runs": []}
    for path in paths:
        with open(path) as f:
            part = json.load(f)
        raw = {**part, "runs": raw["runs"] + part["runs"]}
    return raw


def report(args) -> None:
    """Write ttft.json, itl.json and ttft.png from one raw run, if given; serve.json
    from the ``vllm bench serve`` results of scripts/bench_serve.sh, gsm8k.json from
    the scripts/eval_gsm8k.sh results, if given. Without ``--raw`` the versions come
    from ``--versions-from`` (any raw file of the same run)."""
    import glob

    from bench_report import gsm8k_rows, serve_rows, write_reports

    raw = _load_raw(args.raw or [])
    if not args.raw:
        if not args.versions_from:
            raise SystemExit("report: give --raw, or --versions-from with --serve-dir/--gsm8k-dir")
        raw["versions"] = _load_raw([args.versions_from])["versions"]
    meta = {"git_rev": args.git_rev, "command": args.command, **raw["versions"],
            "date": args.date or datetime.date.today().isoformat()}
    os.makedirs(args.out_dir, exist_ok=True)
    if args.raw:  # the serving runs' flags are in their command, not in the raw run
        print(json.dumps(write_reports(raw, {
            **meta, "enforce_eager": raw["eager"],
            **({"max_num_batched_tokens": raw["chunk"]} if raw.get("chunk") else {})},
            args.out_dir), indent=1))
    if args.serve_dir:
        rows = serve_rows(glob.glob(os.path.join(args.serve_dir, "*-c*.json")))
        with open(os.path.join(args.out_dir, "serve.json"), "w") as f:
            json.dump({"meta": {**meta, "command": args.serve_command,
                                **({"note": args.serve_note} if args.serve_note else {})},
                       "rows": rows}, f, indent=1)
    if args.gsm8k_dir:
        gsm8k = gsm8k_rows(glob.glob(os.path.join(args.gsm8k_dir, "gsm8k-*.json")))
        with open(os.path.join(args.out_dir, "gsm8k.json"), "w") as f:
            json.dump({"meta": {**meta, "command": args.gsm8k_command}, **gsm8k}, f, indent=1)


def print_tables(args) -> None:
    """The README's performance tables, from the committed result files."""
    from bench_report import serve_table, timing_table

    def load(path):
        with open(path) as f:
            return json.load(f)

    if args.ttft:
        print(timing_table(load(args.ttft), load(args.itl) if args.itl else None) + "\n")
    if args.serve:
        print(serve_table([load(p) for p in args.serve]))


def _add_bench_parsers(sub) -> None:
    """run, measure (one engine, in its own process) and model."""
    r = sub.add_parser("run")
    r.add_argument("--configs", default="pcp1-stock,pcp1,pcp2,tp2")
    r.add_argument("--prompt-lens", default=DEFAULT_PROMPT_LENS)
    r.add_argument("--repeats", type=int, default=3)
    r.add_argument("--itl-repeats", type=int, default=7)
    r.add_argument("--eager", action="store_true")
    r.add_argument("--chunk", type=int, default=0,
                   help="--max-num-batched-tokens of every engine (default: the longest "
                        "prompt, prefill unchunked)")
    r.add_argument("--parallel-one-gpu", action="store_true",
                   help="run the one-GPU configurations at once, one per GPU")
    r.add_argument("--profile-len", type=int, default=0,
                   help="after the timings, profile one prefill of this many tokens "
                        "(vLLM's torch profiler; tables in profile-CONFIG/ beside --raw)")
    r.add_argument("--profile-decode", type=int, default=0,
                   help="instead of a prefill, profile this many decode steps at the ITL "
                        "context, batch 1")
    r.add_argument("--profile-mixed", action="store_true",
                   help="with --profile-len: the prefill runs beside the 8 cached ITL "
                        "requests decoding (serving's mixed steps; with --chunk, chunks "
                        "with context)")
    r.add_argument("--profile-stack", action="store_true",
                   help="record Python stacks too (slower steps; trace_steps.py "
                        "--python-out attributes the attention layer's host time)")
    r.add_argument("--profile-configs", default="",
                   help="comma-separated configurations to profile (default: all)")
    r.add_argument("--raw", required=True)
    m = sub.add_parser("measure")
    m.add_argument("--config", choices=sorted(CONFIGS), required=True)
    m.add_argument("--model", required=True)
    m.add_argument("--prompt-lens", required=True)
    m.add_argument("--repeats", type=int, default=3)
    m.add_argument("--itl-repeats", type=int, default=7)
    m.add_argument("--eager", action="store_true")
    m.add_argument("--chunk", type=int, default=0)
    m.add_argument("--profile-len", type=int, default=0)
    m.add_argument("--profile-decode", type=int, default=0)
    m.add_argument("--profile-mixed", action="store_true")
    m.add_argument("--profile-stack", action="store_true")
    m.add_argument("--profile-dir", default="")
    m.add_argument("--out", required=True)
    b = sub.add_parser("model", help="write the bench model's folder (for vllm serve)")
    b.add_argument("--out-dir", default="/tmp/bench-models/qwen2.5-3b-shape")


def _add_report_parsers(sub) -> None:
    """report (result files from raw runs) and table (the README's tables)."""
    p = sub.add_parser("report")
    p.add_argument("--raw", nargs="+", help="bench_pcp.py run results (ttft/itl)")
    p.add_argument("--versions-from", help="without --raw: a raw file of the same run")
    p.add_argument("--date", help="date of the GPU run (default: today)")
    p.add_argument("--git-rev", required=True)
    p.add_argument("--command", required=True)
    p.add_argument("--out-dir", default=os.path.join(ROOT, "benchmarks", "results"))
    p.add_argument("--serve-dir", help="folder of scripts/bench_serve.sh results")
    p.add_argument("--serve-command", default="", help="how the serve results were made")
    p.add_argument("--serve-note", default="", help="stored as serve.json's meta.note")
    p.add_argument("--gsm8k-dir", help="folder of scripts/eval_gsm8k.sh results gsm8k-CONFIG.json")
    p.add_argument("--gsm8k-command", default="", help="how the gsm8k results were made")
    t = sub.add_parser("table", help="print the README's markdown tables from result files")
    t.add_argument("--ttft", help="ttft.json or ttft-chunked.json")
    t.add_argument("--itl", help="itl.json: its columns join the --ttft table")
    t.add_argument("--serve", nargs="+", help="serve.json files: one serving table")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    _add_bench_parsers(sub)
    _add_report_parsers(sub)
    args = ap.parse_args()
    if args.cmd == "table":
        print_tables(args)
        return
    if args.cmd == "model":
        print(bench_model(args.out_dir))
        return
    {"run": run, "measure": measure, "report": report}[args.cmd](args)


if __name__ == "__main__":
    main()
