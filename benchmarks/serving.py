"""Serving latency of named layouts: ``vllm serve`` of each, then ``vllm bench serve``.

    python benchmarks/serving.py --layouts pcp1,pcp2,pcp2-dcp2,tp2 --tokenizer DIR --out F
        [--concurrencies 4,16] [--input-len 16384] [--output-len 128] [--num-prompts 16]

One server at a time, in the order given: the bench model (dummy weights, ``--tokenizer``:
a Qwen2.5 tokenizer's folder), the layout's flags, vLLM's defaults (CUDA graphs, chunked
prefill, prefix caching). ``vllm bench serve`` sends random prompts at each concurrency
(seed = concurrency: prompts sent twice would hit the prefix cache). A row per layout and
concurrency: vLLM's TTFT, TPOT and ITL mean and percentiles (ms).
"""
from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
from argparse import ArgumentParser, RawDescriptionHelpFormatter

from latency import VLLM, bench_model, check_layouts, engine_env, results
from serve import serve  # tests/engine/serve.py: start, wait for /health, stop

KEYS = [f"{s}_{m}_ms" for m in ("ttft", "tpot", "itl") for s in ("mean", "p50", "p90", "p99")]
CONCURRENCIES, INPUT_LEN, OUTPUT_LEN, PROMPTS = (4, 16), 16384, 128, 16


def serve_rows(result_files: list[str]) -> list[dict]:
    """One row per ``vllm bench serve`` result file named ``LAYOUT-cN.json``."""
    rows = []
    for path in sorted(result_files):
        layout, _, conc = os.path.basename(path).removesuffix(".json").rpartition("-c")
        with open(path) as f:
            res = json.load(f)
        rows.append({"config": layout, "max_concurrency": int(conc),
                     "num_prompts": res.get("num_prompts"),
                     **{k: res[k] for k in KEYS if k in res}})
    return rows


def bench_serve_args(url: str, model: str, tokenizer: str, concurrency: int, out_dir: str,
                     name: str, input_len: int = INPUT_LEN, output_len: int = OUTPUT_LEN,
                     prompts: int = PROMPTS) -> list[str]:
    """The arguments of ``vllm bench serve`` against the server at ``url``: random
    prompts at ``concurrency`` (seed = concurrency), every output ``output_len`` tokens
    long, vLLM's result file ``out_dir/name``."""
    return ["--backend", "vllm", "--base-url", url, "--model", model, "--tokenizer", tokenizer,
            "--dataset-name", "random", "--random-input-len", str(input_len),
            "--random-output-len", str(output_len), "--num-prompts", str(prompts),
            "--max-concurrency", str(concurrency), "--seed", str(concurrency), "--ignore-eos",
            "--percentile-metrics", "ttft,tpot,itl", "--metric-percentiles", "50,90,99",
            "--save-result", "--result-dir", out_dir, "--result-filename", name]


def bench_layout(layout: str, model: str, args, out_dir: str) -> list[str]:
    """Serve ``layout`` and bench it at each concurrency: the result files made."""
    made = []
    try:
        with serve(layout, model, os.path.join(out_dir, f"{layout}-server.log"),
                   "--tokenizer", args.tokenizer, "--load-format", "dummy", "--seed", "0",
                   "--max-model-len", str(args.input_len + args.output_len + 64),
                   cuda_graphs=True, share_gpus=False) as server:
            for conc in args.concurrencies:
                name = f"{layout}-c{conc}.json"
                cmd = bench_serve_args(server.url, model, args.tokenizer, conc, out_dir, name,
                                       args.input_len, args.output_len, args.num_prompts)
                if subprocess.run([*VLLM, "bench", "serve", *cmd],
                                  env=engine_env(layout, dict(os.environ))).returncode == 0:
                    made.append(os.path.join(out_dir, name))
    except RuntimeError as exc:  # the server exited or never answered: the layout failed
        print(exc, file=sys.stderr)
    return made


def parse_args(argv: list[str]):
    ap = ArgumentParser(description=__doc__, formatter_class=RawDescriptionHelpFormatter)
    ap.add_argument("--layouts", default="pcp1,pcp2,pcp2-dcp2,tp2")
    ap.add_argument("--tokenizer", required=True)
    ap.add_argument("--concurrencies", default=",".join(map(str, CONCURRENCIES)))
    ap.add_argument("--input-len", type=int, default=INPUT_LEN)
    ap.add_argument("--output-len", type=int, default=OUTPUT_LEN)
    ap.add_argument("--num-prompts", type=int, default=PROMPTS)
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    args.concurrencies = [int(c) for c in args.concurrencies.split(",")]
    return args


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    layouts, out_dir = args.layouts.split(","), os.path.dirname(os.path.abspath(args.out))
    check_layouts(layouts)
    os.makedirs(out_dir, exist_ok=True)
    model = bench_model(args.input_len + args.output_len + 64)
    made = {layout: bench_layout(layout, model, args, out_dir) for layout in layouts}
    failed = [layout for layout, files in made.items()
              if len(files) < len(args.concurrencies)]
    meta = results.meta(shlex.join(["python", "benchmarks/serving.py", *argv]),
                        input_len=args.input_len, output_len=args.output_len,
                        num_prompts=args.num_prompts, layout_order=layouts,
                        failed=failed or None)
    rows = serve_rows([path for files in made.values() for path in files])
    results.write(out_dir, os.path.basename(args.out), {"meta": meta, "rows": rows})
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
