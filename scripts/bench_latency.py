r"""TTFT of the named configurations through vLLM's own ``vllm bench latency``.

    python scripts/bench_latency.py --configs pcp1,pcp2,pcp2-dcp2 \
        --input-lens 4096,32768,131072 --eager --out $OUT/latency.json

One ``vllm bench latency --input-len N --output-len 1 --batch-size 1`` process per
configuration and prompt length (the tool takes one input length per process), one after
another, each with the engine flags of scripts/layouts.py (:func:`layouts.serve_flags`;
``pcp1-stock`` with its env, vLLM without the plugin) and the engine of
``bench_pcp.py run``: the bench model of configs/models with dummy weights (the folder
bench_pcp.py writes), bf16, ``--max-model-len`` and ``--max-num-batched-tokens`` of
bench_pcp.py's (prefill unchunked unless ``--chunk``), gpu_memory_utilization 0.85.

With ``--output-len 1`` one timed generate is the prefill and the sampling of the first
token, so vLLM's latency is the TTFT of a batch-1 request. vLLM's tool sends the same
prompt every iteration with the prefix cache off (its default), so each iteration is a
whole prefill. ``ttft_s`` is vLLM's 50th percentile (the median, as bench_pcp.py's),
``ttft_mean_s`` its ``avg_latency``.

The output file: ``meta`` (the command, git revision, versions, date, settings), ``runs``
(per configuration and prompt length: the vllm command, its return code and seconds,
vLLM's own ``--output-json`` under ``vllm`` unchanged, the TTFT taken from it) and
``ratios`` (each configuration's TTFT over pcp1's at the same length,
``CONFIG/pcp1@N``). Each engine's output goes to ``CONFIG-N.log`` in ``--log-dir``.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import shlex
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)
from bench_pcp import _max_len, _model_dir  # noqa: E402
from layouts import LAYOUTS, serve_flags  # noqa: E402

# the `vllm` console script, as scripts/serve_lib.sh runs it
VLLM_CLI = [sys.executable, "-c", "from vllm.entrypoints.cli.main import main; main()"]
DEFAULT_CONFIGS = "pcp1-stock,pcp1,pcp2,pcp2-dcp2,tp2"
DEFAULT_INPUT_LENS = "4096,32768,131072"
DEFAULT_MODEL_CONFIG = os.path.join(ROOT, "configs", "models", "qwen2.5-3b-shape.json")
BASELINE = "pcp1"
GPU_MEMORY_UTILIZATION = 0.85  # bench_pcp.py's
MAX_NUM_SEQS = 8  # bench_pcp.py's engine (its ITL batches); one request runs here


def latency_args(config: str, input_len: int, model: str, max_len: int, output_json: str,
                 eager: bool = False, chunk: int = 0, warmup: int = 1, iters: int = 3
                 ) -> list[str]:
    """The arguments of ``vllm bench latency`` for one configuration and prompt length."""
    return ["--model", model, "--load-format", "dummy", "--skip-tokenizer-init",
            "--disable-detokenize", "--dtype", "bfloat16", "--seed", "0",
            "--input-len", str(input_len), "--output-len", "1", "--batch-size", "1",
            "--num-iters-warmup", str(warmup), "--num-iters", str(iters),
            "--max-model-len", str(max_len), "--max-num-batched-tokens", str(chunk or max_len),
            "--max-num-seqs", str(MAX_NUM_SEQS),
            "--gpu-memory-utilization", str(GPU_MEMORY_UTILIZATION),
            "--output-json", output_json, *serve_flags(config, cuda_graphs=not eager)]


def ttft_of(result: dict) -> dict:
    """The TTFT of one ``vllm bench latency --output-len 1`` result (its --output-json:
    ``avg_latency``, ``latencies``, ``percentiles`` keyed by percentage, strings once
    written as JSON)."""
    percentiles = {str(k): v for k, v in result["percentiles"].items()}
    return {"ttft_s": percentiles["50"], "ttft_mean_s": result["avg_latency"]}


def ratios(runs: list[dict], baseline: str = BASELINE) -> dict:
    """``CONFIG/BASELINE@N``: each configuration's TTFT over the baseline's at the same
    prompt length, for every length both have."""
    ttft = {(r["config"], r["input_len"]): r["ttft_s"] for r in runs if "ttft_s" in r}
    return {f"{config}/{baseline}@{n}": round(value / ttft[(baseline, n)], 4)
            for (config, n), value in ttft.items()
            if config != baseline and ttft.get((baseline, n))}


def run_one(config: str, input_len: int, model: str, max_len: int, args) -> dict:
    """One ``vllm bench latency`` process: its entry of ``runs``."""
    from gpu_runs import run_worker

    name = f"{config}-{input_len}"
    out = os.path.join(args.log_dir, f"{name}.json")
    cmd = VLLM_CLI + ["bench", "latency"] + latency_args(
        config, input_len, model, max_len, out, eager=args.eager, chunk=args.chunk,
        warmup=args.num_iters_warmup, iters=args.num_iters)
    # run_worker copies the named keys of the file it reads: none here ("vllm" is not
    # one of vLLM's); the whole file goes in below, unchanged
    entry = run_worker(cmd, out, "vllm", {"config": config, "input_len": input_len},
                       LAYOUTS[config].env, log=os.path.join(args.log_dir, f"{name}.log"))
    entry["command"] = shlex.join(["vllm", *cmd[len(VLLM_CLI):]])
    if os.path.exists(out):  # run_worker removed any earlier file: this one is this run's
        with open(out) as f:
            entry["vllm"] = json.load(f)
        entry.update(ttft_of(entry["vllm"]))
    return entry


def meta(args, max_len: int) -> dict:
    from gpu_runs import versions
    from kernel_choice_lib import git_rev

    return {"command": args.command or shlex.join(
                ["python", "scripts/bench_latency.py", *sys.argv[1:]]),
            "git_rev": git_rev(), **versions(), "date": datetime.date.today().isoformat(),
            "tool": "vllm bench latency", "output_len": 1, "batch_size": 1,
            "num_iters_warmup": args.num_iters_warmup, "num_iters": args.num_iters,
            "enforce_eager": args.eager, "max_model_len": max_len,
            "max_num_batched_tokens": args.chunk or max_len,
            "model_config": os.path.relpath(args.model_config, ROOT)}


def run(args) -> dict:
    """Every configuration at every length; the output file is rewritten after each
    process (a later failure keeps what was measured)."""
    configs, lens = args.configs.split(","), [int(n) for n in args.input_lens.split(",")]
    unknown = [c for c in configs if c not in LAYOUTS]
    if unknown:
        raise SystemExit(f"unknown configurations {unknown}: see scripts/layouts.py")
    args.log_dir = args.log_dir or os.path.dirname(os.path.abspath(args.out))
    os.makedirs(args.log_dir, exist_ok=True)
    max_len = _max_len(args.input_lens)
    model = _model_dir(args.model_config, args.model_dir or os.path.join(
        "/tmp/bench-models", os.path.basename(args.model_config).removesuffix(".json")),
        max_len)
    result = {"meta": meta(args, max_len), "runs": [], "ratios": {}}
    for config in configs:
        for n in lens:
            result["runs"].append(run_one(config, n, model, max_len, args))
            result["ratios"] = ratios(result["runs"])
            with open(args.out, "w") as f:
                json.dump(result, f, indent=1)
    return result


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--configs", default=DEFAULT_CONFIGS,
                    help="comma-separated configurations of scripts/layouts.py")
    ap.add_argument("--input-lens", default=DEFAULT_INPUT_LENS,
                    help="comma-separated prompt lengths (one vllm process each)")
    ap.add_argument("--num-iters-warmup", type=int, default=1)
    ap.add_argument("--num-iters", type=int, default=3)
    ap.add_argument("--eager", action="store_true",
                    help="--enforce-eager (default: vLLM's CUDA graphs and torch.compile)")
    ap.add_argument("--chunk", type=int, default=0,
                    help="--max-num-batched-tokens (default: bench_pcp.py's, the longest "
                         "prompt: prefill unchunked)")
    ap.add_argument("--model-config", default=DEFAULT_MODEL_CONFIG,
                    help="a config.json of configs/models (dummy weights)")
    ap.add_argument("--model-dir", default="",
                    help="the model folder to write (default /tmp/bench-models/NAME)")
    ap.add_argument("--log-dir", default="",
                    help="each run's vLLM JSON and log (default: beside --out)")
    ap.add_argument("--command", default="", help="meta.command (default: this command)")
    ap.add_argument("--out", required=True)
    return ap.parse_args(argv)


def main() -> None:
    result = run(parse_args())
    print(json.dumps(result["ratios"], indent=1))
    sys.exit(1 if any(r["returncode"] for r in result["runs"]) else 0)


if __name__ == "__main__":
    main()
