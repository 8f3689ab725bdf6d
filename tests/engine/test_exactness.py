"""Engines of several ranks against one GPU (``pcp1``: vLLM's FlashInfer on Model Runner V2,
as every engine here), each test recording a row for the result files (conftest.py):

    pytest tests/engine -n 4 --dist loadgroup --results-dir tests/gpu/results  # 4 at once
    pytest tests/engine -k "pcp4 and teacher"                    # one slice
"""

from dataclasses import replace

import pytest
import torch

import cases as C
import judge
import layouts
from engines import Job, run_engine

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA GPUs")]

R, S, M, E, SWA = "qwen2.5-3b-shape", "smollm2", "qwen2-mqa-1kv", "qwen3-moe-8e", "mistral-swa512"
F, MOE = "standard,features", {E}  # MoE: held to vLLM's own expert sharding (-tp 2)
UNCOMPARED = {"agreement", "budget"}  # groups judged on their own, not against one GPU
FEATURE_FLOOR = "pcp1-flash-attn"  # a model's feature cases on one GPU's other kernel


def _each(model: str, names: str, groups: str = "standard", variant: str = "chunked") -> dict:
    return {(model, variant, name): groups for name in names.split()}


JOBS = {  # (model, variant, layout) -> the case groups of its engine
    # one GPU: the baselines
    **_each(R, "pcp1", F), **_each(R, "pcp1", F, "unchunked"), **_each(S, "pcp1", F),
    **_each(S, "pcp1", variant="unchunked"), **_each(M, "pcp1"), **_each(E, "pcp1", F),
    **_each(R + "-full", "pcp1"), **_each(R, "pcp1-fp8", "features"),
    **_each(R, "pcp1-preempt", "preemption"),
    # the one-GPU floors (pcp1-graphs: also the baseline of CUDA graphs), vLLM without
    # the plugin, and vLLM's own expert sharding
    **{k: v for m in (R, S, M, E, R + "-full")
       for k, v in _each(m, "pcp1-graphs pcp1-flash-attn").items()},
    **_each(R, "pcp1-stock"),
    # the feature cases' floor on real weights: one GPU against itself on another kernel
    **_each(S, FEATURE_FLOOR, F),
    **_each(E, "tp2", F),  # the floor of the MoE feature cases too
    # several ranks
    **_each(R, "pcp2 pcp2-paged pcp2-shard pcp2-dcp2-i8 pcp4", F),
    **_each(R, "tp2-pcp2", F + ",agreement"),
    **_each(R, "tp2-pcp2-dcp2-i1 pcp4-dcp4-i8 pcp8 pcp2-graphs pcp2-dcp2-i8-graphs "
               "pcp2-ray pcp2-dcp2-i1-ray pcp2-dcp2-i1 pcp2-dcp2-i16"),
    **_each(R, "pcp2 pcp2-dcp2-i8 pcp4", variant="unchunked"),
    # the test plan of vLLM's GQA FlashInfer PCP pull request (36 layers), and the same 8 ranks
    # on the 4-layer shape, which one GPU holding every rank can finish
    **_each(R + "-full", "tp4-pcp2-dcp2-i8"), **_each(R, "tp4-pcp2-dcp2-i8", "standard,agreement"),
    **_each(S, "pcp2 pcp2-dcp2-i1 pcp4", F), **_each(S, "pcp2-dcp2-i16 pcp4-dcp4-i1 pcp8"),
    **_each(S, "pcp2", variant="unchunked"),
    # one KV head; vLLM's own DCP inside TP (-tp 2 -dcp 2) beside the plugin's
    **_each(M, "pcp2 pcp2-dcp2-i1 pcp2-shard tp2-dcp2-i1 tp2-dcp2-i8 tp2-pcp2 "
               "tp2-pcp2-dcp2-i1"),
    # MoE: -pcp 4 shards its decodes (pcp_decode_policy auto); its ranks sample alike
    **_each(E, "pcp2", F), **_each(E, "pcp4", F + ",agreement"), **_each(E, "pcp2-dcp2-i1"),
    # the feature cases' own engines: forced context exchanges, preemption, fp8
    **_each(R, "pcp2-dcp2-i1-queries pcp2-dcp2-i1-keys pcp2-dcp2-i16-queries "
               "pcp2-dcp2-i16-keys", "same-step"),
    **_each(R, "pcp2-preempt pcp4-preempt pcp2-dcp2-i1-preempt", "preemption"),
    **_each(R, "pcp2-fp8 pcp4-fp8", "features"),
    # vLLM's own KV sizing at 0.9 of each GPU, then the longest prompt and a full step
    **_each(R, "pcp2-budget pcp2-dcp2-i1-queries-budget pcp2-dcp2-i1-keys-budget pcp4-budget",
            "budget", "unchunked"),
}
# what must stop at start-up, and a pattern its error must match
REFUSALS = {(SWA, "unchunked", "pcp2"): judge.SLIDING_WINDOW_PATTERN,
            (SWA, "unchunked", "pcp2-dcp2-i1-auto"): judge.SLIDING_WINDOW_PATTERN,
            (R, "chunked", "pcp2-dcp2-i1-fp8"): r"--kv-cache-dtype fp8",
            # MoE at PCP > 2 with decodes on every rank: they sampled differently
            # (vllm_pcp.config._moe_refusal)
            (E, "chunked", "pcp4-replicate"): r"mixture-of-experts model at -pcp 4"}
BASELINE = "pcp1"
# one GPU against itself: vLLM without the plugin (the same bits), the teacher-forced floors
FLOORS = {"pcp1-stock": BASELINE, **judge.TEACHER_FLOORS}
STANDARD = [k for k, groups in JOBS.items() if "standard" in groups.split(",")]
# run twice: bit for bit (the engine core in the worker's process: the same steps each run)
REPEATED = [(R, "chunked", BASELINE), (R, "chunked", "pcp2"), (M, "chunked", "pcp2-dcp2-i1")]
# the feature cases held to one GPU token for token where the layout is (seeded sampling)
EXACT_RULE_CASES = {c["case"] for c in C.feature_cases("features", 32768, 32000)
                    if c.get("rule") == "exact"}


def _params(keys, xfail: dict | None = None, group: str | None = None) -> list:
    """One param per job key, its id ``MODEL-VARIANT-LAYOUT``, marked with its GPUs and an
    xdist group of its engine (``--dist loadgroup``: a job's tests on one worker, which runs
    its engine once while the others run other engines; ``group``: all on one worker, one
    after another); ``xfail``: a reason by key, for the keys expected to fail."""
    xfail = xfail or {}
    return [pytest.param(k, id="-".join(k), marks=[
        pytest.mark.gpus(layouts.gpus(k[2])), pytest.mark.xdist_group(group or "-".join(k))] + (
        [pytest.mark.xfail(reason=xfail[k])] if k in xfail else []))
        for k in keys]


def _failures(cases: list[dict]) -> list[str]:
    return [c["case"] for c in cases if not c["passed"]]


def _compare(engine, judging, key, base=None) -> tuple[list, tuple, tuple]:
    """The raw entries of a job and of ``base`` (its one-GPU baseline), ``judging`` them."""
    base = base or key[:2] + (layouts.baseline(key[2]),)
    runs = [engine(key), engine(base)]
    return runs, base, judging(key[0], f"{key[2]} vs {base[2]}, {key[1]}", *runs)


def _assert_model_runner_v2(runs: list[dict]) -> None:
    """Every run that says which runner it took took Model Runner V2: one GPU draws a seeded
    request's random numbers as the -pcp engines do only there."""
    off = [r.get("config") for r in runs if r.get("model_runner_v2") is False]
    assert not off, f"not on Model Runner V2: {off}"


def _teacher(engine, key, base=None) -> tuple[list, dict]:
    runs, base, (cases, pooled) = _compare(engine, judge.teacher_cases, key, base)
    return runs, dict(model=key[0], config=key[2], base=base[2], cases=cases, pooled=pooled)


@pytest.fixture
def engine(pytestconfig):
    """``engine(key)``: the raw entry of a job of :data:`JOBS` (or :data:`REFUSALS`);
    ``engine(key, repeat=1)``: of the same job run once more."""
    max_tokens = pytestconfig.getoption("--engine-max-tokens")

    def job(key) -> Job:
        if key in REFUSALS:
            return Job(*key, groups="none", max_tokens=max_tokens, refusal=REFUSALS[key])
        teacher = None
        if key[1] == "chunked" and key in STANDARD:
            teacher = "self" if key[2] == BASELINE else job((key[0], "chunked", BASELINE))
        return Job(*key, groups=JOBS[key], max_tokens=max_tokens, teacher=teacher)
    return lambda key, repeat=0: run_engine(replace(job(key), repeat=repeat),
                                            pytestconfig.getoption("--engine-work-dir"))


@pytest.mark.parametrize("key", _params(k for k in STANDARD if layouts.baseline(k[2])))
def test_greedy(key, engine, record):
    """Each exactness case by vLLM's top-5 rule, or no more misses than the model's one-GPU
    floor that misses the most (a MoE model: than its -tp 2); at PCP > 1 every rank's steps
    as the layout's decode policy says."""
    runs, _, (cases, skipped) = _compare(engine, judge.compare_run, key)
    record("greedy", key, runs, cases=cases, not_compared=skipped, dcp=layouts.LAYOUTS[key[2]].dcp)
    _assert_model_runner_v2(runs)
    policy = layouts.decode_policy(key[2], key[0] in MOE)
    steps = judge.step_counts_as_expected(runs[0], policy) if policy else None
    assert steps is not False, (policy, runs[0].get("step_counts"))
    missed = _failures(cases)
    assert "engine" not in missed, cases[0]
    floors = _greedy_floors(engine, key) if missed else {}
    assert len(missed) <= allowed_misses(floors), (missed, floors)


def _greedy_floors(engine, key) -> dict[str, list[str]]:
    """The top-5 misses, by layout, of the jobs that hold ``key``'s misses: vLLM's expert
    sharding (-tp 2) for a MoE model, the model's one-GPU floors for the rest."""
    if key[0] in MOE:
        jobs = {(key[0], "chunked", judge.EXPERT_SHARDING_FLOOR): None}
    else:
        jobs = {k: k[:2] + (FLOORS[c],) for c, k in floor_keys(key).items()
                if c in judge.GOAL_FLOORS}
    return {k[2]: _failures(_compare(engine, judge.compare_run, k, base)[2][0])
            for k, base in jobs.items()}


def allowed_misses(floor_misses: dict[str, list[str]]) -> int:
    """How many cases a layout may miss vLLM's top-5 rule in: as many as the floor in
    ``floor_misses`` that misses the most. A random model's near ties make one GPU miss
    against itself (eager against CUDA graphs); a floor whose engine failed excuses none."""
    return max((sum(c != "engine" for c in f) for f in floor_misses.values()), default=0)


@pytest.mark.parametrize("key", _params(k for k in JOBS if k[2] in FLOORS))
def test_floor(key, engine, record):
    """The one-GPU noise floors: greedy, (chunked) teacher-forced and, where both engines ran
    them, the feature cases, recorded. vLLM without the plugin: the baseline's bits, every
    case both ran (at PCP = 1 the plugin leaves vLLM's FlashInfer as it is)."""
    base = key[:2] + (FLOORS[key[2]],)
    runs, _, (cases, _) = _compare(engine, judge.compare_run, key, base)
    scored = key[2] in judge.TEACHER_FLOORS and key[1] == "chunked"
    teacher = _teacher(engine, key, base)[1] if scored else None
    features = _floor_features(engine, key)
    record("floor", key, runs, cases=cases, teacher=teacher, features=features)
    assert not any(r["returncode"] for r in runs), runs[0].get("errors")
    _assert_model_runner_v2(runs)
    assert teacher is None or teacher["pooled"] is not None, teacher["cases"][0]
    if layouts.LAYOUTS[key[2]].stock and layouts.gpus(key[2]) == 1:
        compared, differ = judge.differing_cases(*runs)
        assert compared and not differ, differ


TEACHER_KEYS = [k for k in STANDARD if k[1] == "chunked" and layouts.baseline(k[2])
                and k[2] not in judge.TEACHER_FLOORS]


def floor_keys(key: tuple) -> dict[str, tuple]:
    """The jobs of ``key``'s model that are its teacher-forced floors, by layout."""
    return {c: key[:2] + (c,) for c in judge.TEACHER_FLOORS if key[:2] + (c,) in JOBS}


@pytest.mark.parametrize("key", _params(TEACHER_KEYS))
def test_teacher(key, engine, record):
    """Teacher-forced: max and p99 at most the goal's factor times the model's larger one-GPU
    floor, no position over 1.0 (a MoE model: no more than its -tp 2 floor)."""
    runs, row = _teacher(engine, key)
    record("teacher", key, runs, **row)
    floors = {c: _teacher(engine, k, key[:2] + (judge.TEACHER_FLOORS[c],))[1]["pooled"]
              for c, k in floor_keys(key).items()}
    factors = {key[2]: judge.TEACHER_GOALS[key[2]]} if key[2] in judge.TEACHER_GOALS else {}
    goal = judge.teacher_goal(floors, {key[2]: row["pooled"]}, factors)
    assert row["pooled"] is not None, row["cases"][0]
    assert goal["larger_floor"] is not None, f"no one-GPU floor of {key[0]} ran: {floors}"
    assert goal.get(key[2]) is not False, (row["pooled"], goal["larger_floor"])
    tp2 = floors.get(judge.EXPERT_SHARDING_FLOOR) if key[0] in MOE else None
    assert row["pooled"]["positions_over_1"] <= (tp2["positions_over_1"] if tp2 else 0)


FEATURE_KEYS = [k for k in JOBS if set(JOBS[k].split(",")) - {"standard", *UNCOMPARED}
                and layouts.baseline(k[2])]
# a MoE model's feature cases at vLLM's own expert sharding: the floor its layouts are held to
EXPERT_SHARDING_KEYS = {k: "vLLM's expert sharding rounds otherwise than one GPU: not exact"
                        for k in FEATURE_KEYS
                        if k[0] in MOE and k[2] == judge.EXPERT_SHARDING_FLOOR}


@pytest.mark.parametrize("key", _params(FEATURE_KEYS, xfail=EXPERT_SHARDING_KEYS))
def test_features(key, engine, record):
    """Each feature case by the top-5 rule and its kind's (seeded sampling: token for token
    where the layout is held to it, else the top-5 rule), or no more misses than the
    model's floor where it has one: one GPU against itself on another kernel, a MoE
    model's vLLM expert sharding (-tp 2) against one GPU."""
    runs, _, (cases, skipped) = _compare(engine, judge.compare_features, key)
    record("features", key, runs, cases=cases, not_compared=skipped)
    _assert_model_runner_v2(runs)
    missed = feature_misses(cases, layouts.exact_sampling(key[2]))
    floor = _feature_floor(engine, key) if missed else set()
    assert feature_misses_allowed(key[2], missed, floor), (sorted(missed), sorted(floor))


def feature_misses(cases: list[dict], exact_sampling: bool) -> set[str]:
    """The feature cases that miss their rule: every case that failed, but a seeded-sampling
    case (rule ``exact``) of a layout not held to ``exact_sampling`` misses only where its
    samples part from one GPU's at unlike distributions (:func:`judge.alike_samples`)."""
    return {c["case"] for c in cases if not c["passed"] and (
        exact_sampling or c.get("rule") != "exact" or not c.get("sample_rule_passed"))}


def _feature_floor(engine, key) -> set[str]:
    """The feature cases ``key``'s model misses without this plugin's split: at vLLM's own
    expert sharding against one GPU (a MoE model), else one GPU against itself on another
    kernel; none where the model has no such job."""
    sharded = key[:2] + (judge.EXPERT_SHARDING_FLOOR,)
    if key[0] in MOE and sharded != key and "features" in JOBS.get(sharded, "").split(","):
        cases = _compare(engine, judge.compare_features, sharded)[2][0]
    else:
        cases = _floor_features(engine, key[:2] + (FEATURE_FLOOR,)) or []
    return feature_misses(cases, exact_sampling=False)


def feature_misses_allowed(layout: str, missed: set[str], floor: set[str]) -> bool:
    """Whether ``layout`` may miss the feature cases ``missed`` (:func:`feature_misses`): as
    many as ``floor`` misses (as :func:`allowed_misses` holds the greedy cases). Near ties
    decide which case a rounding difference flips, so the count is held, not the names: on
    the MoE shape stock -tp 2 missed a 4,097-token prompt at its first token, which -pcp 2
    passed. Never seeded sampling where the layout is held to one GPU's samples
    (:func:`layouts.exact_sampling`), never an engine that failed."""
    if layouts.exact_sampling(layout) and missed & EXACT_RULE_CASES:
        return False
    return "engine" not in missed and len(missed) <= allowed_misses({"floor": sorted(floor)})


def _floor_features(engine, key) -> list[dict] | None:
    """The feature cases of the floor job ``key`` against its base (one GPU against
    itself, run on demand); None where the two do not both run them."""
    base = key[:2] + (FLOORS[key[2]],)
    if not all("features" in JOBS.get(k, "").split(",") for k in (key, base)):
        return None
    return _compare(engine, judge.compare_features, key, base)[2][0]


@pytest.mark.parametrize("key", _params(k for k in JOBS if "agreement" in JOBS[k].split(",")))
def test_sampled_tokens_agree(key, engine, record):
    """-tp with -pcp, and a MoE model at -pcp 4: a greedy and a seeded request decode side
    by side for 256 steps, and every step's sampled tokens are equal on all PCP ranks (the
    check mode stops the engine at the first step where they differ)."""
    entry = engine(key)
    row = judge.agreement_row(entry)
    record("agreement", key, [entry], **row)
    assert row["passed"], row


@pytest.mark.parametrize("key", _params(REPEATED))
def test_repeatable(key, engine, record):
    """The same engine twice: every case bit for bit (token ids, logprobs, scores), so a
    later run is held to what an earlier one gave and a divergence is never timing's."""
    runs = [engine(key), engine(key, repeat=1)]
    compared, differ = judge.differing_cases(*runs)
    record("repeat", key, runs, compared=compared, differ=differ)
    assert compared and not differ, differ


@pytest.mark.parametrize("key", _params(REFUSALS))
def test_refusal(key, engine, record):
    """Refused at start-up within 120 s of the engine's start, the error naming why."""
    entry = engine(key)
    case = judge.refusal_case(key[0], f"{key[2]}, {key[1]}", entry["refusal"])
    record("refusal", key, [entry], cases=[case])
    assert case["passed"], (case["error"], case["seconds_to_failure"], case["timed_out"])


@pytest.mark.parametrize("key", _params((k for k in JOBS if JOBS[k] == "budget"),
                                        group="memory-budget"))
def test_memory_budget(key, engine, record):
    """At --gpu-memory-utilization 0.9, vLLM sizing the KV cache: the longest prompt and a
    full step run with no out-of-memory error, each rank's peak within what the profile held.
    One engine at a time (each takes 0.9 of its GPUs): run beside no other engine."""
    if torch.cuda.device_count() < layouts.gpus(key[2]):
        pytest.skip("needs a GPU per rank: ranks sharing a GPU take a fixed KV pool")
    entry = engine(key)
    row = judge.budget_row(entry)
    record("memory", key, [entry], ranks=row["ranks"])
    assert row["passed"], row


@pytest.mark.parametrize("key", _params(k for k in JOBS if layouts.LAYOUTS[k[2]].pcp > 1
                                        and JOBS[k] != "budget"))
def test_memory(key, engine, record):
    """Each rank's peak on the split steps within what vLLM's profile run set aside."""
    entry = engine(key)
    ranks = judge.rank_rows(entry) if entry.get("memory") else None
    record("memory", key, [entry], ranks=ranks)
    assert ranks, entry.get("errors") or "no memory recorded"
    assert all(r["fits"] is not False for r in ranks), ranks
