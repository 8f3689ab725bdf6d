"""tests/engine/judge.py: the top-5 rule, feature rules, refusals, the teacher measure, memory."""
import os
import sys

import numpy as np
import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "engine"))
import judge  # noqa: E402


def _out(tokens, **extra):
    """An output whose every position has a top-5 in which 2, 6 and 99 follow."""
    return {"token_ids": tokens, **extra, "logprobs": [
        {str(t): -0.1, **{str(o): -0.2 for o in (2, 6, 99) if o != t}} for t in tokens]}


def _run(key, results, returncode=0):
    return {"returncode": returncode, key: results, "errors": ["E: x"]}


def test_the_top5_rule_and_cases_the_baseline_ran_otherwise():
    a = {"token_ids": [5, 7], "logprobs": [{"5": -0.1}, {"7": -0.6, "8": -0.7}]}
    b = {"token_ids": [5, 8], "logprobs": [{"5": -0.15}, {"8": -0.6, "7": -0.7}]}
    c = {"token_ids": [5, 3], "logprobs": [{"5": -0.1}, {"3": -0.5, "8": -0.7}]}
    assert judge.compare_outputs(a, b) == {"first_divergence": 1, "max_abs_logprob_diff": 0.05,
                                           "passed": True, "baseline_margin": 0.1}
    assert not any(judge.compare_outputs(x, y, k)["passed"]
                   for x, y, k in ((c, b, 5), (a, b, 1), ({**a, "token_ids": [5]}, a, 5)))
    res = [{"case": name, "prompt_lens": n, "outputs": [a] * len(n)}
           for name, n in (("len_7", [7]), ("mixed", [3, 8152]), ("len_4099", [4099]))]
    base = _run("results", [{**res[0], "outputs": [b]}, {**res[1], "prompt_lens": [3, 12000]}])
    cases, skipped = judge.compare_run("m", "l", _run("results", res), base)
    assert [(c["case"], c["max_baseline_margin"]) for c in cases] == [("len_7", 0.1)]
    assert [c["reason"] for c in skipped] == ["the baseline ran prompts of [3, 12000] tokens",
                                              "the baseline did not run this case"]
    failed = judge.compare_run("m", "l", _run("results", [], 1), base)[0]
    assert [(c["case"], c["passed"], c["errors"]) for c in failed] == [("engine", False, ["E: x"])]


def test_a_case_that_fails_the_top5_rule_keeps_the_evidence_of_its_divergence():
    """Which prompt of the case, where, both tokens and both top-k: what tells a near tie
    from a wrong token without the raw outputs."""
    a = {"token_ids": [5, 3], "logprobs": [{"5": -0.1}, {"3": -0.5, "8": -0.7}]}
    b = {"token_ids": [5, 8], "logprobs": [{"5": -0.1}, {"8": -0.6, "7": -0.7}]}
    out = judge.compare_outputs(a, b, 5)
    assert not out["passed"] and out["divergence"] == {
        "position": 1, "token": 3, "baseline_token": 8, "top": [(3, -0.5), (8, -0.7)],
        "baseline_top": [(8, -0.6), (7, -0.7)]}
    assert "divergence" not in judge.compare_outputs(b, b)
    res = [{"case": "burst", "prompt_lens": [7, 7], "outputs": [b, a]}]
    base = _run("results", [{**res[0], "outputs": [b, b]}])
    [case], _ = judge.compare_run("m", "l", _run("results", res), base)
    assert not case["passed"]
    assert case["failed_divergences"] == [{"prompt": 1, **out["divergence"]}]


def _feature(kind, outputs, base_outputs, **extra):
    res = {"case": kind, "kind": kind, "prompt_lens": [7], **extra}
    base = {**res, "outputs": base_outputs, **({"preemptions": 2} if extra else {})}
    return judge.compare_features("m", "l", _run("feature_results", [{**res, "outputs": outputs}]),
                                  _run("feature_results", [base]))[0][0]["passed"]


def test_each_feature_kind_has_its_own_rule_on_top_of_the_top5_rule():
    four, tie = [_out([5, 6])] * 4, [_out([5, 6])] * 2 + [_out([5, 99]), _out([5, 6])]
    assert _feature("burst", tie, four) and not _feature("sampled", tie, four, rule="exact")
    assert not _feature("burst", four[:3], four)
    base = [_out([5], prompt_logprobs=[-1.0] * 100)]
    ours = [[_out([5], prompt_logprobs=[-1.0] * 99 + p)] for p in ([-1.5], [-2.5], [])]
    assert [_feature("prompt_logprobs", x, base) for x in ours] == [True, False, False]
    assert [_feature("preemption", [_out([5])], [_out([5])], preemptions=n)
            for n in (0, 3)] == [False, True]
    good = '{"name": "x", "count": 3, "tags": ["a"]}'
    assert [_feature("json_schema", [_out([5], text=t)], [_out([5], text=good)])
            for t in (good, '{"name": "x"')] == [True, False]


MARK = judge.ENGINE_START_MARK + " 1000.0\n"
SM90_LOG = MARK + """(Worker_PCP0 pid=8) ERROR 12-01 10:00:30 [multiproc_executor.py:800] \
NotImplementedError: FlashInfer backend on SM90 currently crashes with sliding-window attention.
(EngineCore pid=7) ERROR 12-01 10:00:31 [core.py:1330] Exception: WorkerProc initialization failed
RuntimeError: Engine core initialization failed. See root cause above."""
PYDANTIC_LOG = MARK + """pydantic_core._pydantic_core.ValidationError: 1 validation error \
for VllmConfig
  Value error, vllm-pcp cannot run --prefill-context-parallel-size 2 with:
  - --kv-cache-dtype fp8: vllm-pcp's DCP runs unquantized KV caches [type=value_error]"""


def test_a_refusal_names_its_setting_in_time_and_a_hang_or_another_error_is_none():
    vllm = judge.refusal_record(SM90_LOG, 1, False, 45.0, 1031.5, judge.SLIDING_WINDOW_PATTERN)
    assert vllm["refused"] and vllm["seconds_to_failure"] == 31.5
    assert vllm["message"].startswith("NotImplementedError: FlashInfer backend on SM90")
    assert vllm["errors"][-1].startswith("RuntimeError: Engine core initialization failed")
    assert judge.refusal_record(PYDANTIC_LOG, 1, False, 9, 1008, "kv-cache-dtype fp8")["refused"]
    for log, rc, hung, pattern in ((MARK + "ok", 0, False, "sliding"),
                                   (SM90_LOG, -9, True, "sliding"), (SM90_LOG, 1, False, "cap")):
        assert not judge.refusal_record(log, rc, hung, 1, 1001, pattern)["refused"]
    assert [judge.refusal_case("m", "c", vllm, s)["passed"] for s in (120, 30)] == [True, False]


def _stats(max_diff, p99, over=0, positions=256):
    return dict(positions=positions, max_abs_logprob_diff=max_diff, p99_abs_logprob_diff=p99,
                positions_over_1=over)


def test_teacher_rows_pool_the_same_prompts_and_continuations_against_the_larger_floor():
    assert judge.diff_stats(np.arange(101) / 100) == _stats(1.0, 0.99, positions=101)

    def scores(*cases):
        keys = ("case", "prompt_lens", "scores", "continuation_digests")
        return _run("scores", [dict(zip(keys, c)) for c in cases])

    run = scores(("len_7", [7], [[-1, -2.5], [-3.25]], ["a"]), ("mix", [8], [[-9]], ["a"]),
                 ("burst", [5], [[-5.0]], ["b"]))
    base = scores(("len_7", [7], [[-1, -2], [-3]], ["a"]), ("mix", [12], [[-1]], ["a"]),
                  ("burst", [5], [[-1.0]], ["a"]))
    rows, pooled = judge.teacher_cases("m", "l", run, base)
    assert [r.get("not_compared", "")[:30] for r in rows] == [
        "", "the baseline ran prompts of [1", "the baseline scored other cont"]
    assert (pooled["cases"], pooled["positions"], pooled["max_abs_logprob_diff"]) == (1, 3, 0.5)
    floors = {"pcp1-graphs": _stats(0.2, 0.05), "pcp1-flash-attn": _stats(0.1, 0.08)}
    factors = {"pcp2": 1.0, "pcp2-dcp2-i1": 1.5, "pcp2-dcp2-i16": 1.5, "pcp4": 1.0, "pcp8": 1}
    goal = judge.teacher_goal(floors, {"pcp2": _stats(0.2, 0.08), "pcp4": None,
                                       "pcp2-dcp2-i1": _stats(0.3, 0.12, over=1),
                                       "pcp2-dcp2-i16": _stats(0.3, 0.121)}, factors)
    assert goal["larger_floor"] == {"max_abs_logprob_diff": 0.2, "p99_abs_logprob_diff": 0.08}
    assert [goal[c] for c in factors] == [True, True, False, False, None]  # failed; not run
    assert goal["no_position_over_1"] is False and goal["met"] is False
    moe = judge.teacher_goal({"tp2": _stats(0.4, 0.2)}, {"pcp2": _stats(0.4, 0.2)}, {"pcp2": 1.0})
    assert moe["larger_floor"]["max_abs_logprob_diff"] == 0.4 and moe["met"]  # -tp 2 alone


def test_memory_judges_the_split_steps_and_keeps_prompt_logprob_phases_apart():
    def rank(allocated, peak, profile=None):
        return {"allocated_bytes": allocated * judge.GIB, "peak_allocated_bytes": peak * judge.GIB,
                "profile_peak_bytes": profile and profile * judge.GIB,
                "split_step_reserve_bytes": judge.GIB // 4}

    phases = {"standard": [rank(10, 11)], "features": [rank(10, 13)], "scoring": [rank(10, 14)]}
    run = {"feature_results": [{"case": "prompt_logprobs"}],
           "memory": {"at_start": [rank(10, 10, 2)], "phases": phases}}
    assert judge.rank_rows(run) == [{"step_peak_gib": 1.0, "profile_peak_gib": 2.0,
                                     "split_step_reserve_gib": 0.25, "fits": True,
                                     "prompt_logprobs_peak_gib": 4.0}]
    run["feature_results"] = [{"case": "burst"}]  # then the feature cases are judged: over
    assert judge.rank_rows(run)[0]["fits"] is False


def _counts(steps=40, split=6, fresh=2, gathered=None, idle=(0, 0)):
    """Each rank's pcp_step_counts (vllm_pcp.pcp.counts.PCPStepCounts)."""
    return {"step_counts": [{"steps": steps, "split_steps": split, "fresh_split_steps": fresh,
                             "gathered_steps": split if gathered is None else gathered,
                             "steps_without_local_tokens": i} for i in idle]}


def test_each_ranks_steps_follow_the_decode_policy():
    """replicate: only split steps gather and every rank has tokens in every step; shard:
    every step gathers and a lone decode leaves a rank idle; both: the ranks agree and some
    step split. No counts (one GPU, a failed run, other fields): nothing to judge."""
    check = judge.step_counts_as_expected
    assert check(_counts(), "replicate")
    assert check(_counts(gathered=40, idle=(0, 12)), "shard")
    for run, policy in ((_counts(gathered=40), "replicate"),  # a decode-only step gathered
                        (_counts(idle=(0, 3)), "replicate"),  # a rank left without tokens
                        (_counts(gathered=40), "shard"),  # no decode was sharded
                        (_counts(idle=(0, 12)), "shard"),  # decode-only steps ran locally
                        (_counts(split=0, fresh=0), "replicate"),  # nothing split
                        (_counts(fresh=7), "replicate")):
        assert check(run, policy) is False, (run, policy)
    apart = _counts()
    apart["step_counts"][1]["split_steps"] = 5
    assert check(apart, "replicate") is False  # the ranks saw other splits
    assert check({"step_counts": None}, "replicate") is None
    assert check({"step_counts": [{"split_steps": 3, "ragged_steps": 1}]}, "replicate") is None


def test_agreement_needs_both_requests_decoded_and_every_rank_checking_each_step():
    outputs = [_out([5] * 256), _out([6] * 256)]
    run = {"returncode": 0, "sampled_token_checks": [300, 300],
           "feature_results": [{"case": "agreement", "outputs": outputs}]}
    assert judge.agreement_row(run)["passed"]
    stopped = {**run, "returncode": 1, "errors": ["RuntimeError: sampled tokens differ"]}
    short = {**run, "feature_results": [{"case": "agreement", "outputs": [
        outputs[0], _out([6] * 40)]}]}
    few_checks = {**run, "sampled_token_checks": [300, 100]}
    one_rank = {**run, "sampled_token_checks": [300]}
    assert not any(judge.agreement_row(r)["passed"] for r in (
        stopped, short, few_checks, one_rank, {"returncode": 0}))
    assert judge.agreement_row(stopped)["errors"] == ["RuntimeError: sampled tokens differ"]


def test_a_budget_engine_passes_only_with_every_case_run_and_every_rank_within_its_profile():
    def rank(allocated, peak, profile=None):
        return {"allocated_bytes": allocated * judge.GIB, "peak_allocated_bytes": peak * judge.GIB,
                "profile_peak_bytes": profile and profile * judge.GIB,
                "split_step_reserve_bytes": judge.GIB // 4}

    ran = [{"case": "budget_longest", "outputs": [{}]},
           {"case": "budget_full_step", "outputs": [{}] * 4}]
    run = {"returncode": 0, "feature_results": ran, "memory": {
        "at_start": [rank(10, 10, 2)] * 2, "phases": {"features": [rank(10, 11.5)] * 2}}}
    assert judge.budget_row(run)["passed"]
    over = {**run, "memory": {"at_start": run["memory"]["at_start"],
                              "phases": {"features": [rank(10, 11.5), rank(10, 12.5)]}}}
    oom = {"returncode": 1, "errors": ["torch.OutOfMemoryError: CUDA out of memory"],
           "feature_results": ran[:1], "memory": run["memory"]}
    assert [judge.budget_row(r)["passed"] for r in (over, oom, {"returncode": 0})] == [
        False, False, False]
    assert judge.budget_row(oom)["cases_run"] == {"budget_longest": 1}


def test_a_feature_floor_excuses_as_many_misses_as_it_has_but_never_exact_seeded_sampling():
    """test_features' tolerance: as many misses as the floor has, whichever cases they are;
    seeded sampling never missed where the layout is held to one GPU's samples (the paged
    kernel at DCP = 1), and no engine that failed is excused."""
    import test_exactness as t

    allowed = t.feature_misses_allowed
    assert t.EXACT_RULE_CASES == {"sampled_n4"}
    assert allowed("pcp2", {"sampled_n4"}, {"burst"})
    assert not allowed("pcp2", {"sampled_n4"}, set())
    assert allowed("pcp2", {"burst"}, {"prompt_logprobs"})  # another case than the floor's
    assert not allowed("pcp2", {"burst", "json_schema"}, {"prompt_logprobs"})
    assert not allowed("pcp2-paged", {"sampled_n4"}, {"sampled_n4", "prompt_logprobs"})
    assert allowed("pcp2-paged", {"prompt_logprobs"}, {"json_schema"})
    assert not allowed("pcp2", {"engine"}, {"engine", "json_schema"})
    assert not allowed("pcp2", {"json_schema"}, {"engine"})
    assert ("smollm2", "chunked", t.FEATURE_FLOOR) in t.JOBS
    assert "features" in t.JOBS[("smollm2", "chunked", t.FLOORS[t.FEATURE_FLOOR])]


def _sample(token, top):
    """A seeded output of two tokens whose second is ``token``, drawn where the logprobs
    are ``top`` (the drawn token listed beside the top 5, as vLLM returns them)."""
    return {"token_ids": [5, token], "logprobs": [{"5": -0.1}, {str(token): -6.0, **top}]}


FLAT = {"1": -3.0, "2": -3.1, "3": -3.2, "4": -3.3, "6": -3.4}  # a random model's top 5


def test_seeded_samples_are_exact_at_the_paged_kernel_and_else_drawn_from_alike_logits():
    """Four seeded choices, one parting from one GPU's at token 1. Where the layout is held
    to one GPU's samples any parting misses. Elsewhere a parting misses only where the two
    drew from unlike distributions: a draw that moves to a token outside both top 5s over
    alike logits (at temperature 0.8 on random weights the top 5 hold a few percent of the
    mass) is the layout's rounding, as a near tie is for greedy."""
    import test_exactness as t

    four = [_out([5, 6])] * 4
    near = [_out([5, 6])] * 3 + [_out([5, 99])]
    far = [_out([5, 6])] * 3 + [{"token_ids": [5, 7], "logprobs": [{"5": -0.1}, {"7": -0.1}]}]

    def misses(outputs, exact, base=four):
        res = {"case": "sampled_n4", "kind": "sampled", "rule": "exact", "prompt_lens": [7]}
        ours, theirs = ({**res, "outputs": x} for x in (outputs, base))
        cases = judge.compare_features("m", "l", _run("feature_results", [ours]),
                                       _run("feature_results", [theirs]))[0]
        return t.feature_misses(cases, exact)

    assert misses(near, exact=True) == {"sampled_n4"} and misses(near, exact=False) == set()
    assert misses(far, exact=False) == {"sampled_n4"} and misses(four, exact=True) == set()
    base = [_sample(60, {**FLAT, "1": -3.05})] * 4
    moved = [_sample(60, FLAT)] * 3 + [_sample(50, FLAT)]  # outside both top 5s
    assert misses(moved, False, base) == set() and misses(moved, True, base) == {"sampled_n4"}
    other_mode = [_sample(60, FLAT)] * 3 + [_sample(50, {**FLAT, "7": -1.0})]
    drifted = [_sample(60, FLAT)] * 3 + [_sample(50, {**FLAT, "2": -4.5})]
    assert misses(other_mode, False, base) == misses(drifted, False, base) == {"sampled_n4"}
    assert misses(moved[:3], exact=False, base=base) == {"sampled_n4"}  # one choice short


def test_alike_draws_read_the_top_5_of_both_runs_at_the_parting():
    div = {"top": [[1, -3.0], [2, -3.1]], "baseline_top": [[2, -3.0], [1, -3.05], [9, -9.0]]}
    assert judge.alike_draws(div)
    assert not judge.alike_draws({**div, "baseline_top": [[9, -3.0], [2, -3.1]]})
    assert not judge.alike_draws(div, limit=0.01) and not judge.alike_draws({**div, "top": []})


def test_every_teacher_judged_model_has_its_one_gpu_floors_as_jobs():
    """test_teacher holds a layout to its model's larger one-GPU floor: each model it judges
    has both floor jobs, so no teacher-forced verdict rests on a missing floor."""
    import test_exactness as t

    assert t.TEACHER_KEYS
    for key in t.TEACHER_KEYS:
        assert set(judge.GOAL_FLOORS) <= set(t.floor_keys(key)), key


def _greedy(misses=(), returncode=0):
    """A raw entry of three cases, ``misses`` off the baseline's top-5 at token 1."""
    return _run("results", [{"case": c, "prompt_lens": [7],
                             "outputs": [_out([5, 3] if c in misses else [5, 7])]}
                            for c in ("len_7", "len_4097", "prefix_hit")], returncode)


def _judge_greedy(key, layout_run, floors):
    """test_greedy on ``layout_run`` against a clean baseline, ``floors`` the floors' raw
    entries by layout; the jobs it ran."""
    import test_exactness as t

    ran = []

    def engine(k, repeat=0):
        ran.append(k[2])
        return layout_run if k == key else floors.get(k[2], _greedy())
    t.test_greedy(key, engine, lambda *a, **k: None)
    return ran


def test_greedy_misses_are_held_to_the_floor_that_misses_the_most_and_an_engine_to_none():
    """A random 36-layer model misses the top-5 rule against itself (eager against CUDA
    graphs): a layout may miss as many cases as its model's worst one-GPU floor, never
    more, never with an engine that failed, and a floor whose engine failed excuses none."""
    key = ("qwen2.5-3b-shape-full", "chunked", "tp4-pcp2-dcp2-i8")
    one = _greedy(["prefix_hit"])
    assert _judge_greedy(key, _greedy(), {}) == ["tp4-pcp2-dcp2-i8", "pcp1"]
    assert _judge_greedy(key, {**_greedy(), **_counts()}, {})  # steps as -dcp's policy says
    ran = _judge_greedy(key, one, {"pcp1-graphs": _greedy(["len_4097"])})
    assert set(ran) == {"tp4-pcp2-dcp2-i8", "pcp1", "pcp1-graphs", "pcp1-flash-attn"}
    moe = ("qwen3-moe-8e", "chunked", "pcp2")  # held to vLLM's own expert sharding
    assert "tp2" in _judge_greedy(moe, one, {"tp2": _greedy(["len_4097"])})
    for layout_run, floors in (
            (_greedy(["prefix_hit", "len_7"]), {"pcp1-graphs": _greedy(["len_4097"])}),
            (one, {}),
            (_greedy(returncode=1), {"pcp1-graphs": _greedy(["len_4097"])}),
            (one, {"pcp1-graphs": _greedy(returncode=1)}),
            ({**_greedy(), **_counts(gathered=40)}, {}),  # decode-only steps gathered
            ({**_greedy(), "model_runner_v2": False}, {})):
        with pytest.raises(AssertionError):
            _judge_greedy(key, layout_run, floors)


def _features(misses=(), returncode=0):
    """A raw entry of two feature cases, ``misses`` off the baseline's top-5 at token 1."""
    return _run("feature_results", [{"case": c, "kind": c, "prompt_lens": [7],
                                     "outputs": [_out([5, 3] if c in misses else [5, 7])]}
                                    for c in ("burst", "repetition_penalty")], returncode)


def _judge_features(key, layout_run, floors):
    """test_features on ``layout_run`` against a clean baseline, ``floors`` the floors' raw
    entries by layout."""
    import test_exactness as t

    def engine(k, repeat=0):
        return layout_run if k == key else floors.get(k[2], _features())
    t.test_features(key, engine, lambda *a, **k: None)


def test_moe_feature_cases_are_held_to_vllms_own_expert_sharding():
    """A MoE layout may miss as many feature cases as vLLM's -tp 2 misses against one GPU,
    whichever they are, no more, never with an engine that failed; the -tp 2 job itself is
    the expected failure."""
    import test_exactness as t

    moe = ("qwen3-moe-8e", "chunked", "pcp2")
    burst = _features(["burst"])
    _judge_features(moe, burst, {"tp2": _features(["burst"])})
    _judge_features(moe, burst, {"tp2": _features(["repetition_penalty"])})
    _judge_features(moe, _features(), {})
    both = _features(["burst", "repetition_penalty"])
    for layout_run, floors in ((burst, {}), (both, {"tp2": _features(["repetition_penalty"])}),
                               (_features(returncode=1), {"tp2": _features(returncode=1)})):
        with pytest.raises(AssertionError):
            _judge_features(moe, layout_run, floors)
    marks = {p.values[0]: [m.name for m in p.marks]
             for p in t._params(t.FEATURE_KEYS, xfail=t.EXPERT_SHARDING_KEYS)}
    assert "xfail" in marks[moe[:2] + ("tp2",)] and "xfail" not in marks[moe]
