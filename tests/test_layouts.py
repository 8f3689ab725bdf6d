"""scripts/layouts.py, the named configurations defined once: the exactness checks' worker
flags stay those of the table check_exactness.py had before it read them from layouts, and
every layout's ``vllm serve`` flags parse with vLLM 0.26.0's own parser into the parallel
sizes, interleave, knobs and eagerness of the layout."""
import os
import subprocess
import sys

import pytest

SCRIPTS = os.path.join(os.path.dirname(__file__), "..", "scripts")
sys.path.insert(0, SCRIPTS)
import layouts  # noqa: E402

# check_exactness.CONFIGS before it came from layouts (the feature configurations included):
# a change of any layout these name changes what the committed exactness results measured
OLD_CONFIGS = {
    "pcp1": ["--pcp", "1"],
    "pcp2": ["--pcp", "2"],
    "pcp1-graphs": ["--pcp", "1", "--cuda-graphs"],
    "pcp2-graphs": ["--pcp", "2", "--cuda-graphs"],
    "pcp2-ray": ["--pcp", "2", "--ray"],
    "tp2": ["--tp", "2"],
    "pcp1-flash-attn": ["--pcp", "1", "--attention-backend", "FLASH_ATTN"],
    "pcp2-dcp2-i1": ["--pcp", "2", "--dcp", "2", "--interleave", "1"],
    "pcp2-dcp2-i8": ["--pcp", "2", "--dcp", "2", "--interleave", "8"],
    "pcp2-dcp2-i16": ["--pcp", "2", "--dcp", "2", "--interleave", "16"],
    "pcp2-dcp2-i8-graphs": ["--pcp", "2", "--dcp", "2", "--interleave", "8", "--cuda-graphs"],
    "pcp2-dcp2-i8-queries": ["--pcp", "2", "--dcp", "2", "--interleave", "8",
                             "--dcp-context-exchange", "queries"],
    "pcp2-dcp2-i8-keys": ["--pcp", "2", "--dcp", "2", "--interleave", "8",
                          "--dcp-context-exchange", "keys"],
    "tp2-dcp2-i1": ["--tp", "2", "--dcp", "2", "--interleave", "1"],
    "tp2-dcp2-i8": ["--tp", "2", "--dcp", "2", "--interleave", "8"],
    "tp2-dcp2-i16": ["--tp", "2", "--dcp", "2", "--interleave", "16"],
    "tp2-dcp2-i8-graphs": ["--tp", "2", "--dcp", "2", "--interleave", "8", "--cuda-graphs"],
    "pcp2-dcp2-i8-smallpool": ["--pcp", "2", "--dcp", "2", "--interleave", "8",
                               "--kv-pool-tokens", "20480"],
    "pcp2-dcp2-i1-auto": ["--pcp", "2", "--dcp", "2", "--interleave", "1",
                          "--dcp-context-exchange", "auto"],
    "pcp2-dcp2-i1-queries": ["--pcp", "2", "--dcp", "2", "--interleave", "1",
                             "--dcp-context-exchange", "queries"],
    "pcp2-dcp2-i1-keys": ["--pcp", "2", "--dcp", "2", "--interleave", "1",
                          "--dcp-context-exchange", "keys"],
    "pcp2-dcp2-i16-auto": ["--pcp", "2", "--dcp", "2", "--interleave", "16",
                           "--dcp-context-exchange", "auto"],
    "pcp2-dcp2-i16-queries": ["--pcp", "2", "--dcp", "2", "--interleave", "16",
                              "--dcp-context-exchange", "queries"],
    "pcp2-dcp2-i16-keys": ["--pcp", "2", "--dcp", "2", "--interleave", "16",
                           "--dcp-context-exchange", "keys"],
    "pcp1-fp8": ["--pcp", "1", "--kv-cache-dtype", "fp8"],
    "pcp2-fp8": ["--pcp", "2", "--kv-cache-dtype", "fp8"],
    "pcp2-dcp2-i1-fp8": ["--pcp", "2", "--dcp", "2", "--interleave", "1",
                         "--kv-cache-dtype", "fp8"],
    "pcp1-preempt": ["--pcp", "1", "--kv-pool-tokens", "12288", "--max-model-len", "4096"],
    "pcp2-preempt": ["--pcp", "2", "--kv-pool-tokens", "12288", "--max-model-len", "4096"],
    "pcp2-dcp2-i1-preempt": ["--pcp", "2", "--dcp", "2", "--interleave", "1",
                             "--kv-pool-tokens", "6144", "--max-model-len", "4096"],
    "pcp2-dcp2-i16-preempt": ["--pcp", "2", "--dcp", "2", "--interleave", "16",
                              "--kv-pool-tokens", "6144", "--max-model-len", "4096"],
}
# the one-GPU feature baselines, now on the V1 runner
REPLACED = {"pcp1-fp8": "pcp1-v1-fp8", "pcp1-preempt": "pcp1-v1-preempt"}


def test_check_exactness_runs_the_worker_flags_it_always_ran():
    import check_exactness as ce

    for name, flags in OLD_CONFIGS.items():  # the names, and each one's flags in order
        if name in REPLACED:
            assert name not in ce.CONFIGS
            new = ce.CONFIGS[REPLACED[name]]
            assert new[:3] == ["--pcp", "1", "--v1-runner"] and new[3:] == flags[2:], name
            continue
        assert ce.CONFIGS[name] == flags, name
        if name in layouts.LAYOUTS:  # the feature ones add a feature's flags to a layout's
            assert layouts.worker_flags(name) == flags, name


def test_every_configuration_of_several_ranks_is_held_to_one_gpu_on_the_v1_runner():
    import check_exactness as ce

    one_gpu = {"pcp1", "pcp1-graphs", "pcp1-v1", "pcp1-v1-graphs", "pcp1-flash-attn"}
    features = set(ce.feature_configs())  # with baselines of their own
    for name in ce.CONFIGS:
        if name in one_gpu or name not in layouts.LAYOUTS or name in features:
            continue
        assert ce.BASELINE[name] == ("pcp1-v1-graphs" if layouts.LAYOUTS[name].cuda_graphs
                                     else "pcp1-v1"), name
    assert "pcp1-flash-attn" not in ce.BASELINE  # a noise floor: a kernel change
    assert (("chunked", "pcp1-flash-attn"), ("chunked", "pcp1")) in ce.FLOOR_PAIRS
    assert layouts.LAYOUTS["pcp1-v1"].env == {"VLLM_USE_V2_MODEL_RUNNER": "0"}
    assert layouts.worker_flags("pcp1-v1") == ["--pcp", "1", "--v1-runner"]
    assert [layouts.gpus(n) for n in ("pcp4", "pcp8", "tp2-pcp2", "tp4-pcp2-dcp2-i8")] == \
        [4, 8, 4, 8]


def test_gpu_runs_takes_the_tp_compilation_config_from_layouts():
    import gpu_runs

    assert gpu_runs.NO_ALLREDUCE_FUSION is layouts.NO_ALLREDUCE_FUSION
    assert layouts.NO_ALLREDUCE_FUSION == {"pass_config": {"fuse_allreduce_rms": False}}


@pytest.fixture(scope="module")
def vllm_parser():
    """vLLM 0.26.0's ``vllm serve`` engine flags: FlexibleArgumentParser with
    EngineArgs.add_cli_args (no GPU here: the platform reports a device type)."""
    from vllm.platforms import current_platform

    had = current_platform.device_type
    current_platform.device_type = had or "cuda"  # DeviceConfig("auto") needs one
    try:
        from vllm.engine.arg_utils import EngineArgs
        from vllm.utils.argparse_utils import FlexibleArgumentParser

        def parse(flags: list[str]):
            parser = EngineArgs.add_cli_args(FlexibleArgumentParser())
            return EngineArgs.from_cli_args(parser.parse_args(["--model", "x", *flags]))

        yield parse
    finally:
        current_platform.device_type = had


@pytest.mark.parametrize("name", sorted(layouts.LAYOUTS))
def test_serve_flags_parse_into_the_layout_with_vllms_parser(vllm_parser, name):
    lay = layouts.LAYOUTS[name]
    for graphs in (None, True, False):
        args = vllm_parser(layouts.serve_flags(name, graphs))
        assert (args.prefill_context_parallel_size, args.decode_context_parallel_size,
                args.tensor_parallel_size, args.cp_kv_cache_interleave_size) == (
            lay.pcp, lay.dcp, lay.tp, lay.interleave)
        assert args.additional_config == lay.knobs
        assert args.enforce_eager == (not (lay.cuda_graphs if graphs is None else graphs))
        assert str(args.attention_backend) == lay.attention_backend
        assert args.distributed_executor_backend == ("ray" if lay.ray else None)
        if lay.tp > 1 and not args.enforce_eager:
            assert args.compilation_config.pass_config.fuse_allreduce_rms is False
    # the LLM(...) view of the same layout says the same
    kwargs = layouts.engine_kwargs(name)
    assert kwargs["prefill_context_parallel_size"] == args.prefill_context_parallel_size
    assert kwargs.get("decode_context_parallel_size", 1) == args.decode_context_parallel_size
    assert kwargs.get("tensor_parallel_size", 1) == args.tensor_parallel_size
    assert kwargs.get("cp_kv_cache_interleave_size", 1) == args.cp_kv_cache_interleave_size
    assert kwargs.get("additional_config", {}) == args.additional_config


def test_the_command_line_gives_the_shell_scripts_the_same_layouts():
    def cli(*argv):
        return subprocess.run([sys.executable, os.path.join(SCRIPTS, "layouts.py"), *argv],
                              capture_output=True, text=True, timeout=60)

    out = cli("serve-flags", "pcp2-dcp2-queries")
    assert out.stdout.splitlines() == layouts.serve_flags("pcp2-dcp2-queries")
    assert cli("serve-flags", "tp2", "--cuda-graphs").stdout.splitlines() == \
        layouts.serve_flags("tp2", cuda_graphs=True)
    assert cli("serve-flags", "pcp1-graphs", "--eager").stdout.splitlines() == \
        layouts.serve_flags("pcp1-graphs", cuda_graphs=False)
    assert cli("env", "pcp1-stock").stdout.splitlines() == ["VLLM_PLUGINS=none"]
    assert cli("env", "pcp2").stdout == ""
    assert [cli("gpus", n).stdout.strip() for n in ("pcp1", "pcp2-dcp2", "tp2-dcp2-i8")] == \
        ["1", "2", "2"]
    bad = cli("serve-flags", "no-such-layout")
    assert bad.returncode != 0 and bad.stdout == ""
