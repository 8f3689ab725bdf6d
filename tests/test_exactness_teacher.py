"""The teacher-forced exactness measure without a GPU: the statistics, the goal check,
exactness-teacher.json, the worker's scoring prompts and its reading of vLLM's
prompt_logprobs (run_gpu_checks.sh engine-proof: tests/test_run_gpu_checks.py)."""
import json
import os
import sys
from types import SimpleNamespace

import numpy as np
import pytest

SCRIPTS = os.path.join(os.path.dirname(__file__), "..", "scripts")
sys.path.insert(0, SCRIPTS)
from exactness_lib import (abs_logprob_diffs, continuation_digest, diff_stats,  # noqa: E402
                           larger_floor, teacher_continuations, teacher_goal,
                           teacher_prompts)


def _stats(max_diff, p99, over=0, positions=256):
    return {"positions": positions, "max_abs_logprob_diff": max_diff,
            "p99_abs_logprob_diff": p99, "positions_over_1": over}


def test_stats_give_max_p99_and_positions_over_1():
    base = [[-1.0] * 60, [-2.0] * 41]
    steps = np.arange(101) / 100  # |differences| 0.00, 0.01, ..., 1.00 over both prompts
    scores = [list(-1.0 + steps[:60]), list(-2.0 - steps[60:])]
    diffs = abs_logprob_diffs(scores, base)
    assert diffs == pytest.approx(steps)
    assert diff_stats(diffs) == {"positions": 101, "max_abs_logprob_diff": 1.0,
                                 "p99_abs_logprob_diff": 0.99, "positions_over_1": 0}
    scores[1][-1] = -3.5  # one position 1.5 away
    got = diff_stats(abs_logprob_diffs(scores, base))
    assert (got["max_abs_logprob_diff"], got["positions_over_1"]) == (1.5, 1)


def test_a_configuration_scoring_like_the_baseline_measures_zero():
    base = [[-0.5, -3.25, -0.125], [-7.0]]
    assert diff_stats(abs_logprob_diffs(base, [list(s) for s in base])) == {
        "positions": 4, "max_abs_logprob_diff": 0.0, "p99_abs_logprob_diff": 0.0,
        "positions_over_1": 0}
    assert diff_stats(np.zeros(0))["max_abs_logprob_diff"] is None


def test_scores_of_other_lengths_are_refused():
    with pytest.raises(ValueError, match="scored positions differ"):
        abs_logprob_diffs([[-1.0, -2.0]], [[-1.0]])


def test_goal_holds_pcp_to_the_larger_floor_and_dcp_to_one_and_a_half_times_it():
    floors = {"pcp1-graphs": _stats(0.2, 0.05), "pcp1-flash-attn": _stats(0.1, 0.08)}
    assert larger_floor(floors) == {"max_abs_logprob_diff": 0.2, "p99_abs_logprob_diff": 0.08}
    factors = {"pcp2": 1.0, "pcp2-dcp2-i1": 1.5, "pcp2-dcp2-i16": 1.5}
    measured = {"pcp2": _stats(0.2, 0.08), "pcp2-dcp2-i1": _stats(0.3, 0.12),
                "pcp2-dcp2-i16": _stats(0.3, 0.121)}
    goal = teacher_goal(floors, measured, factors)
    assert (goal["pcp2"], goal["pcp2-dcp2-i1"], goal["pcp2-dcp2-i16"]) == (True, True, False)
    assert goal["no_position_over_1"] is True and goal["met"] is False
    assert goal["larger_floor"] == larger_floor(floors) and goal["factors"] == factors
    measured["pcp2-dcp2-i16"] = _stats(0.29, 0.1)
    assert teacher_goal(floors, measured, factors)["met"] is True
    measured["pcp2"] = _stats(0.21, 0.01)  # over the floor at max only
    assert teacher_goal(floors, measured, factors)["pcp2"] is False


def test_goal_counts_positions_over_1_failures_and_absent_runs():
    floors = {"pcp1-graphs": _stats(2.0, 0.5), "pcp1-flash-attn": _stats(0.1, 0.08)}
    factors = {"pcp2": 1.0, "pcp2-dcp2-i1": 1.5}
    goal = teacher_goal(floors, {"pcp2": _stats(1.2, 0.1, over=1)}, factors)
    assert goal["pcp2"] is True and goal["no_position_over_1"] is False
    assert goal["pcp2-dcp2-i1"] is None and goal["met"] is False
    goal = teacher_goal(floors, {"pcp2": _stats(0.5, 0.1)}, factors)
    assert goal["met"] is None  # pcp2-dcp2-i1 not run: nothing failed, not all checked
    assert teacher_goal(floors, {"pcp2": None}, factors)["pcp2"] is False  # its run failed
    one_gpu = teacher_goal(floors, {}, factors)  # the floors alone
    assert (one_gpu["pcp2"], one_gpu["no_position_over_1"], one_gpu["met"]) == (None, None, None)
    no_floor = teacher_goal({**floors, "pcp1-flash-attn": None}, {"pcp2": _stats(0, 0)}, factors)
    assert no_floor["larger_floor"] is None and no_floor["pcp2"] is None


def _generation_raw():
    def run(model, variant, config, returncode=0, first=7):
        outs = [{"token_ids": [first, first + 1], "logprobs": [{}, {}]}]
        return {"model": model, "variant": variant, "config": config,
                "returncode": returncode,
                "results": [{"case": "len_3", "prompt_lens": [3], "outputs": outs}]}
    return {"versions": {}, "runs": [run("m", "unchunked", "pcp1-v1", first=1),
                                     run("m", "chunked", "pcp2", first=2),
                                     run("m", "chunked", "pcp1-v1", returncode=1, first=3),
                                     run("m", "chunked", "pcp1", first=5),  # V2: not the source
                                     run("m", "chunked", "pcp1-v1", first=7),
                                     run("other", "chunked", "pcp1-v1", first=4)]}


def test_continuations_come_from_the_successful_one_gpu_chunked_run():
    raw = _generation_raw()
    assert teacher_continuations(raw, "m") == {
        "len_3": {"prompt_lens": [3], "token_ids": [[7, 8]]}}
    with pytest.raises(ValueError, match="no successful"):
        teacher_continuations(raw, "absent")
    assert teacher_prompts([[1, 2, 3], [4]], [[7, 8], [9]]) == [[1, 2, 3, 7, 8], [4, 9]]
    with pytest.raises(ValueError):
        teacher_prompts([[1]], [])


def _prompt_logprobs(token_ids, score, flat, top_token=None):
    """prompt_logprobs as vLLM 0.26.0's output processor builds them: position 0 empty,
    then per position the given token (and, with ``top_token``, a top-1 entry as
    prompt_logprobs=1 adds)."""
    from vllm.logprobs import append_logprobs_for_next_position, create_prompt_logprobs

    logprobs = create_prompt_logprobs(flat)
    for pos in range(1, len(token_ids)):
        row = [token_ids[pos]] + ([top_token] if top_token is not None else [])
        values = [score(pos, token_ids[pos])] + ([-0.01] if top_token is not None else [])
        append_logprobs_for_next_position(logprobs, row, values, [None] * len(row), rank=2,
                                          num_logprobs=len(row) - 1)
    return logprobs


def _score(pos, token):
    return -0.001 * pos - 0.1 * (token % 7)


@pytest.mark.parametrize("flat", [False, True])
def test_given_token_logprobs_read_vllms_prompt_logprobs(flat):
    from exactness_worker import given_token_logprobs

    tokens = [5, 9, 11, 12, 3]
    lps = _prompt_logprobs(tokens, _score, flat)
    assert not lps[0] and len(lps) == len(tokens)  # None, or {} in a FlatLogprobs
    assert given_token_logprobs(lps, tokens, 2) == pytest.approx(
        [_score(p, tokens[p]) for p in (2, 3, 4)])
    top = _prompt_logprobs(tokens, _score, flat, top_token=99)  # prompt_logprobs=1
    assert given_token_logprobs(top, tokens, 1) == pytest.approx(
        [_score(p, tokens[p]) for p in (1, 2, 3, 4)])
    with pytest.raises(ValueError):
        given_token_logprobs(lps, tokens + [1], 2)


@pytest.mark.parametrize("flat", [False, True])
def test_given_token_logprobs_of_model_runner_v2_after_a_prefix_hit(flat):
    """Model Runner V2 (one GPU in vLLM 0.26.0) gives no entries for the cached tokens of a
    prefix-cache hit (seen on an H200: 1540 entries for a 6532-token prompt, 4992 cached):
    entry 0 stands for token ``cached``, and the scored positions keep their tokens."""
    from exactness_worker import given_token_logprobs

    tokens = [5, 9, 11, 12, 3, 7]
    full = _prompt_logprobs(tokens, _score, flat)
    v2 = _prompt_logprobs(tokens[3:], lambda p, t: _score(p + 3, t), flat)  # 3 cached
    expected = [_score(p, tokens[p]) for p in (4, 5)]
    assert given_token_logprobs(full, tokens, 4) == pytest.approx(expected)
    assert given_token_logprobs(v2, tokens, 4, cached=3) == pytest.approx(expected)
    for bad in ({"cached": 2}, {"cached": 0}):  # entries that match no cache hit
        with pytest.raises(ValueError):
            given_token_logprobs(v2, tokens, 4, **bad)
    with pytest.raises(ValueError):  # a scored position inside the cached prefix
        given_token_logprobs(v2, tokens, 3, cached=3)


class _FakeLLM:
    """generate() and llm_engine's add_request / step as the worker drives them; each
    request's output carries prompt_logprobs of :func:`_score`."""

    def __init__(self):
        self.requests = []
        self.llm_engine = self
        self._pending = []

    def _output(self, request_id, prompt, params):
        self.requests.append((request_id, prompt["prompt_token_ids"], params))
        ids = prompt["prompt_token_ids"]
        return SimpleNamespace(request_id=request_id, finished=True, num_cached_tokens=0,
                               prompt_logprobs=_prompt_logprobs(ids, _score, flat=False))

    def generate(self, prompts, params, use_tqdm):
        assert len(prompts) == len(params)
        return [self._output(f"g{i}", p, sp) for i, (p, sp) in enumerate(zip(prompts, params))]

    def add_request(self, request_id, prompt, params):
        self._pending.append(self._output(request_id, prompt, params))

    def step(self):
        done, self._pending = self._pending, []
        return done

    def has_unfinished_requests(self):
        return bool(self._pending)


def test_worker_scores_each_prompt_followed_by_its_continuation():
    from exactness_lib import build_cases
    from exactness_worker import ARRIVAL_DECODE_TOKENS, score_cases

    cases = [c for c in build_cases(64, 1000) if c["case"] in
             ("len_7", "mixed_batch", "prefix_hit", "decode_during_prefill")]
    cases.append({"case": "new_kind", "kind": "burst", "prompts": [[1, 2]]})
    continuations = {c["case"]: {"prompt_lens": [len(p) for p in c["prompts"]],
                                 "token_ids": [[100 + i, 200 + i, 300] for i in
                                               range(len(c["prompts"]))]}
                     for c in cases}
    llm = _FakeLLM()
    results = score_cases(llm, cases, continuations)
    assert [r["case"] for r in results] == [c["case"] for c in cases[:-1]]  # burst: not scored
    for res, case in zip(results, cases):
        assert res["prompt_lens"] == [len(p) for p in case["prompts"]]
        given = continuations[case["case"]]["token_ids"]
        assert res["continuation_digests"] == [continuation_digest(c) for c in given]
        assert len(set(res["continuation_digests"])) == len(set(map(tuple, given)))
        full = teacher_prompts(case["prompts"], given)
        assert res["scores"] == [pytest.approx([_score(len(p) + j, f[len(p) + j])
                                                for j in range(3)])
                                 for p, f in zip(case["prompts"], full)]
    sent = [(prompt, params) for _, prompt, params in llm.requests]
    assert sent[0][0] == cases[0]["prompts"][0] + [100, 200, 300]
    assert all(p.prompt_logprobs == 0 for _, p in sent)
    prefix = sent[1 + len(cases[1]["prompts"]):][:2]
    assert [p.skip_reading_prefix_cache for _, p in prefix] == [True, False]
    short, long = sent[-2:]
    assert short[1].max_tokens == ARRIVAL_DECODE_TOKENS and long[1].max_tokens == 1


def test_worker_refuses_continuations_of_other_prompts():
    from exactness_worker import score_cases

    case = {"case": "len_3", "kind": "batch", "prompts": [[1, 2, 3]]}
    with pytest.raises(ValueError, match="same --max-tokens"):
        score_cases(_FakeLLM(), [case], {"len_3": {"prompt_lens": [4], "token_ids": [[5]]}})


def test_run_passes_the_continuations_to_each_scoring_worker(tmp_path, monkeypatch):
    import check_exactness as ce

    seen = []
    monkeypatch.setattr(ce, "run_worker", lambda cmd, *a, **k: seen.append(cmd))
    args = SimpleNamespace(models_dir="/m", gpu_memory_utilization=0.1, max_tokens=256,
                           kv_cache_gib=0, teacher="gen.json", cases="none")
    ce._run_one(args, str(tmp_path), "smollm2", "chunked", "pcp2", {})
    cmd = seen[-1]
    assert cmd[cmd.index("--teacher") + 1] == os.path.abspath("gen.json")
    assert cmd[cmd.index("--teacher-model") + 1] == "smollm2"
    assert cmd[cmd.index("--cases") + 1] == "none"  # score only
    ce._run_one(args, str(tmp_path), "smollm2", "unchunked", "pcp2", {})
    assert "--teacher" not in seen[-1]  # the teacher source's variant (chunked) only
    ce._run_one(SimpleNamespace(**{**vars(args), "teacher": ""}), str(tmp_path), "m",
                "chunked", "pcp2", {})
    assert "--teacher" not in seen[-1]


def _scoring_run(config, scores, model="m", returncode=0, **extra):
    return {"model": model, "variant": "chunked", "config": config, "returncode": returncode,
            "scores": [{"case": "len_7", "prompt_lens": [7], "scores": [scores]}], **extra}


def test_teacher_writes_cases_floors_and_the_goal(tmp_path):
    import check_exactness as ce

    base = [-1.0, -2.0, -0.5, -0.25]
    runs = [_scoring_run("pcp1", base), _scoring_run("pcp1-v1", base),
            _scoring_run("pcp2", base, shared_gpus="1"),
            _scoring_run("pcp1-graphs", [-1.0, -2.0, -0.5, -0.5]),
            _scoring_run("pcp1-flash-attn", [-1.125, -2.0, -0.5, -0.25]),
            _scoring_run("pcp2-dcp2-i1", [-1.0, -2.3, -0.5, -0.25]),
            _scoring_run("pcp2-dcp2-i16", [], returncode=1),
            {"model": "m", "variant": "chunked", "config": "tp2", "returncode": 0,
             "results": []}]  # generated, never scored: no row
    raw = tmp_path / "raw.json"
    raw.write_text(json.dumps({"versions": {"gpu": "2 x G", "vllm": "0.26.0", "torch": "t",
                                            "flashinfer": "f"}, "runs": runs}))
    out = tmp_path / "teacher.json"
    ce.teacher(SimpleNamespace(raw=[str(raw)], git_rev="rev", command="cmd", out=str(out),
                               note="", date="2026-12-01"))
    result = json.loads(out.read_text())
    assert set(result) == {"meta", "summary", "cases", "noise_floor_cases"}
    assert result["meta"]["git_rev"] == "rev" and result["meta"]["gpu"] == "2 x G"
    assert result["meta"]["date"] == "2026-12-01" and "measure" in result["meta"]
    shared = result["meta"]["ranks_shared_gpus"]
    assert (shared["gpus"], shared["configs"]) == (1, ["pcp2"])
    cases = {c["config"]: c for c in result["cases"]}
    assert cases["pcp2 vs pcp1-v1, chunked"] == {
        "model": "m", "config": "pcp2 vs pcp1-v1, chunked", "case": "len_7",
        "prompt_lens": [7], "positions": 4, "max_abs_logprob_diff": 0.0,
        "p99_abs_logprob_diff": 0.0, "positions_over_1": 0}
    assert cases["pcp2-dcp2-i16 vs pcp1-v1, chunked"]["case"] == "engine"
    assert set(cases) == {"pcp2 vs pcp1-v1, chunked", "pcp2-dcp2-i1 vs pcp1-v1, chunked",
                          "pcp2-dcp2-i16 vs pcp1-v1, chunked"}
    assert [c["config"] for c in result["noise_floor_cases"]] == [
        "pcp1-flash-attn vs pcp1, chunked", "pcp1-graphs vs pcp1, chunked"]
    summary = result["summary"]["models"]["m"]
    assert summary["noise_floor"]["pcp1-graphs vs pcp1"]["max_abs_logprob_diff"] == 0.25
    assert summary["configs"]["pcp2-dcp2-i16 vs pcp1-v1"] is None
    assert summary["configs"]["pcp2-dcp2-i1 vs pcp1-v1"]["cases"] == 1
    goal = summary["goal"]
    assert goal["larger_floor"]["max_abs_logprob_diff"] == 0.25
    assert (goal["pcp2"], goal["pcp2-dcp2-i1"], goal["pcp2-dcp2-i16"]) == (True, True, False)
    assert "pcp4" not in goal  # the goal is over the layouts the model ran
    assert goal["no_position_over_1"] is True and goal["met"] is False
    assert result["summary"]["goal_met"] is False
    assert "pcp4" in result["summary"]["not_measured"]


def _run_teacher(tmp_path, runs: list[dict]) -> dict:
    """exactness-teacher.json of a raw file holding ``runs``."""
    import check_exactness as ce

    raw = tmp_path / "raw.json"
    raw.write_text(json.dumps({"versions": {}, "runs": runs}))
    out = tmp_path / "teacher.json"
    ce.teacher(SimpleNamespace(raw=[str(raw)], git_rev="r", command="c", out=str(out),
                               note="", date=""))
    return json.loads(out.read_text())


def test_teacher_marks_cases_that_cannot_be_compared(tmp_path):
    result = _run_teacher(tmp_path, [_scoring_run("pcp1-v1", [-1.0, -2.0]),
                                     _scoring_run("pcp2", [-1.0])])
    assert "scored positions differ" in result["cases"][0]["error"]
    model = result["summary"]["models"]["m"]
    assert model["configs"]["pcp2 vs pcp1-v1"] is None
    assert model["goal"]["pcp2"] is None  # no floors were run
    assert result["summary"]["goal_met"] is None


def test_cases_the_baseline_scored_on_other_prompts_are_left_out_of_the_pool(tmp_path):
    other = {**_scoring_run("pcp1-v1", [-1.0, -2.0])}
    other["scores"] = [*other["scores"], {**other["scores"][0], "case": "mixed",
                                          "prompt_lens": [12000]}]
    run = _scoring_run("pcp2", [-1.0, -2.5])
    run["scores"] = [*run["scores"], {**run["scores"][0], "case": "mixed",
                                      "prompt_lens": [8152], "scores": [[-9.0]]},
                     {**run["scores"][0], "case": "len_4099", "prompt_lens": [4099]}]
    result = _run_teacher(tmp_path, [other, run])
    reasons = {c["case"]: c.get("not_compared") for c in result["cases"]}
    assert reasons == {"len_7": None, "mixed": "the baseline ran prompts of [12000] tokens",
                       "len_4099": "the baseline did not run this case"}
    pooled = result["summary"]["models"]["m"]["configs"]["pcp2 vs pcp1-v1"]
    assert (pooled["cases"], pooled["max_abs_logprob_diff"]) == (1, 0.5)


def test_scorings_of_other_continuations_are_never_compared(tmp_path):
    """A baseline's scores are of the outputs it scored; a run that scored outputs that
    changed since (a batched case rescheduled) is left out, whatever its numbers."""
    base = _scoring_run("pcp1-v1", [-1.0, -2.0])
    base["scores"] = [{**base["scores"][0], "continuation_digests": [continuation_digest([5, 6])]},
                      {**base["scores"][0], "case": "mixed",
                       "continuation_digests": [continuation_digest([5, 6])]}]
    run = _scoring_run("pcp2", [-1.0, -2.5])
    run["scores"] = [{**run["scores"][0], "continuation_digests": [continuation_digest([5, 6])]},
                     {**run["scores"][0], "case": "mixed", "scores": [[-9.0, -9.0]],
                      "continuation_digests": [continuation_digest([5, 7])]}]
    result = _run_teacher(tmp_path, [base, run])
    reasons = {c["case"]: c.get("not_compared") for c in result["cases"]}
    assert reasons["len_7"] is None and "other continuations" in reasons["mixed"]
    pooled = result["summary"]["models"]["m"]["configs"]["pcp2 vs pcp1-v1"]
    assert (pooled["cases"], pooled["max_abs_logprob_diff"]) == (1, 0.5)


def test_each_model_is_held_to_its_own_floors(tmp_path):
    """Rounding depends on a model's shape: a model whose floors are wide does not widen
    another's goal, and a model without floors has no verdict."""
    runs = [_scoring_run("pcp1", [-1.0, -2.0]), _scoring_run("pcp1-v1", [-1.0, -2.0]),
            _scoring_run("pcp1-graphs", [-1.0, -2.125]),
            _scoring_run("pcp1-flash-attn", [-1.0, -2.0]),
            _scoring_run("pcp2", [-1.0, -2.25]),  # over m's floor of 0.125
            _scoring_run("pcp1", [-1.0, -2.0], model="wide"),
            _scoring_run("pcp1-v1", [-1.0, -2.0], model="wide"),
            _scoring_run("pcp1-graphs", [-1.0, -2.5], model="wide"),
            _scoring_run("pcp1-flash-attn", [-1.0, -2.0], model="wide"),
            _scoring_run("pcp2", [-1.0, -2.25], model="wide"),  # under wide's 0.5
            _scoring_run("pcp1-v1", [-1.0, -2.0], model="moe"),
            _scoring_run("pcp2", [-1.0, -2.25], model="moe"),
            # vLLM's own expert sharding, the floor of a MoE whose experts -pcp shards
            _scoring_run("pcp1", [-1.0, -2.0], model="moe-tp"),
            _scoring_run("pcp1-v1", [-1.0, -2.0], model="moe-tp"),
            _scoring_run("tp2", [-1.0, -2.5], model="moe-tp"),
            _scoring_run("pcp2", [-1.0, -2.25], model="moe-tp")]
    models = _run_teacher(tmp_path, runs)["summary"]["models"]
    assert (models["m"]["goal"]["pcp2"], models["wide"]["goal"]["pcp2"]) == (False, True)
    assert models["moe"]["goal"]["pcp2"] is None and models["moe"]["noise_floor"] == {}
    moe_tp = models["moe-tp"]["goal"]
    assert moe_tp["pcp2"] is True and moe_tp["larger_floor"]["max_abs_logprob_diff"] == 0.5
    assert models["m"]["goal"]["larger_floor"]["max_abs_logprob_diff"] == 0.125  # no tp2
