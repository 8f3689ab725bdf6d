"""Serving latency of named layouts: ``vllm serve`` of each, then ``vllm bench serve``.

    python benchmarks/serving.py --layouts pcp1,pcp2,pcp2-dcp2,tp2 --tokenizer DIR --out F

One server at a time: the bench model (dummy weights, ``--tokenizer``: a Qwen2.5 tokenizer's
folder), the layout's flags, vLLM's defaults. ``vllm bench serve`` sends random prompts at
concurrency 4 and 16 (seed = concurrency: prompts sent twice would hit the prefix cache). A
row per layout and concurrency: vLLM's TTFT, TPOT and ITL mean and percentiles (ms).
"""
from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
from argparse import ArgumentParser, RawDescriptionHelpFormatter

from latency import LAYOUTS, VLLM, bench_model, check_layouts, results
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


def bench_layout(layout: str, model: str, tokenizer: str, out_dir: str) -> list[str]:
    """Serve ``layout`` and bench it at each concurrency: the result files made."""
    made = []
    try:
        with serve(layout, model, os.path.join(out_dir, f"{layout}-server.log"),
                   "--tokenizer", tokenizer, "--load-format", "dummy", "--seed", "0",
                   "--max-model-len", str(INPUT_LEN + OUTPUT_LEN + 64),
                   cuda_graphs=True, share_gpus=False) as server:
            for conc in CONCURRENCIES:
                name = f"{layout}-c{conc}.json"
                if subprocess.run([
                        *VLLM, "bench", "serve", "--backend", "vllm", "--base-url", server.url,
                        "--model", model, "--tokenizer", tokenizer, "--dataset-name", "random",
                        "--random-input-len", str(INPUT_LEN),
                        "--random-output-len", str(OUTPUT_LEN), "--num-prompts", str(PROMPTS),
                        "--max-concurrency", str(conc), "--seed", str(conc), "--ignore-eos",
                        "--percentile-metrics", "ttft,tpot,itl", "--metric-percentiles",
                        "50,90,99", "--save-result", "--result-dir", out_dir,
                        "--result-filename", name],
                        env={**os.environ, **LAYOUTS[layout].env}).returncode == 0:
                    made.append(os.path.join(out_dir, name))
    except RuntimeError as exc:  # the server exited or never answered: the layout failed
        print(exc, file=sys.stderr)
    return made


if __name__ == "__main__":
    ap = ArgumentParser(description=__doc__, formatter_class=RawDescriptionHelpFormatter)
    ap.add_argument("--layouts", default="pcp1,pcp2,pcp2-dcp2,tp2")
    ap.add_argument("--tokenizer", required=True)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    layouts, out_dir = args.layouts.split(","), os.path.dirname(os.path.abspath(args.out))
    check_layouts(layouts)
    os.makedirs(out_dir, exist_ok=True)
    model = bench_model()
    made = {layout: bench_layout(layout, model, args.tokenizer, out_dir) for layout in layouts}
    failed = [layout for layout, files in made.items() if len(files) < len(CONCURRENCIES)]
    meta = results.meta(shlex.join(["python", "benchmarks/serving.py", *sys.argv[1:]]),
                        input_len=INPUT_LEN, output_len=OUTPUT_LEN, num_prompts=PROMPTS,
                        failed=failed or None)
    rows = serve_rows([path for files in made.values() for path in files])
    results.write(out_dir, os.path.basename(args.out), {"meta": meta, "rows": rows})
    sys.exit(1 if failed else 0)
