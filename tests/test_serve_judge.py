"""tests/engine/serve.py's judgments: the chat's top-5 rule, bad requests, the dead rank, the
soak's goals, gsm8k's tolerance, result files from parts."""
import json
from types import SimpleNamespace

import pytest

import serve


def test_chat_is_held_to_pcp1_by_the_top5_rule():
    def chat(layout="pcp2", ids=(5, 7), top=None, **kw):
        return {"layout": layout, "text": "a", "token_ids": list(ids), "top_logprobs": top or [
            {str(t): -0.1} for t in ids], "bad_request_status": 400, "text_after_bad_request": "a",
            "clients_hung_up": 4, "aborted_in_log": 4, "text_after_abort": "a", **kw}

    def goals(*runs):
        return serve.judge_chat(list(runs))["goals"]
    base = chat("pcp1", top=[{"5": -0.1}, {"7": -0.2, "8": -0.3}])
    near_tie = chat(ids=(5, 8), top=[{"5": -0.1}, {"8": -0.2, "7": -0.21}])
    assert all(goals(near_tie, base).values())  # pcp1's run is the base wherever it is
    assert not goals(base, chat(ids=(5, 9), top=[{"5": -0.1}, {"9": -0.2}]))["top5_rule"]
    for bad in ({"text_after_abort": "x"}, {"aborted_in_log": 3}, {"clients_hung_up": 0}):
        assert not goals(base, chat(**bad))["serves_after_abort_mid_prefill"]
    assert not goals(base, chat(bad_request_status=500))["bad_request_is_4xx"]
    assert goals(base, {"layout": "pcp2", "error": "x"}) == {}
    log = "Request cmpl-a aborted.\nAborted request(s) cmpl-a-0.\nRequest cmpl-b aborted.\n"
    assert len(serve.ABORT_LINE.findall(log)) == 2  # one line a request


def test_bad_requests_are_rejected_or_answered_as_the_reference():
    ok = {"choices": [{"index": 0, "text": "x"}]}
    answered = serve.judge_case(200, ok, 1, False, None)
    assert answered["ok"] and answered["texts"] == ["x"]
    assert serve.judge_case(422, {}, 1, False, None)["outcome"] == "rejected"
    # n choices asked, one came; max_tokens 0 with a text; a 5xx; no answer
    for args in ((200, ok, 2, False), (200, ok, 1, True), (500, {}, 1, False), (None, "", 1, 0)):
        assert not serve.judge_case(*args, None)["ok"]
    # held to the reference: the same texts, the same outcome, a case it has
    for ref in (answered, {**answered, "texts": ["y"]}, {**answered, "outcome": "rejected"}, {}):
        assert serve.judge_case(200, ok, 1, False, ref)["ok"] is (ref is answered)


def test_the_dead_rank_is_named_by_vllms_worker_monitor():
    log = ("(Worker_PCP1 pid=42) INFO loaded\n(EngineCore pid=9) ERROR Worker proc VllmWorker-1 "
           "died unexpectedly (exit code: -9), shutting down executor.\n"
           "(EngineCore pid=9) ERROR [core.py:1330] EngineCore encountered a fatal error.\n")
    run = {"seconds_to_stop": 9.1, "killed_rank": 1, "requests": [{"seconds": 9.0}] * 2}
    judged = serve.judge_dead_rank(run, log)
    assert judged["named_rank"] == 1 and len(judged["log_lines"]) == 2
    assert all(judged["goals"].values())
    late = {**run, "seconds_to_stop": 90.0, "requests": [{"seconds": serve.TIMEOUT_S}]}
    assert not any(serve.judge_dead_rank(late, "nothing here")["goals"].values())


def _answer(ids=(5, 7), top=None, text="x") -> dict:
    return {"text": text, "token_ids": list(ids),
            "top_logprobs": top or [{str(t): -0.1} for t in ids]}


def test_the_soak_is_scaled_down_on_shared_gpus_and_judged():
    shared = serve.soak_plan(2, 1, "30")
    assert serve.soak_plan(2, 2)["concurrency"] == 64 and "share" in shared["scaled_down"]
    assert (shared["concurrency"], shared["duration_s"]) == (16, 30.0)  # and it says so
    recs = [{"outcome": o, "ttft_s": 0.5, "itl_s": [.1, .3]} for o in ["done"] * 8 + ["cancelled"]]
    steady, ref = [[0, 900, 1], [70, 4000, 1], [140, 4300, 1]], {"a": _answer()}
    same = serve.judge_greedy_set(ref, ref, ref, dcp=1)
    soak = serve.judge_soak(recs, steady, same)
    assert soak["outcomes"] == {"done": 8, "cancelled": 1, "error": 0, "hang": 0}
    assert soak["ttft_s"]["p50"] == 0.5 and soak["itl_s"]["p50"] == 0.2
    assert soak["memory"]["rss"]["growth_mib"] == 300.0 and all(soak["goals"].values())
    growing = [[0, 900, 1], [70, 4000, 1], [140, 4300, 6000]]  # GPU memory
    assert not serve.judge_soak(recs, growing, same)["goals"]["memory_flat"]
    lost = serve.judge_greedy_set({"a": {"error": "500"}}, ref, ref, dcp=1)
    hung = serve.judge_soak([*recs, {**recs[0], "outcome": "hang"}], steady, lost)
    assert hung["greedy"]["mismatches"] == hung["greedy"]["changed_by_load"] == ["a"]
    assert len(hung["error_samples"]) == 1
    assert not any(hung["goals"][k] for k in (
        "no_hangs", "outputs_unchanged_by_load", "outputs_held_to_one_gpu"))


def test_a_short_soak_judges_its_memory_over_its_last_two_thirds():
    """A 60-s soak ends where the 60-s warm-up does: its growth is judged from a third in."""
    recs, ref = [{"outcome": "done", "ttft_s": 0.5, "itl_s": [.1]}], {"a": _answer()}
    same = serve.judge_greedy_set(ref, ref, ref, dcp=1)
    growing = [[0, 7000, 20000], [20, 7000, 20000], [40, 7600, 20000], [60, 8200, 20000],
               [62, 8220, 20000]]  # RSS, from 20 s on
    memory = serve.judge_soak(recs, growing, same)["memory"]
    assert memory["warmup_s"] == 20.7 and memory["rss"]["growth_mib"] == 620
    assert not memory["rss"]["flat"] and memory["gpu"]["flat"]


def test_the_soaks_greedy_set_is_held_to_pcp1_by_the_layouts_rule_and_to_itself():
    """At DCP = 1 the same text as -pcp 1; with -dcp a near tie may flip (the top-5 rule);
    at every layout the set after the load is token for token the one before it."""
    ref = {"a": _answer(top=[{"5": -0.1}, {"7": -0.2, "8": -0.3}])}
    near_tie = {"a": _answer((5, 8), [{"5": -0.1}, {"8": -0.2, "7": -0.21}], text="y")}
    far = {"a": _answer((5, 9), [{"5": -0.1}, {"9": -0.2}], text="z")}
    dcp = serve.judge_greedy_set(near_tie, near_tie, ref, dcp=2)
    assert dcp["mismatches"] == dcp["changed_by_load"] == [] and dcp["one_gpu_rule"] == "top-5 rule"
    assert serve.judge_greedy_set(near_tie, near_tie, ref, dcp=1)["mismatches"] == ["a"]
    assert serve.judge_greedy_set(far, far, ref, dcp=2)["mismatches"] == ["a"]
    changed = serve.judge_greedy_set(near_tie, ref, ref, dcp=2)  # the load moved a token
    assert changed["changed_by_load"] == ["a"] and not changed["mismatches"]
    goals = serve.judge_soak([{"outcome": "done", "ttft_s": 1, "itl_s": [1]}], [[0, 1, 1]],
                             changed)["goals"]
    assert goals["outputs_held_to_one_gpu"] and not goals["outputs_unchanged_by_load"]


def test_a_scored_completion_keeps_its_own_token_among_its_top_logprobs():
    choice = {"text": " 20 kg", "logprobs": {
        "tokens": ["token_id:220", "token_id:17"], "token_logprobs": [-0.5, -2.0],
        "top_logprobs": [{"token_id:220": -0.5, "token_id:18": -1.0}, {"token_id:16": -0.1}]}}
    assert serve.scored(choice) == {"text": " 20 kg", "token_ids": [220, 17], "top_logprobs": [
        {"220": -0.5, "18": -1.0}, {"16": -0.1, "17": -2.0}]}


def test_gsm8k_rows_and_result_files_from_parts(tmp_path, monkeypatch):
    rows = serve.gsm8k_rows([{"layout": n, "exact_match_strict": s, "exact_match_flexible": f,
                              "lm_eval_results": {"sample_len": 300}} for n, s, f in (
        ("pcp1", 0.13, 0.15), ("pcp2-split-all", 0.1333, 0.1467), ("tp2", 0.1, 0.15))])["rows"]
    assert rows[0] == {"config": "pcp1", "questions": 300, "strict": 13.0, "flexible": 15.0}
    assert rows[1]["config"] == "pcp2" and rows[1]["delta_strict"] == 0.33
    assert rows[1]["within_tolerance"] and not rows[2]["within_tolerance"]
    assert "paired" not in rows[1]  # runs that logged no answers
    log = tmp_path / "gsm8k-tp2-pcp2.log"
    log.write_text("INFO ok\n(APIServer pid=0) WARNING [x.py:2] errors like `OSError: [Errno 24] "
                   "Too many open files`\n(EngineCore pid=1) ERROR [core.py:1] torch."
                   "AcceleratorError: CUDA error: an illegal memory access\n(Worker pid=2) ERROR "
                   "[x.py:9] torch.AcceleratorError: CUDA error: an illegal memory access\n"
                   "frame #0: c10::Error"
                   "::Error(c10::SourceLocation)\n\"POST /v1/completions\" 500 Internal Server "
                   "Error\nSticky error detected\nRuntimeError: later\nValueError: last\n")
    crashed = serve.gsm8k_rows([{"layout": "pcp1", "exact_match_strict": 0.1,
                                 "exact_match_flexible": 0.1, "lm_eval_results": {}},
                                {"layout": "tp2-pcp2-split-all", "error": "x" * 600 + "refused",
                                 "server_errors": serve.error_lines(str(log))}])
    failed = crashed["failed"]["tp2-pcp2"]
    assert len(crashed["rows"]) == 1 and len(failed["error"]) == 500
    assert failed["server_log"] == ["torch.AcceleratorError: CUDA error: an illegal memory "
                                    "access", "Sticky error detected", "RuntimeError: later"]
    assert serve.error_lines(str(tmp_path / "missing.log")) == []
    options = {"--engine-work-dir": str(tmp_path / "work"), "--results-dir": str(tmp_path / "out")}
    request = SimpleNamespace(config=SimpleNamespace(getoption=options.get))
    monkeypatch.setattr(serve.results, "meta", lambda command=None, **kw: {"git_rev": "abc", **kw})
    for name, goals, shared in (("pcp1", {"g": True}, None), ("pcp2", {"g": False}, 1)):
        serve.cached(request, f"serve-soak/{name}", lambda: {
            "layout": name, "goals": goals, "ranks_shared_gpus": shared})
    assert serve.cached(request, "serve-soak/pcp1", dict)["goals"] == {"g": True}  # computed once
    serve.write_result(request, "serve-soak.json", serve.goals_file)
    out = json.loads((tmp_path / "out" / "serve-soak.json").read_text())
    assert out["meta"] == {"git_rev": "abc", "ranks_shared_gpus": {
        "gpus": 1, "configs": ["pcp2"], "note": serve.results.SHARED_NOTE}}
    assert out["goals"] == {"pcp1": {"g": True}, "pcp2": {"g": False}}
    assert out["all_goals_met"] is False and len(out["runs"]) == 2
    assert not serve.goals_file([{"layout": "x", "goals": {}}])["all_goals_met"]  # an error


def test_gsm8k_rows_count_the_questions_that_flipped():
    """lm-eval's samples give each run's right answers; the rows count the flips between
    -pcp 1 and a layout and test them (sign test) beside the two scores."""
    samples = [{"doc_id": d, "filter": f, "exact_match": float(d in right)}
               for f, right in (("strict-match", {0, 1, 2}), ("flexible-extract", {0, 1, 2, 3}))
               for d in range(10)]
    assert serve.correct_questions(samples) == {"strict": [0, 1, 2], "flexible": [0, 1, 2, 3]}
    runs = [{"layout": n, "exact_match_strict": len(c["strict"]) / 10,
             "exact_match_flexible": len(c["flexible"]) / 10, "correct": c,
             "lm_eval_results": {"sample_len": 10}} for n, c in (
        ("pcp1", {"strict": [0, 1, 2], "flexible": [0, 1, 2, 3]}),
        ("pcp2-split-all", {"strict": [1, 2, 5], "flexible": [0, 1, 2, 3]}))]
    row = serve.gsm8k_rows(runs)["rows"][1]
    assert row["delta_strict"] == 0 and row["within_tolerance"]
    assert row["paired"]["strict"] == {"right_to_wrong": 1, "wrong_to_right": 1, "same": 8,
                                       "p_value": 1.0}
    assert row["paired"]["flexible"] == {"right_to_wrong": 0, "wrong_to_right": 0, "same": 10,
                                         "p_value": 1.0}
    # 10 flips all one way: p = 2 / 2**10
    assert serve.paired_changes(list(range(10)), [], 20) == {
        "right_to_wrong": 10, "wrong_to_right": 0, "same": 10, "p_value": 0.002}
    assert serve.paired_changes([0, 1, 2], [0, 3], 5)["p_value"] == 1.0  # 2 against 1


def test_the_soak_counts_only_the_servers_gpu_memory():
    """Other jobs on a shared GPU grow its use; the server's processes' own use is judged."""
    others = [(7, 40 << 30), (8, 1 << 30)]  # another server and an engine beside it
    mine = [(101, 3 << 30), (102, 2 << 30)]
    assert serve.gpu_mib_of({100, 101, 102}, others + mine, 90_000.0) == (
        5 * 1024, "the server's processes (NVML)")
    mib, measure = serve.gpu_mib_of({100}, others, 90_000.4)  # NVML sees none of them
    assert mib == 90_000 and "whole GPUs" in measure
    recs = [{"outcome": "done", "ttft_s": 0.5, "itl_s": [.1]}]
    ref = {"a": _answer()}
    own = "the server's processes (NVML)"
    beside_growing = [[0, 900, 5120, own], [70, 900, 5120, own], [140, 901, 5121, own]]
    soak = serve.judge_soak(recs, beside_growing, serve.judge_greedy_set(ref, ref, ref, dcp=1))
    assert soak["memory"]["gpu_measure"] == ["the server's processes (NVML)"]
    assert soak["memory"]["series"][-1] == [140, 901, 5121] and soak["goals"]["memory_flat"]


def test_vllm_gives_the_nvml_calls_the_soak_reads():
    from vllm.utils.import_utils import import_pynvml

    nvml = import_pynvml()
    for name in ("nvmlInit", "nvmlShutdown", "nvmlDeviceGetCount", "nvmlDeviceGetHandleByIndex",
                 "nvmlDeviceGetComputeRunningProcesses"):
        assert callable(getattr(nvml, name)), name


def test_vllms_completion_request_takes_the_soaks_greedy_fields():
    """The soak's greedy set asks for top-5 logprobs as token ids under a cache salt, each
    salt it uses one vLLM keys the prefix cache by."""
    from vllm.entrypoints.openai.completion.protocol import CompletionRequest
    from vllm.exceptions import VLLMClientError

    for salt in ("soak", "before-load", "after-load"):
        req = CompletionRequest(model="m", prompt="p", max_tokens=4, temperature=0.0,
                                logprobs=5, return_tokens_as_token_ids=True, cache_salt=salt)
        assert (req.logprobs, req.return_tokens_as_token_ids, req.cache_salt) == (5, True, salt)
    for bad in ("", "a/b"):  # salts vLLM refuses (a 4xx)
        with pytest.raises(VLLMClientError, match="cache_salt"):
            CompletionRequest(model="m", prompt="p", cache_salt=bad)


def test_a_gsm8k_subset_is_judged_by_its_flips_not_by_the_full_sets_tolerance():
    """128 questions: 3 lost and 5 gained move the score 1.56 points, past the 1.5 points of
    all 1,319 (one question is 0.78 points), but no sign test tells them from chance; 0 lost and 8
    gained (p 0.0078) does, and fails on a subset."""
    base = set(range(20))
    right = {"pcp1": base, "pcp2-split-all": base - {0, 1, 2} | set(range(100, 105)),
             "tp2-pcp2-split-all": base | set(range(100, 108))}
    rows = serve.gsm8k_rows([{
        "layout": n, "exact_match_strict": len(r) / 128, "exact_match_flexible": len(r) / 128,
        "correct": {"strict": sorted(r), "flexible": sorted(r)},
        "lm_eval_results": {"sample_len": 128}} for n, r in right.items()])["rows"]
    one_gpu, chance, real = rows
    assert chance["delta_strict"] > 1.5 and not chance["within_tolerance"]
    assert chance["paired"]["strict"]["p_value"] == 0.7266
    assert serve.gsm8k_goal_met(chance, subset=True)
    assert not serve.gsm8k_goal_met(chance, subset=False)
    assert real["paired"]["strict"]["p_value"] == 0.0078
    assert not serve.gsm8k_goal_met(real, subset=True)
    assert serve.gsm8k_goal_met(one_gpu, subset=True)
    unpaired = {k: v for k, v in chance.items() if k != "paired"}
    assert not serve.gsm8k_goal_met(unpaired, subset=True)  # no answers logged: no verdict
