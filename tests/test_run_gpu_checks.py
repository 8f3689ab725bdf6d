"""scripts/run_gpu_checks.sh bench stages with stand-in Python scripts (no GPU): the flags
each stage passes to bench_pcp.py, and a stage status that is the bench run's."""
import json
import os
import shutil
import subprocess
import tarfile

SCRIPTS = os.path.join(os.path.dirname(__file__), "..", "scripts")
# stand-in for bench_pcp.py: record argv; with PROFILE_TRACE, leave a trace where the
# real one's profiler would; exit BENCH_RC
FAKE_BENCH = """import json, os, sys
args = sys.argv[1:]
json.dump(args, open(os.environ["ARGS_OUT"], "w"))
raw = args[args.index("--raw") + 1]
if os.environ.get("PROFILE_TRACE"):
    d = os.path.join(os.path.dirname(raw), "profile-pcp2")
    os.makedirs(d, exist_ok=True)
    open(os.path.join(d, "rank0.pt.trace.json.gz"), "w").write("trace")
print("pcp2 0 1.0 123")
sys.exit(int(os.environ.get("BENCH_RC", "0")))
"""
FAKE_TRACE_STEPS = """import sys
for flag in ("--out", "--python-out"):
    if flag in sys.argv:
        open(sys.argv[sys.argv.index(flag) + 1], "w").write("{}")
print("steps of", sys.argv[1])
"""


def _run(tmp_path, stage, **env):
    scripts = tmp_path / "scripts"
    scripts.mkdir(exist_ok=True)
    shutil.copy(os.path.join(SCRIPTS, "run_gpu_checks.sh"), scripts / "run_gpu_checks.sh")
    (scripts / "bench_pcp.py").write_text(FAKE_BENCH)
    (scripts / "trace_steps.py").write_text(FAKE_TRACE_STEPS)
    full_env = {**os.environ, "GPU_CHECKS_DIR": str(tmp_path / "checks"),
                "ARGS_OUT": str(tmp_path / "args.json"), **env}
    res = subprocess.run(["bash", str(scripts / "run_gpu_checks.sh"), stage,
                          str(tmp_path / "out")], env=full_env, capture_output=True,
                         text=True, timeout=60)
    return res, json.loads((tmp_path / "args.json").read_text())


def test_bench_without_a_profile_succeeds_and_passes_the_default_configs(tmp_path):
    res, args = _run(tmp_path, "bench", BENCH_PROFILE="")
    assert res.returncode == 0, res.stderr
    assert args[0] == "run" and "--eager" in args and "--parallel-one-gpu" in args
    assert args[args.index("--configs") + 1] == "pcp1-stock,pcp1,pcp2,pcp2-dcp2,tp2"
    assert args[args.index("--prompt-lens") + 1] == "4096,32768,131072"
    assert "--profile-len" not in args and "--chunk" not in args
    assert "pcp2 0 1.0 123" in res.stdout
    assert "bench/bench.log" in tarfile.open(tmp_path / "out" / "bench.tgz").getnames()


def test_bench_stage_fails_when_the_bench_run_does(tmp_path):
    res, _ = _run(tmp_path, "bench", BENCH_RC="3")
    assert res.returncode != 0


def test_bench_chunked_times_graphs_in_chunks_and_summarises_its_profiles(tmp_path):
    res, args = _run(tmp_path, "bench-chunked", PROFILE_TRACE="1",
                     BENCH_CHUNKED_CONFIGS="pcp1-stock,pcp1,pcp2,pcp2-dcp2")
    assert res.returncode == 0, res.stderr
    assert "--eager" not in args and "--parallel-one-gpu" not in args
    assert args[args.index("--chunk") + 1] == "8192"
    assert args[args.index("--configs") + 1] == "pcp1-stock,pcp1,pcp2,pcp2-dcp2"
    assert args[args.index("--profile-len") + 1] == "16384" and "--profile-mixed" in args
    assert "--profile-stack" not in args
    assert args[args.index("--profile-configs") + 1] == "pcp2,pcp2-dcp2"
    steps = tmp_path / "checks" / "bench-chunked" / "profile-pcp2" / "steps.txt"
    assert steps.read_text().startswith("steps of")
    names = tarfile.open(tmp_path / "out" / "bench-chunked.tgz").getnames()
    assert "bench-chunked/profile-pcp2/steps.json" in names
    assert not any(n.endswith(".pt.trace.json.gz") for n in names)


def test_bench_chunked_with_python_stacks_writes_their_summary(tmp_path):
    res, args = _run(tmp_path, "bench-chunked", PROFILE_TRACE="1", BENCH_PROFILE_STACK="1")
    assert res.returncode == 0, res.stderr
    assert "--profile-stack" in args and "--profile-mixed" in args
    profile = tmp_path / "checks" / "bench-chunked" / "profile-pcp2"
    assert (profile / "python.json").exists() and (profile / "steps.json").exists()


FAKE_LATENCY = """import json, os, sys
args = sys.argv[1:]
json.dump(args, open(os.environ["ARGS_OUT"], "w"))
out = args[args.index("--out") + 1]
if os.environ.get("LATENCY_RC", "0") == "0":
    json.dump({"runs": []}, open(out, "w"))
sys.exit(int(os.environ.get("LATENCY_RC", "0")))
"""


def test_latency_stage_runs_vllm_bench_latency_and_keeps_its_file(tmp_path):
    (tmp_path / "scripts").mkdir()
    (tmp_path / "scripts" / "bench_latency.py").write_text(FAKE_LATENCY)
    res, args = _run(tmp_path, "latency", LATENCY_CONFIGS="pcp1-stock,pcp1",
                     LATENCY_LENS="32768")
    assert res.returncode == 0, res.stderr
    assert args[args.index("--configs") + 1] == "pcp1-stock,pcp1"
    assert args[args.index("--input-lens") + 1] == "32768" and "--eager" in args
    assert json.loads((tmp_path / "out" / "latency.json").read_text()) == {"runs": []}
    res, args = _run(tmp_path, "latency", LATENCY_RC="2", BENCH_EAGER="")
    assert res.returncode == 2 and "--eager" not in args
    assert args[args.index("--configs") + 1] == "pcp1,pcp2,pcp2-dcp2"
