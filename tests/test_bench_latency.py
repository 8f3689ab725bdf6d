"""scripts/bench_latency.py without a GPU: its command lines are accepted by vLLM's own
``vllm bench latency`` parser with the engine they name, the TTFT and ratios come out of
vLLM's output format, and a run writes one file with vLLM's outputs embedded. Also
bench_pcp.py's configurations, now from scripts/layouts.py, pinned to the table it had."""
import json
import os
import sys
import textwrap
from types import SimpleNamespace

import numpy as np
import pytest

SCRIPTS = os.path.join(os.path.dirname(__file__), "..", "scripts")
sys.path.insert(0, SCRIPTS)
import bench_latency  # noqa: E402
import bench_pcp  # noqa: E402

FUSION_OFF = {"pass_config": {"fuse_allreduce_rms": False}}
# bench_pcp.py's own table before the configurations moved to scripts/layouts.py:
# name -> (engine kwargs, env)
OLD_BENCH_CONFIGS = {
    "pcp1-stock": ({"prefill_context_parallel_size": 1}, {"VLLM_PLUGINS": "none"}),
    "pcp1": ({"prefill_context_parallel_size": 1}, {}),
    "pcp2": ({"prefill_context_parallel_size": 2}, {}),
    "pcp2-min8k": ({"prefill_context_parallel_size": 2,
                    "additional_config": {"pcp_min_split_tokens": 8192}}, {}),
    "pcp2-split-all": ({"prefill_context_parallel_size": 2,
                        "additional_config": {"pcp_min_split_tokens": 2}}, {}),
    "tp2": ({"tensor_parallel_size": 2, "compilation_config": FUSION_OFF}, {}),
    "pcp2-dcp2": ({"prefill_context_parallel_size": 2, "decode_context_parallel_size": 2},
                  {}),
    "pcp2-dcp2-queries": ({"prefill_context_parallel_size": 2,
                           "decode_context_parallel_size": 2,
                           "additional_config": {"pcp_dcp_context_exchange": "queries"}}, {}),
    "pcp2-dcp2-keys": ({"prefill_context_parallel_size": 2,
                        "decode_context_parallel_size": 2,
                        "additional_config": {"pcp_dcp_context_exchange": "keys"}}, {}),
}


def _same_engine(got: dict, want: dict) -> None:
    """``got`` is ``want`` but for keys it adds at vLLM's own default (layouts.py names
    ``prefill_context_parallel_size=1`` and ``cp_kv_cache_interleave_size=1``)."""
    from vllm.engine.arg_utils import EngineArgs

    assert not want.keys() - got.keys()
    assert {k: got[k] for k in want} == want
    assert {k: got[k] for k in got.keys() - want.keys()} == \
        {k: getattr(EngineArgs, k) for k in got.keys() - want.keys()}


def test_bench_pcp_runs_the_engines_and_env_of_its_old_table(tmp_path, monkeypatch):
    import gpu_runs
    import vllm

    assert set(bench_pcp.CONFIGS) == set(OLD_BENCH_CONFIGS)
    engines = []

    class Engine:
        def __init__(self, **kwargs):
            engines.append(kwargs)
            cache = SimpleNamespace(num_gpu_blocks=100, block_size=16)
            self.llm_engine = SimpleNamespace(vllm_config=SimpleNamespace(cache_config=cache))

        def generate(self, *args, **kwargs):
            return []

    monkeypatch.setattr(vllm, "LLM", Engine)
    max_len = bench_pcp._max_len("64")
    for name, (kwargs, _) in OLD_BENCH_CONFIGS.items():
        args = SimpleNamespace(config=name, model="/m", prompt_lens="64", repeats=1,
                               itl_repeats=1, chunk=0, eager=True, profile_len=0,
                               profile_decode=0, profile_mixed=False, profile_stack=False,
                               profile_dir="", out=str(tmp_path / f"{name}.json"))
        bench_pcp.measure(args)
        _same_engine(engines[-1], {  # the LLM call as bench_pcp.py made it
            "model": "/m", "load_format": "dummy", "skip_tokenizer_init": True,
            "dtype": "bfloat16", "max_model_len": max_len, "max_num_batched_tokens": max_len,
            "max_num_seqs": 8, "enable_prefix_caching": True, "gpu_memory_utilization": 0.85,
            "attention_backend": "FLASHINFER", "enforce_eager": True, "seed": 0, **kwargs})
        dcp = kwargs.get("decode_context_parallel_size", 1)
        assert json.load(open(args.out))["kv_capacity_tokens"] == 100 * 16 * dcp

    seen = {}
    monkeypatch.setattr(bench_pcp, "bench_model", lambda **kw: "/models/m")
    monkeypatch.setattr(gpu_runs, "versions", lambda: {"gpu": "none"})
    monkeypatch.setattr(gpu_runs, "run_worker", lambda cmd, out, key, entry, env, extra, log:
                        seen.update({entry["config"]: env}) or {**entry, "returncode": 0})
    bench_pcp.run(SimpleNamespace(
        prompt_lens="4096", repeats=1, itl_repeats=1, chunk=0, eager=True,
        parallel_one_gpu=False, profile_len=0, profile_decode=0, profile_mixed=False,
        profile_stack=False, profile_configs="", configs=",".join(OLD_BENCH_CONFIGS),
        raw=str(tmp_path / "bench.json")))
    assert seen == {name: env for name, (_, env) in OLD_BENCH_CONFIGS.items()}


@pytest.fixture
def vllm_latency_parser(monkeypatch):
    """``vllm bench latency``'s parser, built as vLLM's CLI builds it (on a host with no
    GPU the CLI takes vLLM's CPU platform for ``bench``, and so does this)."""
    from vllm import platforms
    from vllm.engine import arg_utils

    if platforms.current_platform.is_unspecified():
        from vllm.platforms.cpu import CpuPlatform

        monkeypatch.setattr(platforms, "current_platform", CpuPlatform(), raising=False)
    from vllm.benchmarks.latency import add_cli_args
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = FlexibleArgumentParser()
    add_cli_args(parser)
    yield parser
    arg_utils._compute_kwargs.cache_clear()  # defaults computed on this platform


@pytest.mark.parametrize("config,pcp,dcp,tp,knobs", [
    ("pcp1", 1, 1, 1, {}),
    ("pcp2", 2, 1, 1, {}),
    ("pcp2-dcp2", 2, 2, 1, {}),
    ("tp2", 1, 1, 2, {}),
    ("pcp2-dcp2-keys", 2, 2, 1, {"pcp_dcp_context_exchange": "keys"}),
])
@pytest.mark.parametrize("eager", [True, False])
def test_command_lines_parse_with_vllms_latency_parser(vllm_latency_parser, config, pcp, dcp,
                                                       tp, knobs, eager):
    from vllm.engine.arg_utils import EngineArgs

    argv = bench_latency.latency_args(config, 32768, "/models/m", 32904, "/tmp/l.json",
                                      eager=eager, warmup=1, iters=3)
    args = vllm_latency_parser.parse_args(argv)
    assert (args.input_len, args.output_len, args.batch_size, args.n) == (32768, 1, 1, 1)
    assert (args.num_iters_warmup, args.num_iters, args.output_json) == (1, 3, "/tmp/l.json")
    assert args.disable_detokenize and not args.use_beam_search and not args.profile
    engine = EngineArgs.from_cli_args(args)
    assert (engine.prefill_context_parallel_size, engine.decode_context_parallel_size,
            engine.tensor_parallel_size) == (pcp, dcp, tp)
    assert engine.cp_kv_cache_interleave_size == 1
    assert (engine.additional_config or {}) == knobs
    assert (engine.model, engine.load_format, engine.skip_tokenizer_init, engine.dtype) == (
        "/models/m", "dummy", True, "bfloat16")
    assert (engine.max_model_len, engine.max_num_batched_tokens) == (32904, 32904)
    assert engine.attention_backend == "FLASHINFER" and engine.enforce_eager is eager
    assert engine.enable_prefix_caching is False  # the tool's default: every prefill whole
    assert engine.gpu_memory_utilization == 0.85 and engine.seed == 0
    fusion = engine.compilation_config.pass_config.fuse_allreduce_rms
    assert fusion is (False if tp > 1 and not eager else None)


def _vllm_output(latencies: list[float]) -> dict:
    """What vLLM 0.26.0's ``vllm bench latency --output-json`` writes (benchmarks/latency.py),
    read back: percentiles keyed by percentage, strings once JSON."""
    lat = np.array(latencies)
    percentages = [10, 25, 50, 75, 90, 99]
    results = {"avg_latency": np.mean(lat), "latencies": lat.tolist(),
               "percentiles": dict(zip(percentages, np.percentile(lat, percentages).tolist()))}
    return json.loads(json.dumps(results, indent=4))


def test_ttft_and_ratios_from_vllms_output():
    out = _vllm_output([0.30, 0.20, 0.25])
    assert set(out["percentiles"]) == {"10", "25", "50", "75", "90", "99"}
    assert bench_latency.ttft_of(out) == {"ttft_s": 0.25, "ttft_mean_s": pytest.approx(0.25)}
    assert bench_latency.ttft_of(_vllm_output([1.0, 3.0]))["ttft_s"] == 2.0
    runs = [{"config": "pcp1", "input_len": 4096, "ttft_s": 0.5},
            {"config": "pcp1", "input_len": 32768, "ttft_s": 4.0},
            {"config": "pcp2", "input_len": 4096, "ttft_s": 0.4},
            {"config": "pcp2", "input_len": 32768, "ttft_s": 2.2},
            {"config": "pcp2-dcp2", "input_len": 32768, "returncode": 1},  # failed: none
            {"config": "tp2", "input_len": 131072, "ttft_s": 9.0}]  # no pcp1 there: none
    assert bench_latency.ratios(runs) == {"pcp2/pcp1@4096": 0.8, "pcp2/pcp1@32768": 0.55}


FAKE_VLLM = textwrap.dedent("""\
    # stand-in for `vllm bench latency`: vLLM's output file, TTFT = input_len / pcp us
    import json, os, sys
    argv = sys.argv[1:]
    value = lambda flag, default=None: argv[argv.index(flag) + 1] if flag in argv else default
    out, n = value("--output-json"), int(value("--input-len"))
    with open(out + ".argv", "w") as f:
        json.dump({"argv": argv, "VLLM_PLUGINS": os.environ.get("VLLM_PLUGINS")}, f)
    if n == 99:
        sys.exit("RuntimeError: no such length")
    t = n / int(value("--prefill-context-parallel-size", 1)) * 1e-6
    json.dump({"avg_latency": t, "latencies": [t, t, t],
               "percentiles": {str(p): t for p in (10, 25, 50, 75, 90, 99)}}, open(out, "w"))
    """)


def test_run_writes_one_file_with_vllms_outputs_embedded(tmp_path, monkeypatch):
    import gpu_runs

    fake = tmp_path / "fake_vllm.py"
    fake.write_text(FAKE_VLLM)
    monkeypatch.setattr(bench_latency, "VLLM_CLI", [sys.executable, str(fake)])
    monkeypatch.setattr(gpu_runs, "versions", lambda: {"vllm": "0.26.0", "gpu": "none"})
    monkeypatch.setenv("GIT_REV", "abc1234")
    monkeypatch.delenv("VLLM_PLUGINS", raising=False)
    out = tmp_path / "res" / "latency.json"
    out.parent.mkdir()
    args = bench_latency.parse_args([
        "--configs", "pcp1-stock,pcp1,pcp2", "--input-lens", "4096,99", "--eager",
        "--num-iters", "3", "--model-dir", str(tmp_path / "model"), "--out", str(out)])
    result = bench_latency.run(args)
    assert json.load(open(out)) == json.loads(json.dumps(result))
    meta = result["meta"]
    assert (meta["git_rev"], meta["vllm"], meta["tool"], meta["output_len"]) == (
        "abc1234", "0.26.0", "vllm bench latency", 1)
    assert meta["command"].startswith("python scripts/bench_latency.py") and meta["date"]
    assert meta["model_config"] == "configs/models/qwen2.5-3b-shape.json"
    assert meta["max_model_len"] == meta["max_num_batched_tokens"] == bench_pcp._max_len("4096,99")
    model = json.load(open(tmp_path / "model" / "config.json"))
    assert model["num_hidden_layers"] == 36  # the bench model, dummy weights
    assert [(r["config"], r["input_len"]) for r in result["runs"]] == [
        (c, n) for c in ("pcp1-stock", "pcp1", "pcp2") for n in (4096, 99)]
    good = [r for r in result["runs"] if r["input_len"] == 4096]
    for run in good:
        assert run["returncode"] == 0
        name = f"{run['config']}-4096"
        assert run["vllm"] == json.load(open(out.parent / f"{name}.json"))  # unchanged
        assert run["ttft_s"] == run["vllm"]["percentiles"]["50"]
        assert os.path.exists(out.parent / f"{name}.log")
        assert run["command"].startswith("vllm bench latency --model ")
        seen = json.load(open(out.parent / f"{name}.json.argv"))
        assert seen["argv"][:2] == ["bench", "latency"]
        assert seen["argv"][2:] == bench_latency.latency_args(
            run["config"], 4096, str(tmp_path / "model"), bench_pcp._max_len("4096,99"),
            str(out.parent / f"{name}.json"), eager=True, warmup=1, iters=3)
        assert seen["VLLM_PLUGINS"] == ("none" if run["config"] == "pcp1-stock" else None)
    failed = [r for r in result["runs"] if r["input_len"] == 99]
    assert all(r["returncode"] and "vllm" not in r and "ttft_s" not in r for r in failed)
    assert result["ratios"] == {"pcp1-stock/pcp1@4096": 1.0, "pcp2/pcp1@4096": 0.5}


def test_unknown_configuration_is_refused(tmp_path):
    with pytest.raises(SystemExit, match="nope"):
        bench_latency.run(bench_latency.parse_args(
            ["--configs", "pcp1,nope", "--out", str(tmp_path / "l.json")]))
