"""scripts/serve_soak.py against a stand-in OpenAI server on 127.0.0.1 (tests/fake_openai.py):
outcome counts, cancellations, hangs, percentiles, memory sampling of a process tree, the
greedy comparison, and the whole reference / soak / merge run, in a few seconds."""
import asyncio
import json
import os
import socket
import subprocess
import sys

import pytest

import fake_openai
import serve_stage_stub

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "scripts"))
import serve_client  # noqa: E402
import serve_soak  # noqa: E402


@pytest.fixture
def fake():
    state = fake_openai.FakeState()
    server = fake_openai.start(state)
    yield state, server.server_address[1]
    state.dead.set()
    server.shutdown()


def _plan(**kw) -> serve_soak.SoakPlan:
    fields = dict(concurrency=3, duration_s=5.0, prompt_lens=(8, 16), max_tokens=6,
                  cancel_every=10, request_timeout_s=2.0, max_requests=20, seed=0)
    return serve_soak.SoakPlan(**{**fields, **kw})


def test_percentile_interpolates_and_is_none_without_values():
    assert serve_soak.percentile([], 50) is None
    assert serve_soak.percentile([3.0], 99) == 3.0
    assert serve_soak.percentile([1.0, 2.0, 3.0, 4.0], 50) == 2.5
    assert serve_soak.percentile(list(map(float, range(101))), 99) == pytest.approx(99.0)


def test_request_specs_are_repeatable_distinct_and_a_tenth_cancelled():
    plan = _plan(prompt_lens=(1024, 65536), max_requests=100)
    specs = [serve_soak.request_spec(i, plan) for i in range(100)]
    assert specs[7].prompt == serve_soak.request_spec(7, plan).prompt
    assert len({tuple(s.prompt[:32]) for s in specs}) == 100
    assert {len(s.prompt) for s in specs} == {1024, 65536}
    cancelled = [s for s in specs if s.cancel_after_chunks is not None]
    assert [s.index for s in cancelled] == list(range(9, 100, 10))
    assert all(1 <= s.cancel_after_chunks < plan.max_tokens for s in cancelled)


def test_the_clients_count_done_and_cancelled_requests_and_their_tokens(fake):
    _, port = fake
    plan = _plan()
    records = asyncio.run(serve_soak.run_clients(port, "m", plan))
    stats = serve_soak.summarize(records, plan)
    assert stats["requests_sent"] == 20  # max_requests ends the loop before the duration
    assert stats["requests_done"] == 18 and stats["cancelled"] == stats["cancel_planned"] == 2
    assert stats["errors"] == stats["hangs"] == 0
    cancelled_tokens = sum(r.completion_tokens for r in records if r.outcome == "cancelled")
    assert stats["completion_tokens"] == 18 * plan.max_tokens + cancelled_tokens
    assert 2 <= cancelled_tokens < 2 * plan.max_tokens
    assert stats["prompt_tokens"] == sum(r.prompt_len for r in records)
    assert stats["ttft_s"]["count"] == 20 and stats["ttft_s"]["p50"] > 0
    assert stats["itl_s"]["p99"] >= stats["itl_s"]["p50"] > 0


def test_the_duration_ends_the_loop(fake):
    _, port = fake
    plan = _plan(duration_s=0.3, max_requests=100_000)
    records = asyncio.run(serve_soak.run_clients(port, "m", plan))
    assert 0 < len(records) < 100_000
    assert all(r.seconds < 1.0 for r in records)


def test_a_stalled_request_is_a_hang_and_a_500_an_error(fake):
    state, port = fake
    state.stall_nth, state.fail_nth = {2}, {4}
    plan = _plan(max_requests=8, request_timeout_s=0.5, cancel_every=0)
    stats = serve_soak.summarize(asyncio.run(serve_soak.run_clients(port, "m", plan)), plan)
    assert stats["hangs"] == 1 and stats["errors"] == 1 and stats["requests_done"] == 6
    kinds = sorted(s["outcome"] for s in stats["error_samples"])
    assert kinds == ["error", "hang"]
    assert any("HTTP 500" in s["error"] for s in stats["error_samples"])


def test_a_refused_connection_is_an_error_not_a_hang():
    plan = _plan(max_requests=2, cancel_every=0)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # nothing listens here
    stats = serve_soak.summarize(asyncio.run(serve_soak.run_clients(port, "m", plan)), plan)
    assert stats["errors"] == 2 and stats["hangs"] == 0


def test_server_sent_event_lines():
    assert serve_client.parse_sse_line(b'data: {"a": 1}\n') == {"a": 1}
    assert serve_client.parse_sse_line(b"data: [DONE]\n") == "[DONE]"
    assert serve_client.parse_sse_line(b"\n") is None
    assert serve_client.parse_sse_line(b": keep-alive\n") is None


@pytest.fixture
def process_tree():
    """A process with one sleeping child, both gone afterwards."""
    code = ("import subprocess, sys, time\n"
            "subprocess.Popen(['sleep', '30'])\n"
            "print('ready', flush=True)\n"
            "time.sleep(30)\n")
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True,
                            start_new_session=True)
    assert proc.stdout.readline().strip() == "ready"
    yield proc
    os.killpg(proc.pid, 9)
    proc.wait(timeout=10)


def test_memory_of_a_process_tree_from_proc(process_tree, monkeypatch):
    pids = serve_soak.tree_pids(process_tree.pid)
    assert pids[0] == process_tree.pid and len(pids) == 2
    assert serve_soak.rss_mib(pids) > serve_soak.rss_mib(pids[1:]) > 0
    assert serve_soak.tree_pids(2**22 + 12345) == []
    monkeypatch.setattr(serve_client.shutil, "which", lambda name: None)  # no nvidia-smi
    sampler = serve_soak.MemorySampler(process_tree.pid)
    asyncio.run(sampler.run(asyncio.Event(), every_s=0.05, max_samples=3))
    assert len(sampler.samples) == 4  # three, and one at the end
    assert all(rss > 0 and gpu is None for _, rss, gpu in sampler.samples)
    report = serve_soak.memory_report(sampler, warmup_s=0.0)
    assert report["rss_flat"] is True and report["gpu_flat"] is None
    assert report["rss_mib"]["max"] >= report["rss_mib"]["last"] > 0


def test_gpu_memory_of_the_server_processes_or_of_the_devices(monkeypatch):
    answers = {"compute-apps=pid,used_memory": [["11", "1000"], ["12", "500"], ["99", "7"]],
               "gpu=memory.used": [["3000"], ["4000"]]}
    monkeypatch.setattr(serve_client.shutil, "which", lambda name: "/usr/bin/nvidia-smi")
    monkeypatch.setattr(serve_client, "_nvidia_smi", answers.__getitem__)
    assert serve_soak.gpu_mib([10, 11, 12]) == (1500.0, "processes")
    assert serve_soak.gpu_mib([50]) == (7000.0, "devices")


def test_memory_that_keeps_growing_is_not_flat():
    times = [0, 10, 20, 30, 40]
    summary = serve_soak.series_summary(times, [900.0, 4000.0, 4100.0, 5000.0, 6000.0], 10)
    assert summary["baseline"] == 4000.0 and summary["growth"] == 2000.0
    assert summary["first"] == 900.0 and summary["max"] == 6000.0
    assert serve_soak.is_flat(summary) is False
    steady = serve_soak.series_summary(times, [900.0, 4000.0, 4300.0, 4100.0, 4200.0], 10)
    assert serve_soak.is_flat(steady) is True
    assert serve_soak.is_flat(serve_soak.series_summary(times, [None] * 5, 10)) is None


def test_greedy_texts_against_the_reference():
    ref = {"a": {"text": "same", "token_logprobs": [-0.5, -1.0]},
           "b": {"text": "abcdef", "token_logprobs": [-0.1]}}
    got = {"a": {"text": "same", "token_logprobs": [-0.5, -1.25]},
           "b": {"text": "abXdef", "token_logprobs": [-0.1]}}
    result = serve_soak.compare_greedy(got, ref)
    assert result["equal"] is False and result["max_abs_logprob_diff"] == 0.25
    assert result["mismatches"] == [{"prompt": "b", "first_diff_char": 2, "text": "abXdef",
                                     "reference": "abcdef"}]
    assert serve_soak.compare_greedy(ref, ref)["equal"] is True
    failed = serve_soak.compare_greedy({"a": {"error": "HTTP 500"}}, {"a": ref["a"]})
    assert failed["equal"] is False and failed["mismatches"][0]["error"] == "HTTP 500"


def _main(monkeypatch, *argv) -> int:
    monkeypatch.setattr(sys, "argv", ["serve_soak.py", *argv])
    with pytest.raises(SystemExit) as exit_:
        serve_soak.main()
    return exit_.value.code


def test_reference_soak_and_merge_end_to_end(fake, tmp_path, monkeypatch, process_tree):
    state, port = fake
    monkeypatch.setattr(serve_soak, "run_meta", lambda rev: {"git_rev": rev})
    ref, out, merged = tmp_path / "ref.json", tmp_path / "soak.json", tmp_path / "all.json"
    common = ["--port", str(port), "--model", "m", "--git-rev", "abc"]
    assert _main(monkeypatch, "reference", *common, "--out", str(ref)) == 0
    assert set(json.loads(ref.read_text())["greedy"]) == set(serve_soak.GREEDY_PROMPTS)
    soak = [*common, "--name", "pcp2", "--out", str(out), "--reference", str(ref),
            "--server-pid", str(process_tree.pid), "--concurrency", "4", "--duration-s",
            "0.5", "--prompt-lens", "8,32", "--max-tokens", "4", "--sample-every-s", "0.1",
            "--warmup-s", "0", "--request-timeout-s", "2"]
    assert _main(monkeypatch, "soak", *soak) == 0
    result = json.loads(out.read_text())
    assert result["goals"] == {"no_errors": True, "no_hangs": True, "outputs_equal": True,
                               "memory_flat": True}
    assert result["meta"] == {"git_rev": "abc"} and result["healthy_after_load"] is True
    assert result["requests_done"] > 0 and result["memory"]["series"]
    state.text_suffix = " changed"  # the server now answers otherwise
    assert _main(monkeypatch, "soak", *soak) == 1
    changed = json.loads(out.read_text())
    assert changed["goals"]["outputs_equal"] is False
    assert len(changed["greedy"]["mismatches"]) == len(serve_soak.GREEDY_PROMPTS)
    assert _main(monkeypatch, "merge", str(out), "--out", str(merged)) == 1
    assert json.loads(merged.read_text())["goals"]["pcp2"]["outputs_equal"] is False


def test_the_soak_stage_serves_each_configuration_and_merges_their_results(tmp_path):
    res, calls = serve_stage_stub.run_stage(tmp_path, "soak", SOAK_DURATION_S="5")
    assert res.returncode == 0, res.stderr
    serves = {c["argv"][0]: c["argv"]  # serve_until_healthy PORT LOG WAIT_S MODEL flags
              for c in calls if c["script"] == "serve"}
    assert set(serves) == {"8301", "8302", "8303"}
    assert serve_stage_stub.flag(serves["8301"], "--prefill-context-parallel-size") == "1"
    assert "--decode-context-parallel-size" not in serves["8302"]
    assert serve_stage_stub.flag(serves["8303"], "--decode-context-parallel-size") == "2"
    assert all(serve_stage_stub.flag(a, "--attention-backend") == "FLASHINFER"
               for a in serves.values())
    runs = {serve_stage_stub.flag(c["argv"], "--name"): c["argv"]
            for c in calls if c["script"] == "serve_soak.py" and c["argv"][0] != "merge"}
    assert runs["pcp1"][0] == "reference" and runs["pcp2"][0] == runs["pcp2-dcp2"][0] == "soak"
    work = tmp_path / "checks" / "soak"
    assert serve_stage_stub.flag(runs["pcp2"], "--reference") == str(work / "soak-pcp1.json")
    assert serve_stage_stub.flag(runs["pcp2"], "--duration-s") == "5"
    assert serve_stage_stub.flag(runs["pcp2"], "--server-pid").isdigit()
    merge = next(c["argv"] for c in calls if c["argv"][0] == "merge")
    assert merge[1:3] == [str(work / "soak-pcp2.json"), str(work / "soak-pcp2-dcp2.json")]
    assert (tmp_path / "out" / "serve-soak.json").exists()


def test_with_ranks_sharing_a_gpu_the_soak_scales_its_load(tmp_path):
    """Fewer GPUs than the two a -pcp 2 server takes: 16 clients, prompts up to 16K,
    180 s, unless the variables say otherwise."""
    import torch

    if torch.cuda.device_count() >= 2:
        pytest.skip("a GPU per rank here: the soak keeps its full load")
    res, calls = serve_stage_stub.run_stage(tmp_path, "soak")
    assert res.returncode == 0, res.stderr
    run = next(c["argv"] for c in calls if c["script"] == "serve_soak.py"
               and serve_stage_stub.flag(c["argv"], "--name") == "pcp2")
    assert [serve_stage_stub.flag(run, f) for f in ("--concurrency", "--prompt-lens",
                                                    "--duration-s")] == ["16",
                                                                         "1024,4096,16384",
                                                                         "180"]
    (tmp_path / "b").mkdir()
    res, calls = serve_stage_stub.run_stage(tmp_path / "b", "soak", SOAK_CONCURRENCY="8")
    run = next(c["argv"] for c in calls if c["script"] == "serve_soak.py"
               and serve_stage_stub.flag(c["argv"], "--name") == "pcp2")
    assert serve_stage_stub.flag(run, "--concurrency") == "8"
