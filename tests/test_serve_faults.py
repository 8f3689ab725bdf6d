"""scripts/serve_faults.py against stand-ins: the bad requests against the fake OpenAI
server of tests/fake_openai.py (classification, the probes around each, the -pcp 1
reference), and the dead-rank check against a fake server process whose two "workers"
are sleeping children titled as vLLM titles its workers."""
import json
import os
import re
import subprocess
import sys

import pytest

import fake_openai
import serve_stage_stub

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "scripts"))
import serve_faults  # noqa: E402

TESTS = os.path.dirname(os.path.abspath(__file__))
# argv: LOG MODE. Serves the fake API, starts two titled sleeping workers and prints its
# port; with MODE "monitor" it does what vLLM's worker monitor does on a death: logs the
# dead VllmWorker-N, reports unhealthy, stops the other worker, exits.
FAKE_SERVER = f"""import os, subprocess, sys, time
sys.path.insert(0, {TESTS!r})
import fake_openai
log = open(sys.argv[1], "w", buffering=1)
state = fake_openai.FakeState(long_prompt_tokens=1000, max_model_len=100000)
server = fake_openai.start(state)
workers = [subprocess.Popen(["bash", "-c", f"exec -a VLLM::Worker_PCP{{r}} sleep 60"])
           for r in range(2)]
for r, w in enumerate(workers):
    for _ in range(500):  # until bash has become the titled sleep
        if open(f"/proc/{{w.pid}}/cmdline").read().startswith("VLLM::"):
            break
        time.sleep(0.01)
    log.write(f"(Worker_PCP{{r}} pid={{w.pid}}) INFO [gpu_worker.py:1] loaded\\n")
print(server.server_address[1], flush=True)
for _ in range(3000):
    if any(w.poll() is not None for w in workers):
        break
    time.sleep(0.02)
if sys.argv[2] != "monitor":
    time.sleep(30)
dead = next(r for r, w in enumerate(workers) if w.poll() is not None)
log.write(f"(EngineCore pid={{os.getpid()}}) ERROR [multiproc_executor.py:285] Worker proc "
          f"VllmWorker-{{dead}} died unexpectedly (exit code: {{workers[dead].returncode}}), "
          "shutting down executor.\\n")
time.sleep(0.3)
state.dead.set()
time.sleep(0.4)
for w in workers:
    w.kill()
    w.wait()
os._exit(0)
"""


@pytest.fixture
def fake():
    state = fake_openai.FakeState(max_model_len=64)
    server = fake_openai.start(state)
    yield state, server.server_address[1]
    server.shutdown()


def test_classification_of_answers():
    ok = {"choices": [{"index": 0, "text": "x"}]}
    assert serve_faults.classify(400, "bad", 1, False) == "rejected"
    assert serve_faults.classify(422, {}, 1, False) == "rejected"
    assert serve_faults.classify(200, ok, 1, False) == "answered"
    assert serve_faults.classify(200, ok, 2, False) == "bad"  # n choices asked, one came
    assert serve_faults.classify(200, ok, 1, True) == "bad"  # max_tokens 0 with a text
    assert serve_faults.classify(200, {"choices": [{"text": ""}]}, 1, True) == "answered"
    assert serve_faults.classify(500, {"error": "x"}, 1, False) == "bad"
    assert serve_faults.classify(None, "timed out", 1, False) == "bad"
    assert serve_faults.classify(200, "not json", 1, False) == "bad"


def test_bad_requests_are_4xx_or_answers_and_the_probes_stay_the_same(fake):
    _, port = fake
    run = serve_faults.run_cases(port, "m", 64, 4, reference=None)
    outcomes = {c["case"]: c["outcome"] for c in run["cases"]}
    assert outcomes == {"empty_prompt": "rejected", "prompt_over_max_model_len": "rejected",
                        "max_tokens_0": "rejected", "one_token_prompt": "answered",
                        "n_over_max_num_seqs": "answered", "malformed_json": "rejected"}
    assert all(c["ok"] and c["healthy_after"] for c in run["cases"])
    assert run["ranks_in_step"] is True and run["probe"].startswith("answer")
    n_case = next(c for c in run["cases"] if c["case"] == "n_over_max_num_seqs")
    assert len(n_case["texts"]) == 5


def test_a_500_or_a_changed_probe_fails_the_run(fake):
    state, port = fake
    state.fail_nth = {4}  # probe, empty prompt, probe, then the too-long prompt
    state.drift_after_malformed = True
    run = serve_faults.run_cases(port, "m", 64, 4, reference=None)
    bad = [c["case"] for c in run["cases"] if not c["ok"]]
    assert bad == ["prompt_over_max_model_len"]
    assert run["ranks_in_step"] is False  # the probe after the malformed request differs


def test_answers_are_held_to_the_reference_run(fake, tmp_path, monkeypatch):
    state, port = fake
    monkeypatch.setattr(serve_faults, "run_meta", lambda rev: {"git_rev": rev})
    ref, out = tmp_path / "pcp1.json", tmp_path / "pcp2.json"
    common = ["--port", str(port), "--model", "m", "--max-num-seqs", "4"]
    assert _main(monkeypatch, "requests", *common, "--name", "pcp1", "--out", str(ref)) == 0
    assert json.loads(ref.read_text())["max_model_len"] == 64  # from /v1/models
    with_ref = [*common, "--name", "pcp2", "--reference", str(ref), "--out", str(out)]
    assert _main(monkeypatch, "requests", *with_ref) == 0
    result = json.loads(out.read_text())
    assert result["goals"] == {"each_4xx_or_correct": True, "ranks_in_step": True}
    assert result["probe_equals_reference"] is True and result["check"] == "requests"
    state.text_suffix = " other"  # answers no longer those of the reference run
    assert _main(monkeypatch, "requests", *with_ref) == 1
    result = json.loads(out.read_text())
    assert {c["case"] for c in result["cases"] if not c["ok"]} == {
        "one_token_prompt", "n_over_max_num_seqs"}
    assert result["probe_equals_reference"] is False and result["ranks_in_step"] is True


def test_a_missing_reference_fails_the_answers(fake, tmp_path, monkeypatch):
    _, port = fake
    monkeypatch.setattr(serve_faults, "run_meta", lambda rev: {})
    out = tmp_path / "out.json"
    assert _main(monkeypatch, "requests", "--port", str(port), "--model", "m",
                 "--reference", str(tmp_path / "none.json"), "--reference-wait-s", "0",
                 "--out", str(out)) == 1
    assert json.loads(out.read_text())["goals"]["each_4xx_or_correct"] is False


def test_global_rank_from_worker_titles():
    def worker(title):
        match = serve_faults.WORKER_TITLE.match(title)
        groups = {g: int(i) for g, i in re.findall(r"_([A-Z]+)(\d+)", match.group(1))}
        return {"title": title, "groups": groups}

    grid = [worker(f"VLLM::Worker_PCP{p}_TP{t}") for p in range(2) for t in range(2)]
    assert [serve_faults.global_rank(w, grid) for w in grid] == [0, 1, 2, 3]
    pcp_dcp = [worker(f"VLLM::Worker_PCP{p}_DCP{p}") for p in range(2)]
    assert [serve_faults.global_rank(w, pcp_dcp) for w in pcp_dcp] == [0, 1]
    assert serve_faults.WORKER_TITLE.match("VLLM::EngineCore") is None
    assert serve_faults.WORKER_TITLE.match("VLLM::Worker_PCP1 ") is not None


def test_the_log_lines_about_a_dead_worker():
    log = ("(Worker_PCP1 pid=42) INFO [gpu_worker.py:1] loaded\n"
           "(APIServer pid=7) INFO Received request cmpl-1\n"
           "(EngineCore pid=9) ERROR [multiproc_executor.py:285] Worker proc VllmWorker-1 "
           "died unexpectedly (exit code: -9), shutting down executor.\n"
           "(EngineCore pid=9) ERROR [core.py:1330] EngineCore encountered a fatal error.\n"
           "(Worker_PCP0 pid=41) INFO [gpu_worker.py:1] loaded\n")
    lines = serve_faults.dead_worker_lines(log, 42)
    assert len(lines) == 3 and lines[-1].startswith("(Worker_PCP1 pid=42)")
    assert serve_faults.named_rank(lines) == 1
    assert serve_faults.named_rank(["nothing here"]) is None


@pytest.fixture
def fake_server(tmp_path, request):
    """The fake server process (MODE from the test's parameter): its Popen, port, log."""
    log = tmp_path / "server.log"
    proc = subprocess.Popen([sys.executable, "-c", FAKE_SERVER, str(log), request.param],
                            stdout=subprocess.PIPE, text=True, start_new_session=True)
    port = int(proc.stdout.readline())
    yield proc, port, log
    try:
        os.killpg(proc.pid, 9)
    except ProcessLookupError:
        pass
    proc.wait(timeout=10)


def _main(monkeypatch, *argv) -> int:
    monkeypatch.setattr(sys, "argv", ["serve_faults.py", *argv])
    with pytest.raises(SystemExit) as exit_:
        serve_faults.main()
    return exit_.value.code


def _dead_rank(monkeypatch, tmp_path, proc, port, log, *more) -> dict:
    monkeypatch.setattr(serve_faults, "run_meta", lambda rev: {})
    out = tmp_path / "dead.json"
    _main(monkeypatch, "dead-rank", "--port", str(port), "--model", "m", "--name", "pcp2",
          "--server-pid", str(proc.pid), "--server-log", str(log), "--prompt-tokens", "2000",
          "--kill-after-s", "0.1", "--poll-s", "0.1", "--running-wait-s", "5",
          "--out", str(out), *more)
    return json.loads(out.read_text())


@pytest.mark.parametrize("fake_server", ["monitor"], indirect=True)
def test_a_killed_worker_stops_the_server_and_is_named(fake_server, tmp_path, monkeypatch):
    proc, port, log = fake_server
    result = _dead_rank(monkeypatch, tmp_path, proc, port, log, "--deadline-s", "5",
                        "--leftover-wait-s", "3", "--client-timeout-s", "5")
    assert result["goals"] == {"stops_within_60s": True, "log_names_dead_rank": True,
                               "no_request_waits_forever": True}
    assert result["killed"]["title"] == "VLLM::Worker_PCP1" and result["killed"]["rank"] == 1
    assert [w["title"] for w in result["workers"]] == ["VLLM::Worker_PCP0", "VLLM::Worker_PCP1"]
    assert result["prefill_scheduled"] and result["prefill_running_at_kill"]
    assert 0.2 <= result["seconds_to_unhealthy"] <= result["seconds_to_exit"] < 3
    assert result["processes_left"] == []
    assert result["long_request"]["status"] in (500, None)
    assert result["request_after_kill"]["status"] == 200
    assert "VllmWorker-1 died unexpectedly (exit code: -9)" in result["log_lines"][0]


@pytest.mark.parametrize("fake_server", ["ignore"], indirect=True)
def test_a_server_that_never_notices_fails_every_goal_within_the_deadline(
        fake_server, tmp_path, monkeypatch):
    proc, port, log = fake_server
    result = _dead_rank(monkeypatch, tmp_path, proc, port, log, "--deadline-s", "0.5",
                        "--leftover-wait-s", "0.2", "--client-timeout-s", "1.5")
    assert result["goals"] == {"stops_within_60s": False, "log_names_dead_rank": False,
                               "no_request_waits_forever": False}
    assert result["seconds_to_unhealthy"] is None and result["seconds_to_exit"] is None
    assert result["long_request"]["seconds"] >= 1.0  # waited until its client gave up
    assert proc.pid in result["processes_left"]


def test_no_worker_processes_is_an_error_not_a_kill(tmp_path, monkeypatch):
    monkeypatch.setattr(serve_faults, "run_meta", lambda rev: {})
    sleeper = subprocess.Popen(["sleep", "30"])
    try:
        out = tmp_path / "dead.json"
        assert _main(monkeypatch, "dead-rank", "--server-pid", str(sleeper.pid),
                     "--server-log", str(tmp_path / "log"), "--find-workers-s", "0",
                     "--out", str(out)) == 1
        result = json.loads(out.read_text())
        assert result["error"] == "0 worker processes found"
        assert not any(result["goals"].values()) and sleeper.poll() is None
    finally:
        sleeper.kill()
        sleeper.wait()


def test_the_faults_stage_holds_pcp2_to_pcp1_and_kills_a_rank_of_each(tmp_path):
    res, calls = serve_stage_stub.run_stage(tmp_path, "faults", FAULTS_CONFIGS="pcp2-dcp2")
    assert res.returncode == 0, res.stderr
    servers = {c["argv"][0]: c for c in calls if c["script"] == "serve"}
    assert sorted(servers) == ["8401", "8403"]
    # the reference on the V1 runner, as the PCP servers: seeded draws comparable
    assert servers["8401"]["v2_runner"] == "0" and servers["8403"]["v2_runner"] is None
    work = tmp_path / "checks" / "faults"
    runs = [c["argv"] for c in calls if c["script"] == "serve_faults.py"]
    by = {(a[0], serve_stage_stub.flag(a, "--name")): a for a in runs if a[0] != "merge"}
    assert set(by) == {("requests", "pcp1"), ("requests", "pcp2-dcp2"),
                       ("dead-rank", "pcp2-dcp2")}
    assert "--reference" not in by["requests", "pcp1"]
    assert serve_stage_stub.flag(by["requests", "pcp2-dcp2"], "--reference") == str(
        work / "faults-pcp1.json")
    dead = by["dead-rank", "pcp2-dcp2"]
    assert serve_stage_stub.flag(dead, "--server-log") == str(work / "pcp2-dcp2-server.log")
    merge = next(a for a in runs if a[0] == "merge")
    assert merge[1:4] == [str(work / n) for n in (
        "faults-pcp1.json", "faults-pcp2-dcp2.json", "dead-rank-pcp2-dcp2.json")]
    # the merged file names the stage that ran, not the first run's command
    assert serve_stage_stub.flag(merge, "--command").startswith(
        "scripts/run_gpu_checks.sh faults")
    assert (tmp_path / "out" / "serve-faults.json").exists()


def test_merge_records_the_stage_command_and_keeps_each_runs_meta(tmp_path):
    from serve_client import merge

    run = {"meta": {"git_rev": "abc", "command": "serve_faults.py requests", "vllm": "0.26.0"},
           "name": "pcp2", "check": "requests", "goals": {"each_4xx_or_correct": True}}
    path = tmp_path / "run.json"
    path.write_text(json.dumps(run))
    merged = merge([str(path)], "scripts/run_gpu_checks.sh faults")
    assert merged["meta"] == {"git_rev": "abc", "command": "scripts/run_gpu_checks.sh faults",
                              "vllm": "0.26.0"}
    assert merged["runs"][0]["meta"]["command"] == "serve_faults.py requests"
    assert merge([str(path)])["meta"]["command"] == "serve_faults.py requests"
