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


# stand-in for check_exactness.py: argv of each call, one JSON line; the jobs of `run` parsed
# by the real script; raw and result files written where the stage expects them
FAKE_CHECK = """import json, os, sys
args = sys.argv[1:]
with open(os.environ["CALLS"], "a") as f:
    f.write(json.dumps(args) + "\\n")
sys.path.insert(0, os.environ["REAL_SCRIPTS"])
if args[0] == "run":
    import check_exactness
    ns = check_exactness.argparse.Namespace(jobs=args[args.index("--jobs") + 1])
    check_exactness._jobs(ns)  # SystemExit on an unknown configuration
for flag in ("--raw", "--out"):
    if flag in args and args[0] in ("run", "features", "compare", "teacher"):
        path = args[args.index(flag) + 1]
        if not os.path.exists(path):
            json.dump({"runs": []}, open(path, "w"))
"""


def _jobs(call):
    return [tuple(job.split(":")[:3]) for job in call[call.index("--jobs") + 1].split(",")]


def test_engine_proof_holds_every_engine_to_a_baseline_it_runs_first(tmp_path):
    import sys

    sys.path.insert(0, SCRIPTS)
    import check_exactness as ce
    import exactness_teacher as et

    scripts = tmp_path / "scripts"
    scripts.mkdir()
    shutil.copy(os.path.join(SCRIPTS, "run_gpu_checks.sh"), scripts / "run_gpu_checks.sh")
    (scripts / "check_exactness.py").write_text(FAKE_CHECK)
    (scripts / "memory_report.py").write_text(  # records its call as check_exactness does
        FAKE_CHECK.replace("args = sys.argv[1:]", "args = ['memory_report', *sys.argv[1:]]"))
    calls_file = tmp_path / "calls.jsonl"
    res = subprocess.run(
        ["bash", str(scripts / "run_gpu_checks.sh"), "engine-proof", str(tmp_path / "out")],
        env={**os.environ, "GPU_CHECKS_DIR": str(tmp_path / "checks"), "GIT_REV": "abc",
             "CALLS": str(calls_file), "REAL_SCRIPTS": SCRIPTS},
        capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    calls = [json.loads(line) for line in calls_file.read_text().splitlines()]
    runs = [c for c in calls if c[0] == "run"]
    base, proof = (runs if "self" in runs[0] else runs[::-1])
    assert base[base.index("--teacher") + 1] == "self"
    assert proof[proof.index("--teacher") + 1] == base[base.index("--raw") + 1]
    base_jobs, proof_jobs = _jobs(base), _jobs(proof)
    assert {config for _, _, config in base_jobs} == {"pcp1-v1"}
    ran = set(base_jobs) | set(proof_jobs)
    for model, variant, config in proof_jobs:  # a baseline of the same model and variant
        expected = ce.BASELINE.get(config)
        assert expected is None or (model, variant, expected) in ran, (model, config)
        if config in ce.BASELINE and variant == "chunked":  # the teacher's too
            assert (model, "chunked", "pcp1-v1") in base_jobs
    configs = {config for _, _, config in proof_jobs}
    assert set(et.TEACHER_GOALS) - {"tp2-dcp2-i1"} <= configs  # every goal measured
    assert set(et.GOAL_FLOORS) <= configs and "pcp1" in configs
    assert ("qwen3-moe-8e", "chunked", "tp2") in proof_jobs  # MoE's floor of -pcp 2
    assert {"pcp4", "pcp4-dcp4-i8", "pcp8", "tp2-pcp2", "tp2-pcp2-dcp2-i1",
            "tp4-pcp2-dcp2-i8", "pcp2-ray"} <= configs
    features = [c for c in calls if c[:2] == ["features", "run"]]
    feature_configs = {x for c in features for x in c[c.index("--configs") + 1].split(",")}
    assert {"pcp1-v1-fp8", "pcp1-v1-preempt", "pcp2-dcp2-i1-fp8", "pcp4-preempt",
            "pcp2-dcp2-i16-keys"} <= feature_configs <= set(ce.CONFIGS)
    compares = [c for c in calls if c[0] == "compare"]
    assert sorted(c[c.index("--layouts") + 1] for c in compares) == ["dcp", "dcp1"]
    feature_compare = next(c for c in calls if c[:2] == ["features", "compare"])
    raws = [a for a in feature_compare if a.endswith(".json") and "/raw-" in a]
    assert len(raws) == 5 and all(c[c.index("--raw") + 1] in raws for c in features)
    assert any(c[0] == "teacher" for c in calls)
    memory = next(c for c in calls if c[0] == "memory_report")
    assert memory[memory.index("--raw") + 1] == proof[proof.index("--raw") + 1]
    for name in ("exactness-pcp", "exactness-dcp", "exactness-features", "exactness-teacher"):
        assert (tmp_path / "out" / f"{name}.json").exists(), name
