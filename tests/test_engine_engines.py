"""tests/engine/engines.py with a stand-in worker; the cases' prompts; the layouts' flags."""
import hashlib
import json
import os
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "engine"))
import cases  # noqa: E402
import engines  # noqa: E402
import layouts  # noqa: E402

# a stand-in worker: records its argv, fails with FAKE_FAIL set
FAKE = """import json, os, sys, time
args = sys.argv[1:]
open(os.environ["CALLS"], "a").write(json.dumps(args) + "\\n")
open(os.environ["CALLS"] + ".mps", "a").write(os.environ.get("CUDA_MPS_PIPE_DIRECTORY", "") + "\\n")
time.sleep(float(os.environ.get("FAKE_SLEEP", 0.2)))
out = [{"case": "len_1", "prompt_lens": [1], "outputs": [{"token_ids": [5],
       "logprobs": [{"5": -0.5}]}]}]
json.dump({"results": out, "memory": None}, open(args[args.index("--out") + 1], "w"))
sys.exit("RuntimeError: root cause" if os.environ.get("FAKE_FAIL") else 0)
"""


@pytest.fixture
def fake(tmp_path, monkeypatch):
    (tmp_path / "fake.py").write_text(FAKE)
    monkeypatch.setattr(engines, "WORKER", [sys.executable, str(tmp_path / "fake.py")])
    monkeypatch.setenv("CALLS", str(tmp_path / "calls"))
    monkeypatch.setenv("VLLM_PCP_MODELS_DIR", str(tmp_path / "models"))
    monkeypatch.setenv(engines.SESSION_VAR, "one")
    log = tmp_path / "calls"
    return str(tmp_path / "work"), lambda: [json.loads(x) for x in log.read_text().splitlines()]


def test_a_job_runs_once_after_its_teacher_and_a_failure_again_in_a_new_session(fake, monkeypatch):
    work, calls = fake
    base = engines.Job("smollm2", "chunked", "pcp1", "standard,features", teacher="self")
    job = engines.Job("smollm2", "chunked", "pcp2", teacher=base)
    entry = engines.run_engine(job, work)
    assert engines.run_engine(job, work) == entry and len(calls()) == 2
    base_args, args = calls()
    assert base_args[base_args.index("--teacher") + 1] == "self"
    assert args[args.index("--teacher") + 1] == os.path.join(work, "raw", base.name + ".json")
    assert entry["returncode"] == 0 and entry["results"][0]["case"] == "len_1"
    monkeypatch.setenv("FAKE_FAIL", "1")
    failed = engines.run_engine(engines.Job("smollm2", "chunked", "pcp4"), work)
    assert failed["errors"] == ["RuntimeError: root cause"] and failed["results"]  # its part
    engines.run_engine(engines.Job("smollm2", "chunked", "pcp4"), work)
    assert len(calls()) == 3  # the same session reuses its failure
    monkeypatch.setenv(engines.SESSION_VAR, "two")
    engines.run_engine(engines.Job("smollm2", "chunked", "pcp4"), work)
    engines.run_engine(job, work)  # a success is kept across sessions
    engines.run_engine(engines.Job("smollm2", "chunked", "pcp2", "standard,features",
                                   teacher=base), work)  # other groups: another run
    assert len(calls()) == 5


def test_a_run_past_the_engine_timeout_is_killed_and_fails_naming_it(fake, monkeypatch):
    """A hung engine (here: a worker that sleeps) is stopped at VLLM_PCP_ENGINE_TIMEOUT_S,
    and its entry fails with the reason first, so its comparisons fail instead of waiting."""
    work, _ = fake
    monkeypatch.setenv("FAKE_SLEEP", "30")
    monkeypatch.setenv(engines.TIMEOUT_VAR, "1")
    entry = engines.run_engine(engines.Job("smollm2", "chunked", "pcp2"), work)
    assert entry["returncode"] and entry["seconds"] < 20 and "results" not in entry
    assert entry["errors"][0] == f"timed out: still running after 1 s ({engines.TIMEOUT_VAR})"
    case = engines.judge.engine_case("m", "l", entry, {"returncode": 0})
    assert not case["passed"] and case["errors"] == entry["errors"]


# a stand-in hung engine: a worker and the child it starts, each printing its stacks on the
# test plugin's signal, both asleep; the child's pid in CHILD_PID
HUNG = """import faulthandler, os, subprocess, sys, time
faulthandler.register({signum}, all_threads=True)
child = ("import faulthandler, os, time; faulthandler.register({signum}, all_threads=True); "
         "open(os.environ['CHILD_PID'], 'w').write(str(os.getpid())); time.sleep(60)")
subprocess.Popen([sys.executable, "-c", child])
time.sleep(60)
"""

# a stand-in engine hung at its exit: its whole output written (in one rename), then a child
# started and both asleep
HUNG_AT_EXIT = HUNG.replace("subprocess.Popen(", """out = sys.argv[sys.argv.index("--out") + 1]
json.dump({{"results": [{{"case": "len_1", "prompt_lens": [1]}}]}}, open(out + ".part", "w"))
os.replace(out + ".part", out)
subprocess.Popen(""").replace("import faulthandler,", "import faulthandler, json,", 1)


def test_a_run_still_going_after_its_output_is_killed_and_its_output_judged(
        fake, monkeypatch, tmp_path):
    """A worker that writes its whole output and then does not exit (an engine hung in its
    shutdown) is stopped :data:`engines.EXIT_GRACE_S` later: its cases count, the entry and
    a warning name the hang, and none of its processes is left."""
    work, _ = fake
    (tmp_path / "hung.py").write_text(HUNG_AT_EXIT.format(
        signum=int(engines.shared_gpu.STACKS_SIGNAL)))
    monkeypatch.setattr(engines, "WORKER", [sys.executable, str(tmp_path / "hung.py")])
    monkeypatch.setattr(engines, "EXIT_GRACE_S", 1.0)
    monkeypatch.setattr(engines, "STACKS_WAIT_S", 1.0)
    monkeypatch.setenv("CHILD_PID", str(tmp_path / "child"))
    monkeypatch.setenv(engines.TIMEOUT_VAR, "60")
    with pytest.warns(UserWarning, match="still running 1 s after its output was written"):
        entry = engines.run_engine(engines.Job("smollm2", "chunked", "pcp2"), work)
    assert entry["returncode"] == 0 and entry["results"][0]["case"] == "len_1"
    assert entry["hung_at_exit"] == {"killed_after_output_s": 1.0, "returncode": -9}
    assert "errors" not in entry and entry["seconds"] < 30
    log = open(os.path.join(work, "raw", "smollm2-chunked-pcp2-t32.log")).read()
    assert "(most recent call first)" in log and "hung.py" in log
    _assert_gone(int((tmp_path / "child").read_text()))


def _assert_gone(pid: int) -> None:
    for _ in range(50):
        if not os.path.exists(f"/proc/{pid}") or " Z " in open(f"/proc/{pid}/stat").read():
            return
        time.sleep(0.1)
    pytest.fail(f"the engine's child {pid} still runs")


def test_a_timed_out_engine_logs_every_process_stacks_and_leaves_none_running(
        fake, monkeypatch, tmp_path):
    """Before the kill, the worker and the processes it started print where they waited
    (every vLLM process of a check registers for the signal through the test plugin), and
    the kill reaches them all."""
    work, _ = fake
    (tmp_path / "hung.py").write_text(HUNG.format(signum=int(engines.shared_gpu.STACKS_SIGNAL)))
    monkeypatch.setattr(engines, "WORKER", [sys.executable, str(tmp_path / "hung.py")])
    monkeypatch.setenv("CHILD_PID", str(tmp_path / "child"))
    monkeypatch.setenv(engines.TIMEOUT_VAR, "2")
    entry = engines.run_engine(engines.Job("smollm2", "chunked", "pcp2"), work)
    assert entry["errors"][0].startswith("timed out")
    assert entry["log_tail"].count("(most recent call first)") >= 2, entry["log_tail"]
    assert "hung.py" in entry["log_tail"] and 'File "<string>"' in entry["log_tail"]
    _assert_gone(int((tmp_path / "child").read_text()))


def test_the_stacks_signal_goes_to_one_process_at_a_time(monkeypatch):
    """The dumps share the log and two at once interleave line by line: each handling
    process gets the signal only after the one before had time to print; processes
    without a handler get nothing."""
    events = []
    monkeypatch.setattr(engines, "_session_pids", lambda session: [11, 12, 13, 14])
    monkeypatch.setattr(engines, "catches", lambda pid, signum: pid != 13)
    monkeypatch.setattr(engines.os, "kill", lambda pid, signum: events.append(("kill", pid, signum)))
    monkeypatch.setattr(engines.time, "sleep", lambda s: events.append(("sleep", s)))
    engines._print_stacks(10)
    signum, gap = engines.shared_gpu.STACKS_SIGNAL, ("sleep", engines.STACKS_GAP_S)
    assert events == [("kill", 11, signum), gap, ("kill", 12, signum), gap,
                      ("kill", 14, signum), gap]


def test_only_processes_that_handle_the_stacks_signal_get_it():
    """A process without a handler (Ray's log monitor, say) would end at the signal: the
    harness tells them apart by /proc's SigCgt."""
    import signal
    import subprocess

    signum = int(engines.shared_gpu.STACKS_SIGNAL)
    handles = subprocess.Popen([sys.executable, "-c", "import faulthandler, sys, time; "
                                f"faulthandler.register({signum}); print(1, flush=True); "
                                "time.sleep(30)"], stdout=subprocess.PIPE)
    plain = subprocess.Popen(["sleep", "30"])
    try:
        handles.stdout.readline()
        assert engines.catches(handles.pid, signum)
        assert not engines.catches(plain.pid, signum)
        assert not engines.catches(plain.pid, signal.SIGKILL)
    finally:
        handles.kill(), plain.kill(), handles.wait(), plain.wait()


def test_the_test_plugin_registers_every_engine_process_for_the_stacks_signal(monkeypatch):
    """The plugin's entry point, in a process where the checks engage it, registers
    faulthandler for the signal the harness sends a hung engine."""
    import faulthandler
    import vllm_pcp_shared_gpu as plugin

    registered = []
    monkeypatch.setattr(faulthandler, "register", lambda *a, **k: registered.append((a, k)))
    monkeypatch.setattr(plugin, "_registered", False)
    monkeypatch.setenv(plugin.MODE_VAR, "auto")
    monkeypatch.delenv(plugin.ENGAGED_VAR, raising=False)
    for wrap in ("_wrap_engine_args", "_wrap_device_ids_of_workers"):
        monkeypatch.setattr(plugin, wrap, lambda: None)
    plugin.register()
    assert registered == [((plugin.STACKS_SIGNAL,), {"all_threads": True})]


def test_a_ray_engine_runs_outside_the_mps_daemon_the_others_use(fake, monkeypatch, tmp_path):
    """Under an MPS daemon a Ray engine lost its local Ray head (`Failed to connect to GCS`)
    and hung: its processes are pointed at a pipe folder where no daemon listens."""
    work, _ = fake
    monkeypatch.setenv(engines.shared_gpu.MPS_PIPE_VAR, "/tmp/the-daemon")
    for layout in ("pcp2-dcp2-i1", "pcp2-dcp2-i1-ray"):
        engines.run_engine(engines.Job("smollm2", "chunked", layout), work)
    mps, ray_mps = (tmp_path / "calls.mps").read_text().split()
    assert mps == "/tmp/the-daemon" and "vllm-pcp-no-mps-" in ray_mps


def test_workers_of_one_session_share_one_run_of_a_job(fake):
    work, calls = fake
    job = engines.Job("smollm2", "chunked", "pcp1")
    with ThreadPoolExecutor(3) as pool:
        got = list(pool.map(lambda _: engines.run_engine(job, work), range(3)))
    assert len(calls()) == 1 and len(got) == 3 and got[0] == got[1] == got[2]


def test_an_entry_of_another_vllm_runs_again(fake, monkeypatch):
    """A work dir kept from a run on another vLLM holds successes its jobs would reuse: the
    job names the installed vLLM, so those entries run again."""
    work, calls = fake
    job = engines.Job("smollm2", "chunked", "pcp2")
    assert engines.run_engine(job, work)["job"]["vllm"] == engines.installed_vllm()
    engines.run_engine(job, work)
    monkeypatch.setattr(engines, "installed_vllm", lambda: "0.0.1")
    engines.run_engine(job, work)
    assert len(calls()) == 2


def test_a_repeat_is_a_run_of_its_own_and_differences_are_named(fake):
    work, calls = fake
    job = engines.Job("smollm2", "chunked", "pcp1")
    first, again = (engines.run_engine(j, work) for j in (job, engines.Job(**{
        **job.__dict__, "repeat": 1})))
    assert len(calls()) == 2 and again["results"] == first["results"]
    assert engines.judge.differing_cases(first, again) == (1, [])
    again["results"][0]["outputs"][0]["logprobs"][0]["5"] = -0.5000001
    assert engines.judge.differing_cases(first, again) == (1, ["results:len_1"])


def test_the_cases_are_the_prompts_the_committed_results_ran():  # compared token for token
    data = [cases.build_cases(32824, 151936), cases.build_cases(8152, 49152)] + [
        cases.feature_cases(g, 32824, 151936, True) for g in ("features", "same-step",
                                                               "preemption")]
    digest = hashlib.sha1(json.dumps(data).encode()).hexdigest()
    assert digest == "f489a439c3aa14e0a44fbeb0017f88295ce12f5e"


@pytest.fixture(scope="module")
def vllm_parse():
    """``vllm serve``'s engine flags through the installed vLLM's own parser."""
    from vllm.platforms import current_platform

    had = current_platform.device_type
    current_platform.device_type = had or "cuda"  # DeviceConfig("auto") needs one
    from vllm.engine.arg_utils import EngineArgs
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = EngineArgs.add_cli_args(FlexibleArgumentParser())
    yield lambda flags: EngineArgs.from_cli_args(parser.parse_args(["--model", "x", *flags]))
    current_platform.device_type = had


@pytest.mark.parametrize("name", sorted(layouts.LAYOUTS))
def test_serve_flags_say_what_engine_kwargs_say(vllm_parse, name):
    kwargs, args = layouts.engine_kwargs(name), vllm_parse(layouts.serve_flags(name))
    keys = ("prefill_context_parallel_size", "decode_context_parallel_size", "kv_cache_dtype",
            "tensor_parallel_size", "enforce_eager")
    assert {k: getattr(args, k) for k in keys} == {k: kwargs[k] for k in keys}
    assert args.cp_kv_cache_interleave_size == kwargs.get("cp_kv_cache_interleave_size")
    assert str(args.attention_backend) == kwargs["attention_backend"]
    assert args.additional_config == kwargs.get("additional_config", {})
    assert args.distributed_executor_backend == kwargs.get("distributed_executor_backend")
    if "compilation_config" in kwargs:
        assert args.compilation_config.pass_config.fuse_allreduce_rms is False


def test_the_interleave_is_given_only_with_dcp_where_vllm_resolves_an_omitted_one_to_1():
    """Without -dcp the layouts leave --cp-kv-cache-interleave-size out; vLLM's
    ParallelConfig then takes 1, as it would from the flag."""
    import inspect

    from vllm.config import ParallelConfig
    from vllm.engine.arg_utils import EngineArgs

    assert "cp_kv_cache_interleave_size" not in layouts.engine_kwargs("pcp2")
    assert layouts.engine_kwargs("pcp2-dcp2-i8")["cp_kv_cache_interleave_size"] == 8
    assert "else ParallelConfig.cp_kv_cache_interleave_size" in inspect.getsource(
        EngineArgs.create_engine_config)
    assert ParallelConfig.cp_kv_cache_interleave_size == 1


def test_one_gpu_baselines_are_plain_pcp1_on_flashinfer():
    """Every layout of several GPUs is held to pcp1 (its CUDA graphs, fp8 or preemption pool
    where it has them), vLLM's FlashInfer with nothing switched: no runner choice, the
    plugin loaded, which at PCP = 1 changes nothing."""
    assert {layouts.baseline(n) for n in layouts.LAYOUTS} == {
        None, "pcp1", "pcp1-graphs", "pcp1-fp8", "pcp1-preempt"}
    for name in ("pcp1", "pcp1-graphs", "pcp1-fp8", "pcp1-preempt"):
        lay = layouts.LAYOUTS[name]
        assert (lay.pcp, lay.tp, lay.dcp, lay.env, lay.knobs) == (1, 1, 1, {}, {}), name
        assert lay.attention_backend == "FLASHINFER"
    assert layouts.baseline("pcp2-graphs") == "pcp1-graphs"
    assert layouts.baseline("pcp4-fp8") == "pcp1-fp8"
    assert layouts.baseline("pcp2-dcp2-i16-preempt") == "pcp1-preempt"
    assert layouts.baseline("tp2-dcp2-i8") == "pcp1" and layouts.baseline("pcp1-stock") is None


def test_engines_run_model_runner_v2_and_stock_layouts_load_no_vllm_pcp():
    """No engine inherits a runner choice (one GPU then draws as the -pcp engines do); a
    stock layout (vLLM's own -tp, DCP inside TP) loads only the test harness's plugin,
    whose entry point is the name it gives."""
    base = {"VLLM_USE_V2_MODEL_RUNNER": "0", "X": "1"}
    assert layouts.engine_env("pcp1", base) == {"X": "1"}
    assert layouts.engine_env("tp2-dcp2-i1", base) == {
        "X": "1", "VLLM_PLUGINS": layouts.STOCK_PLUGINS}
    assert base["VLLM_USE_V2_MODEL_RUNNER"] == "0"  # the caller's own is left alone
    stock = {n for n, lay in layouts.LAYOUTS.items() if lay.stock}
    assert stock == {"pcp1-stock", "tp2", "tp2-dcp2-i1", "tp2-dcp2-i8", "tp2-dcp2-i16",
                     "tp2-dcp2-i8-graphs"}
    entry = os.path.join(engines.shared_gpu.PLUGIN_DIR, "vllm_pcp_shared_gpu-0.1.dist-info",
                         "entry_points.txt")
    assert f"{layouts.STOCK_PLUGINS} = vllm_pcp_shared_gpu:register" in open(entry).read()
    assert "VLLM_USE_V2_MODEL_RUNNER" not in engines.job_env("pcp1")


def test_the_layouts_decode_policy_is_the_plugins():
    """The decode policy the checks expect of each layout (and model kind) is the one
    vllm_pcp.knobs resolves; a MoE model shards its decodes from -pcp 4 on."""
    from vllm_pcp.knobs import PCPKnobs, resolve_decode_policy

    for name, lay in layouts.LAYOUTS.items():
        for moe in (False, True):
            knobs = PCPKnobs.from_additional_config(lay.knobs)
            want = None if lay.pcp == 1 else resolve_decode_policy(knobs, lay.pcp, lay.dcp, moe)
            assert layouts.decode_policy(name, moe) == want, (name, moe)
    assert [layouts.decode_policy("pcp4", moe) for moe in (False, True)] == ["replicate", "shard"]
    assert layouts.decode_policy("pcp2-shard", False) == "shard"
    assert layouts.decode_policy("pcp2", True) == "replicate"


def test_seeded_samples_are_held_to_one_gpu_at_dcp1_on_the_paged_kernel_only():
    assert layouts.exact_sampling("pcp2-paged")
    assert not any(map(layouts.exact_sampling, ("pcp1", "pcp2", "pcp2-fp8", "pcp2-shard",
                                                 "pcp2-dcp2-i8", "tp2-pcp2", "tp2-dcp2-i8")))


def test_the_agreement_case_decodes_a_greedy_and_a_seeded_request_together():
    import worker

    (case,) = cases.feature_cases("agreement", 32824, 151936)
    greedy, seeded = worker.feature_params(case, max_tokens=32)
    assert len(case["prompts"]) == 2 and case["kind"] == "agreement"
    assert (greedy.temperature, greedy.max_tokens) == (0.0, cases.AGREEMENT_DECODE_TOKENS)
    assert (seeded.temperature, seeded.seed, seeded.max_tokens) == (
        0.8, 4321, cases.AGREEMENT_DECODE_TOKENS)
    assert greedy.ignore_eos and seeded.ignore_eos and greedy.logprobs == seeded.logprobs == 5
    (burst,) = [c for c in cases.feature_cases("same-step", 8152, 49152) if c["case"] == "burst"]
    params = worker.feature_params(burst, max_tokens=32)  # one sampling for every prompt
    assert len(params) == len(burst["prompts"]) and {p.max_tokens for p in params} == {32}


def test_a_budget_layout_leaves_the_kv_pool_to_vllms_profile_run():
    import worker

    hf = {"max_position_embeddings": 32768, "num_hidden_layers": 4, "num_key_value_heads": 2,
          "hidden_size": 2048, "num_attention_heads": 16}
    budget = worker.engine_kwargs("pcp2-budget", hf, "unchunked", 32, ["budget"], False)
    fixed = worker.engine_kwargs("pcp2", hf, "unchunked", 32, ["standard"], False)
    assert budget["gpu_memory_utilization"] == 0.9 and "kv_cache_memory_bytes" not in budget
    assert fixed["gpu_memory_utilization"] == 0.05 and fixed["kv_cache_memory_bytes"] > 0
    assert budget["max_num_batched_tokens"] == budget["max_model_len"]  # one step: the longest
    longest, full = cases.feature_cases("budget", budget["max_model_len"] - 40, 151936)
    assert [len(p) for p in longest["prompts"]] == [budget["max_model_len"] - 40]
    assert sum(map(len, full["prompts"])) <= budget["max_num_batched_tokens"]
    assert len(full["prompts"]) == 4


class _StandInLLM:
    """``vllm.LLM`` as the worker uses it with no case groups; ``events`` in call order,
    ``parallel`` its parallel config's fields."""
    events: list = []
    parallel: dict = {}

    def __init__(self, model, **kwargs):
        from types import SimpleNamespace

        cache = SimpleNamespace(num_gpu_blocks=4, block_size=16)
        core = SimpleNamespace(shutdown=lambda: self.events.append(("shutdown", self._out())))
        config = SimpleNamespace(cache_config=cache, use_v2_model_runner=True,
                                 parallel_config=SimpleNamespace(**self.parallel))
        self.llm_engine = SimpleNamespace(vllm_config=config, engine_core=core)

    def _out(self) -> bool:  # whether the output was written when the engine shut down
        return os.path.exists(self.out_path)

    def collective_rpc(self, method, args=()):
        self.events.append(("rpc", method))
        return [None, None]


@pytest.mark.parametrize("pcp, backend", [(2, "ray"), (2, "mp"), (1, "mp")])
def test_the_worker_stops_a_ray_engine_after_writing_its_output(monkeypatch, tmp_path, pcp,
                                                                 backend):
    """Left to the exit, Ray's shutdown would come before the executor's and a Ray engine
    would hang there: the worker stops a Ray engine itself, once its whole output is
    written; other executors stop at the exit. vLLM's own worker (PCP 1) is never asked
    for the PCP worker's counts: its ranks' failures would answer later calls."""
    import vllm
    import worker

    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({
        "max_position_embeddings": 4096, "num_hidden_layers": 2, "num_key_value_heads": 2,
        "hidden_size": 128, "num_attention_heads": 4, "vocab_size": 1000}))
    out = tmp_path / "out.json"
    monkeypatch.setattr(_StandInLLM, "events", [])
    monkeypatch.setattr(_StandInLLM, "out_path", str(out), raising=False)
    monkeypatch.setattr(_StandInLLM, "parallel", {"prefill_context_parallel_size": pcp,
                                                  "distributed_executor_backend": backend})
    monkeypatch.setattr(vllm, "LLM", _StandInLLM)
    monkeypatch.setattr(sys, "argv", ["worker.py", "--model", str(model), "--layout", "pcp2",
                                      "--variant", "chunked", "--groups", "none", "--out", str(out)])
    monkeypatch.setattr(os, "environ", dict(os.environ))  # main sets the layout's variables
    worker.main()
    written = json.loads(out.read_text())
    assert written["kv_capacity_tokens"] == 64 and written["model_runner_v2"] is True
    assert written["vllm_version"] == vllm.__version__
    assert not os.path.exists(str(out) + ".part")
    shutdowns = [e for e in _StandInLLM.events if e[0] == "shutdown"]
    assert shutdowns == ([("shutdown", True)] if backend == "ray" else [])
    assert not shutdowns or _StandInLLM.events[-1] == ("shutdown", True)
    rpcs = [e[1] for e in _StandInLLM.events if e[0] == "rpc"]
    assert rpcs == ([] if pcp == 1 else ["pcp_memory", "pcp_step_counts",
                                         "pcp_sampled_token_checks"])


def test_vllms_ray_executor_stops_its_ranks_through_ray_at_exit_after_rays_own_shutdown():
    """What ``worker.shut_down`` works around, pinned: importing vLLM registers
    ``weakref.finalize``'s exit hook before ``ray`` is imported (so Ray's exit hook runs
    first), the Ray executor's finalizer calls its ``shutdown``, which calls ``ray.kill``;
    and the in-process engine client's ``shutdown`` reaches the executor's."""
    import ast
    import importlib.util
    import inspect
    import subprocess
    import textwrap

    from vllm.v1.engine import core, core_client

    probe = textwrap.dedent("""
        import sys, weakref
        import vllm.engine.arg_utils, vllm.entrypoints.llm
        print(weakref.finalize._registered_with_atexit, "ray" in sys.modules)""")
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True)
    assert done.stdout.split()[-2:] == ["True", "False"], done.stderr[-2000:]
    # its module imports only where Ray is installed: read as source
    path = importlib.util.find_spec("vllm.v1.executor.ray_executor_v2").origin
    source = open(path).read()
    (executor,) = [n for n in ast.parse(source).body
                   if isinstance(n, ast.ClassDef) and n.name == "RayExecutorV2"]
    methods = {n.name: ast.get_source_segment(source, n) for n in executor.body
               if isinstance(n, ast.FunctionDef)}
    assert "weakref.finalize(self, self.shutdown)" in ast.get_source_segment(source, executor)
    assert "ray.kill(" in methods["shutdown"]
    assert "self.engine_core.shutdown()" in inspect.getsource(core_client.InprocClient.shutdown)
    assert "self.model_executor.shutdown()" in inspect.getsource(core.EngineCore.shutdown)
