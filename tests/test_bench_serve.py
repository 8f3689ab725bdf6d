"""benchmarks/serving.py without a GPU: its rows come from vLLM's result files."""
import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))
import serving  # noqa: E402


def test_serve_rows_read_vllm_bench_results(tmp_path):
    for conc, ttft in ((4, 120.5), (16, 410.0)):
        json.dump({"num_prompts": 32, "p99_ttft_ms": ttft, "mean_itl_ms": 9.5, "extra": 1},
                  open(tmp_path / f"pcp2-dcp2-c{conc}.json", "w"))
    rows = serving.serve_rows([str(p) for p in tmp_path.glob("*.json")])
    assert rows == [{"config": "pcp2-dcp2", "max_concurrency": c, "num_prompts": 32,
                     "p99_ttft_ms": t, "mean_itl_ms": 9.5} for c, t in ((16, 410.0), (4, 120.5))]
