"""benchmarks/latency.py without a GPU: its command lines give the layout's engine through
vLLM's own parser; TTFT and ITL ratios come out of the runs."""
import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))
import latency  # noqa: E402


@pytest.mark.parametrize("layout,sizes,knobs", [
    ("pcp1", (1, 1, 1), {}), ("tp2", (1, 1, 2), {}),
    ("pcp2-dcp2-keys", (2, 2, 1), {"pcp_dcp_context_exchange": "keys"})])
@pytest.mark.parametrize("eager,output_len", [(True, 1), (False, 129)])
def test_command_lines_parse_into_the_layouts_engine(monkeypatch, layout, sizes, knobs, eager,
                                                     output_len):
    """Through ``vllm bench latency``'s own parser, on vLLM's CPU platform (as its CLI)."""
    from vllm import platforms
    from vllm.benchmarks.latency import add_cli_args
    from vllm.engine import arg_utils
    from vllm.platforms.cpu import CpuPlatform
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    if platforms.current_platform.is_unspecified():
        monkeypatch.setattr(platforms, "current_platform", CpuPlatform(), raising=False)
    parser = FlexibleArgumentParser()
    add_cli_args(parser)
    args = parser.parse_args(latency.latency_args(layout, 32768, 32904, "/l.json", eager=eager,
                                                  iters=5, output_len=output_len))
    arg_utils._compute_kwargs.cache_clear()  # defaults of this platform
    assert (args.input_len, args.output_len, args.batch_size, args.num_iters) == (
        32768, output_len, 1, 5)
    assert args.output_json == "/l.json" and args.disable_detokenize
    engine = arg_utils.EngineArgs.from_cli_args(args)
    assert (engine.prefill_context_parallel_size, engine.decode_context_parallel_size,
            engine.tensor_parallel_size) == sizes
    assert (engine.additional_config or {}) == knobs and engine.load_format == "dummy"
    assert engine.max_model_len == engine.max_num_batched_tokens == 32904
    assert engine.enforce_eager is eager and engine.enable_prefix_caching is False
    fusion = engine.compilation_config.pass_config.fuse_allreduce_rms
    assert fusion is (False if sizes[2] > 1 and not eager else None)


def test_ratios_are_ttft_over_the_baselines_at_each_length_both_ran():
    runs = [{"config": "pcp1", "input_len": 4096, "ttft_s": 0.5},
            {"config": "pcp1", "input_len": 32768, "ttft_s": 4.0},
            {"config": "pcp2", "input_len": 4096, "ttft_s": 0.4},
            {"config": "pcp2", "input_len": 32768, "ttft_s": 2.2},
            {"config": "pcp2-dcp2", "input_len": 32768, "returncode": 1},
            {"config": "tp2", "input_len": 131072, "ttft_s": 9.0}]
    assert latency.ratios(runs) == {"pcp2/pcp1@4096": 0.8, "pcp2/pcp1@32768": 0.55}
    assert latency.ratios(runs, baseline="pcp2") == {"pcp1/pcp2@4096": 1.25,
                                                     "pcp1/pcp2@32768": round(4.0 / 2.2, 4)}


def test_itl_is_the_latency_past_the_first_token_over_the_decode_steps():
    runs = [{"config": "pcp1-stock", "input_len": 32768, "output_len": 1, "ttft_s": 0.6},
            {"config": "pcp1-stock", "input_len": 32768, "output_len": 129, "latency_s": 1.88},
            {"config": "pcp1", "input_len": 32768, "output_len": 1, "ttft_s": 0.62},
            {"config": "pcp1", "input_len": 32768, "output_len": 129, "latency_s": 1.9},
            {"config": "pcp2", "input_len": 32768, "output_len": 129, "latency_s": 1.0}]
    result = {"runs": runs}
    latency.summarize(result, "pcp1-stock")
    assert runs[1]["itl_ms"] == 10.0 and runs[3]["itl_ms"] == 10.0
    assert "itl_ms" not in runs[4]  # no TTFT of that layout to take away
    assert result["itl_ratios"] == {"pcp1/pcp1-stock@32768": 1.0}
    assert result["ratios"] == {"pcp1/pcp1-stock@32768": round(0.62 / 0.6, 4)}


@pytest.mark.parametrize("value", ["1", "-3"])
def test_an_itl_of_one_token_is_refused(value):
    with pytest.raises(SystemExit):
        latency.parse_args(["--out", "x.json", "--itl-output-len", value])
    assert latency.parse_args(["--out", "x.json", "--itl-output-len", "2"]).itl_output_len == 2


def test_best_itl_takes_the_fastest_iterations_of_both_runs():
    """The median ITL of noisy decode runs can part where the fastest iterations agree."""
    runs = [{"config": c, "input_len": 32768, "output_len": k, "vllm": {"latencies": v}}
            for c, k, v in [("pcp1-stock", 1, [0.59, 0.61, 0.606]),
                            ("pcp1-stock", 33, [1.115, 1.476, 1.311]),
                            ("pcp1", 1, [0.595, 0.612, 0.6]),
                            ("pcp1", 33, [1.141, 1.332, 1.157])]]
    for r in runs:
        r["spread_s"] = latency.spread(r["vllm"]["latencies"])
        r["ttft_s" if r["output_len"] == 1 else "latency_s"] = sorted(r["vllm"]["latencies"])[1]
    result = {"runs": runs}
    latency.summarize(result, "pcp1-stock")
    assert runs[1]["spread_s"] == [1.115, 1.476]
    assert runs[1]["itl_ms"] == round((1.311 - 0.606) / 32 * 1e3, 4)
    assert runs[1]["itl_ms_best"] == round((1.115 - 0.59) / 32 * 1e3, 4)
    assert result["itl_ratios"]["pcp1/pcp1-stock@32768"] < 0.8
    assert result["itl_ratios_best"] == {"pcp1/pcp1-stock@32768": round(
        (1.141 - 0.595) / (1.115 - 0.59), 4)}
    assert latency.spread(None) is None and latency.spread([]) is None
