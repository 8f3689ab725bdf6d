"""TTFT (and ITL) of named layouts through vLLM's own ``vllm bench latency``.

    python benchmarks/latency.py --layouts pcp1,pcp2 --input-lens 32768,131072 --eager --out F
        [--itl-output-len 129] [--baseline pcp1]

A ``vllm bench latency --output-len 1 --batch-size 1`` process per layout (tests/engine/
layouts.py) and length on the bench model (dummy weights, no prefix cache): ``ttft_s`` is
vLLM's median, ``ratios`` a layout's over the baseline's. ``--itl-output-len K``: a second
process per layout and length generates K tokens; ``itl_ms`` is its median latency less the
TTFT, over the K - 1 decode steps, ``itl_ratios`` a layout's over the baseline's. Each run
keeps the fastest and slowest of its iterations (``spread_s``), and ``itl_ms_best`` /
``itl_ratios_best`` take the fastest iterations in place of the medians: where the two ratios
disagree, the difference is noise. Layouts run one after another in the order given. vLLM's
files and logs go beside ``--out``.
"""
from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
import time
from argparse import ArgumentParser, RawDescriptionHelpFormatter

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tests", "engine"))
import results  # noqa: E402
from layouts import engine_env, gpus, serve_flags  # noqa: E402

VLLM = [sys.executable, "-m", "vllm.entrypoints.cli.main"]
MODEL_CONFIG = os.path.join("configs", "models", "qwen2.5-3b-shape.json")
MODEL_DIR = "/tmp/bench-models/qwen2.5-3b-shape"
LEN_MARGIN = 136  # model length past the longest prompt


def bench_model(max_len: int = 131072 + LEN_MARGIN) -> str:
    """Write the bench model's folder (config.json only: dummy weights); its path."""
    with open(os.path.join(ROOT, MODEL_CONFIG)) as f:
        config = json.load(f)
    config["max_position_embeddings"] = max(config["max_position_embeddings"], max_len)
    os.makedirs(MODEL_DIR, exist_ok=True)
    with open(os.path.join(MODEL_DIR, "config.json"), "w") as f:
        json.dump(config, f, indent=1)
    return MODEL_DIR


def check_layouts(names: list[str]) -> None:
    """Refuse layouts with more ranks than this host's GPUs (shared GPUs time nothing)."""
    if short := [n for n in names if gpus(n) > torch.cuda.device_count()]:
        raise SystemExit(f"{short} want a GPU per rank: ranks sharing a GPU time nothing")


def latency_args(layout: str, input_len: int, max_len: int, out_json: str,
                 eager: bool = False, chunk: int = 0, iters: int = 3,
                 output_len: int = 1) -> list[str]:
    """The arguments of ``vllm bench latency`` for one layout, prompt length and output
    length."""
    return ["--model", MODEL_DIR, "--load-format", "dummy", "--skip-tokenizer-init",
            "--disable-detokenize", "--dtype", "bfloat16", "--seed", "0",
            "--input-len", str(input_len), "--output-len", str(output_len), "--batch-size", "1",
            "--num-iters-warmup", "1", "--num-iters", str(iters),
            "--max-model-len", str(max_len), "--max-num-batched-tokens", str(chunk or max_len),
            "--max-num-seqs", "8", "--gpu-memory-utilization", "0.85",
            "--output-json", out_json, *serve_flags(layout, cuda_graphs=not eager)]


def ratios(runs: list[dict], baseline: str = "pcp1", key: str = "ttft_s") -> dict:
    """``LAYOUT/BASELINE@N``: ``key`` over the baseline's at each length both have."""
    value = {(r["config"], r["input_len"]): r[key] for r in runs if key in r}
    return {f"{name}/{baseline}@{n}": round(v / value[(baseline, n)], 4)
            for (name, n), v in value.items()
            if name != baseline and value.get((baseline, n))}


def add_itl(runs: list[dict]) -> None:
    """``itl_ms`` of each run of K > 1 tokens: its median latency less the TTFT of the same
    layout and length, over the K - 1 decode steps; ``itl_ms_best`` the same of the fastest
    iterations (``spread_s[0]`` of both runs), which the slower iterations' noise leaves out."""
    first = {(r["config"], r["input_len"]): r for r in runs if "ttft_s" in r}
    for r in runs:
        one = first.get((r["config"], r["input_len"]))
        if "latency_s" not in r or one is None:
            continue
        steps = r["output_len"] - 1
        r["itl_ms"] = round((r["latency_s"] - one["ttft_s"]) / steps * 1e3, 4)
        if r.get("spread_s") and one.get("spread_s"):
            r["itl_ms_best"] = round((r["spread_s"][0] - one["spread_s"][0]) / steps * 1e3, 4)


def run_one(layout: str, input_len: int, max_len: int, args, output_len: int = 1) -> dict:
    """One ``vllm bench latency`` process (vLLM's files: OUT_DIR/LAYOUT-N[-outK].json,
    .log): ``ttft_s`` at one output token, else ``latency_s``."""
    suffix = "" if output_len == 1 else f"-out{output_len}"
    name = os.path.join(os.path.dirname(os.path.abspath(args.out)),
                        f"{layout}-{input_len}{suffix}")
    cmd = ["bench", "latency", *latency_args(layout, input_len, max_len, name + ".json",
                                             args.eager, args.chunk, args.num_iters,
                                             output_len)]
    if os.path.exists(name + ".json"):
        os.remove(name + ".json")
    start = time.perf_counter()
    with open(name + ".log", "w") as log:
        rc = subprocess.run(VLLM + cmd, stdout=log, stderr=subprocess.STDOUT,
                            env=engine_env(layout, dict(os.environ))).returncode
    run = {"config": layout, "input_len": input_len, "output_len": output_len,
           "returncode": rc, "seconds": round(time.perf_counter() - start, 1),
           "command": shlex.join(["vllm", *cmd])}
    if rc == 0 and os.path.exists(name + ".json"):
        with open(name + ".json") as f:
            run["vllm"] = json.load(f)
        median, mean = run["vllm"]["percentiles"]["50"], run["vllm"]["avg_latency"]
        run["spread_s"] = spread(run["vllm"].get("latencies"))
        run.update(dict(ttft_s=median, ttft_mean_s=mean) if output_len == 1
                   else dict(latency_s=median, latency_mean_s=mean))
    return run


def spread(latencies: list[float] | None) -> list[float] | None:
    """The fastest and slowest of a run's timed iterations (s): what its median may move by."""
    return [round(min(latencies), 6), round(max(latencies), 6)] if latencies else None


def summarize(result: dict, baseline: str) -> None:
    """``ratios`` (TTFT), ``itl_ratios`` and ``itl_ratios_best`` of ``result``'s runs over
    the baseline's."""
    add_itl(result["runs"])
    result["ratios"] = ratios(result["runs"], baseline)
    result["itl_ratios"] = ratios(result["runs"], baseline, key="itl_ms")
    result["itl_ratios_best"] = ratios(result["runs"], baseline, key="itl_ms_best")


def parse_args(argv: list[str]):
    ap = ArgumentParser(description=__doc__, formatter_class=RawDescriptionHelpFormatter)
    ap.add_argument("--layouts", default="pcp1-stock,pcp1,pcp2,pcp2-dcp2,tp2")
    ap.add_argument("--input-lens", default="4096,32768,131072")
    ap.add_argument("--eager", action="store_true", help="--enforce-eager")
    ap.add_argument("--chunk", type=int, default=0, help="--max-num-batched-tokens (default: none)")
    ap.add_argument("--num-iters", type=int, default=3)
    ap.add_argument("--itl-output-len", type=int, default=0,
                    help="K > 1: also time K output tokens, for the ITL (default: TTFT only)")
    ap.add_argument("--baseline", default="pcp1", help="the layout ratios are taken over")
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    if args.itl_output_len == 1 or args.itl_output_len < 0:
        ap.error("--itl-output-len: 0 (off) or at least 2")
    return args


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    layouts, lens = args.layouts.split(","), [int(n) for n in args.input_lens.split(",")]
    check_layouts(layouts)
    max_len = max(lens) + max(LEN_MARGIN, args.itl_output_len + 8)
    out_dir = os.path.dirname(os.path.abspath(args.out))
    os.makedirs(out_dir, exist_ok=True)
    bench_model(max_len)
    result = {"meta": results.meta(
        shlex.join(["python", "benchmarks/latency.py", *argv]), tool="vllm bench latency",
        output_len=1, itl_output_len=args.itl_output_len or None, batch_size=1,
        num_iters_warmup=1, num_iters=args.num_iters, enforce_eager=args.eager,
        max_model_len=max_len, max_num_batched_tokens=args.chunk or max_len,
        model_config=MODEL_CONFIG, layout_order=layouts, baseline=args.baseline),
        "runs": [], "ratios": {}, "itl_ratios": {}, "itl_ratios_best": {}}
    outputs = [1] + ([args.itl_output_len] if args.itl_output_len else [])
    for layout in layouts:
        for n in lens:  # the result file is rewritten after each process
            for k in outputs:
                result["runs"].append(run_one(layout, n, max_len, args, k))
                summarize(result, args.baseline)
                results.write(out_dir, os.path.basename(args.out), result)
    print(json.dumps({"ttft": result["ratios"], "itl": result["itl_ratios"]}, indent=1))
    return 1 if any(r["returncode"] for r in result["runs"]) else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
