"""benchmarks/serving.py without a GPU: its ``vllm bench serve`` command line through
vLLM's own parser; its rows come from vLLM's result files."""
import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))
import serving  # noqa: E402


def test_bench_serve_arguments_parse_as_vllm_reads_them():
    from vllm.benchmarks.serve import add_cli_args
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = FlexibleArgumentParser()
    add_cli_args(parser)
    args = parser.parse_args(serving.bench_serve_args(
        "http://127.0.0.1:8123", "/m", "/tok", 16, "/out", "pcp1-c16.json", 4096, 64, 8))
    assert (args.backend, args.base_url, args.model, args.tokenizer) == (
        "vllm", "http://127.0.0.1:8123", "/m", "/tok")
    assert (args.dataset_name, args.random_input_len, args.random_output_len,
            args.num_prompts) == ("random", 4096, 64, 8)
    assert (args.max_concurrency, args.seed, args.ignore_eos) == (16, 16, True)
    assert (args.percentile_metrics, args.metric_percentiles) == ("ttft,tpot,itl", "50,90,99")
    assert (args.save_result, args.result_dir, args.result_filename) == (
        True, "/out", "pcp1-c16.json")


def test_concurrencies_and_sizes_are_options():
    args = serving.parse_args(["--tokenizer", "/tok", "--out", "s.json", "--concurrencies",
                               "1,4", "--input-len", "8192", "--num-prompts", "4"])
    assert args.concurrencies == [1, 4] and (args.input_len, args.output_len) == (8192, 128)
    assert args.num_prompts == 4


def test_serve_rows_read_vllm_bench_results(tmp_path):
    for conc, ttft in ((4, 120.5), (16, 410.0)):
        json.dump({"num_prompts": 32, "p99_ttft_ms": ttft, "mean_itl_ms": 9.5, "extra": 1},
                  open(tmp_path / f"pcp2-dcp2-c{conc}.json", "w"))
    rows = serving.serve_rows([str(p) for p in tmp_path.glob("*.json")])
    assert rows == [{"config": "pcp2-dcp2", "max_concurrency": c, "num_prompts": 32,
                     "p99_ttft_ms": t, "mean_itl_ms": 9.5} for c, t in ((16, 410.0), (4, 120.5))]
