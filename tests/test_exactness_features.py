"""The feature cases of the GPU exactness checks (scripts/exactness_features.py,
check_exactness.py ``features``; the stage: tests/test_run_gpu_checks.py), on CPU."""
import json
import os
import sys
import time
from types import SimpleNamespace

import pytest

SCRIPTS = os.path.join(os.path.dirname(__file__), "..", "scripts")
sys.path.insert(0, SCRIPTS)
import check_exactness as ce  # noqa: E402
import exactness_features_cli as efc  # noqa: E402
import exactness_features as ef  # noqa: E402

MAX_PROMPT = 32768 + 64 - 32 - 8  # the worker's max_prompt_len at --max-tokens 32
VOCAB = 32000
PCP_CASE_KEYS = {"model", "config", "case", "prompt_lens", "first_divergence",
                 "max_abs_logprob_diff", "passed"}


def _out(tokens, prompt_logprobs=None, text=None):
    """A worker output whose every position has a top-5 in which 2, 6 and 99 follow."""
    out = {"token_ids": tokens,
           "logprobs": [{str(t): -0.1, **{str(o): -0.2 for o in (2, 6, 99) if o != t}}
                        for t in tokens]}
    if prompt_logprobs is not None:
        out["prompt_logprobs"] = prompt_logprobs
    if text is not None:
        out["text"] = text
    return out


def _result(case, kind, outputs, **extra):
    return {"case": case, "kind": kind, "prompt_lens": [7], "outputs": outputs, **extra}


def test_sampled_case_draws_four_seeded_choices_where_vllm_refuses_greedy():
    from vllm import SamplingParams

    case = ef.sampled_case(MAX_PROMPT, VOCAB)
    assert case["rule"] == "exact" and min(len(p) for p in case["prompts"]) >= 9001
    params = ef.sampling_params(case, 32)
    assert (params.n, params.seed, params.max_tokens, params.logprobs) == (4, 1234, 32, 5)
    assert params.temperature > 0 and params.ignore_eos
    with pytest.raises(ValueError, match="n must be 1 when using greedy sampling"):
        SamplingParams(n=4, temperature=0.0)
    assert ef.sampled_case(MAX_PROMPT, VOCAB) == case  # the same prompts on every engine


def test_burst_shares_its_long_prefix_and_fits_one_unchunked_step():
    case = ef.burst_case(MAX_PROMPT, VOCAB)
    prefix = case["prompts"][0][:case["prefix_len"]]
    assert case["prefix_len"] >= 6000 and len(case["prompts"]) == len(ef.BURST_SUFFIXES) <= 16
    assert all(p[:case["prefix_len"]] == prefix for p in case["prompts"])
    assert len({tuple(p[case["prefix_len"]:]) for p in case["prompts"]}) == len(case["prompts"])
    # after the first request, each hits the prefix's full blocks in the same step
    hit = case["prefix_len"] // 32 * 32
    scheduled = len(case["prompts"][0]) + sum(len(p) - hit for p in case["prompts"][1:])
    assert scheduled <= 32768 + 64  # the unchunked variant's max_num_batched_tokens
    assert efc._feature_group("pcp2-dcp2-i16-keys") == "same-step"
    assert [c["case"] for c in ef.build_feature_cases("same-step", MAX_PROMPT, VOCAB)] == list(
        ef.SAME_STEP_CASES)


def test_split_cases_have_odd_and_even_lengths_alone_and_together():
    cases = {c["case"]: c for c in ef.split_cases(MAX_PROMPT, VOCAB)}
    lengths = [len(cases[f"split_{n}"]["prompts"][0]) for n in ef.SPLIT_LENGTHS]
    assert {n % 2 for n in lengths} == {0, 1} and max(lengths) > 8192
    assert [len(p) for p in cases["split_odd_even_batch"]["prompts"]] == lengths
    assert len(ef.split_cases(4096, VOCAB)) == 4  # 5, 6, 4096 and the batch


@pytest.mark.parametrize("config", ["pcp1-v1-preempt", "pcp2-preempt", "pcp4-preempt",
                                    "pcp2-dcp2-i1-preempt", "pcp2-dcp2-i16-preempt"])
def test_preemption_pool_takes_every_prompt_but_not_the_whole_batch(config, monkeypatch):
    flags = ce.CONFIGS[config]
    dcp = int(flags[flags.index("--dcp") + 1]) if "--dcp" in flags else 1
    capacity = int(flags[flags.index("--kv-pool-tokens") + 1]) * dcp
    max_model_len = int(flags[flags.index("--max-model-len") + 1])
    assert capacity == ef.PREEMPT_CAPACITY_TOKENS
    case = ef.preemption_case(VOCAB, capacity)
    lengths = [len(p) for p in case["prompts"]]
    block = ef.BLOCK_TOKENS * dcp
    assert (ef.blocks_needed(lengths, block) + 1) * block <= capacity  # all admitted
    finished = [n + case["sampling"]["max_tokens"] for n in lengths]
    assert ef.blocks_needed(finished, block) * block > capacity  # not all finish together
    assert max(finished) <= max_model_len <= capacity  # vLLM's start-up check
    assert {n % 2 for n in lengths} == {0, 1} and len(lengths) <= 16
    assert efc._feature_group(config) == "preemption"
    assert efc._feature_baseline(config) == (
        None if config == "pcp1-v1-preempt" else "pcp1-v1-preempt")
    monkeypatch.setattr(ef, "PREEMPT_MAX_TOKENS", 16)  # outputs inside the slack
    with pytest.raises(ValueError, match="do not preempt"):
        ef.preemption_case(VOCAB, capacity)


def test_groups_and_the_json_case_needs_a_tokenizer():
    names = [c["case"] for c in ef.build_feature_cases("features", MAX_PROMPT, VOCAB)]
    assert "json_schema" not in names and {"sampled_n4", "burst", "prompt_logprobs",
                                           "repetition_penalty"} <= set(names)
    cases = ef.build_feature_cases("features", MAX_PROMPT, VOCAB, with_json=True)
    json_case = next(c for c in cases if c["case"] == "json_schema")
    params = ef.sampling_params(json_case, 32)
    assert params.structured_outputs.json == ef.JSON_SCHEMA
    assert params.detokenize and not params.ignore_eos and params.max_tokens == 96
    assert params.temperature == 0 and params.n == 1
    assert ef.sampling_params(next(c for c in cases if c["case"] == "repetition_penalty"),
                              32).repetition_penalty == 1.3
    assert ef.build_feature_cases("none", MAX_PROMPT, VOCAB) == []
    with pytest.raises(ValueError, match="unknown case group"):
        ef.build_feature_cases("all", MAX_PROMPT, VOCAB)


class FakeLLM:
    """generate() answers each prompt with ``n`` choices in reverse index order and
    prompt logprobs when asked; each call counts one preemption."""

    def __init__(self):
        self.preempted, self.prompts = 0, []

    def get_metrics(self):
        return [SimpleNamespace(name="vllm:num_preemptions", value=self.preempted),
                SimpleNamespace(name="vllm:num_requests_running", value=3)]

    def generate(self, prompts, params, use_tqdm):
        self.preempted += 1
        self.prompts += [p["prompt_token_ids"] for p in prompts]
        lp = SimpleNamespace
        outs = []
        for p in prompts:
            ids = p["prompt_token_ids"]
            choices = [SimpleNamespace(index=i, token_ids=[i, i + 1], text="",
                                       logprobs=[{i: lp(logprob=-0.5)}, {i + 1: lp(logprob=-1.0)}])
                       for i in reversed(range(params.n))]
            prompt_lps = None
            if params.prompt_logprobs is not None:
                prompt_lps = [None] + [{t: lp(logprob=-t / 1e5), 7: lp(logprob=-9.0)}
                                       for t in ids[1:]]
            outs.append(SimpleNamespace(outputs=choices, prompt_logprobs=prompt_lps))
        return outs


def test_run_feature_group_records_every_choice_in_index_order():
    llm = FakeLLM()
    results = {r["case"]: r for r in ef.run_feature_group(llm, "features", 5000, VOCAB, 32,
                                                         tokenizer=list(range(1000)))}
    sampled = results["sampled_n4"]
    assert sampled["choices"] == 4 and sampled["rule"] == "exact"
    assert [o["token_ids"][0] for o in sampled["outputs"]] == [0, 1, 2, 3] * 2
    assert sampled["outputs"][1]["logprobs"] == [{"1": -0.5}, {"2": -1.0}]
    assert sampled["preemptions"] == 1 and sampled["kind"] == "sampled"
    plp = results["prompt_logprobs"]
    assert [len(o["prompt_logprobs"]) for o in plp["outputs"]] == [n - 1 for n in
                                                                  plp["prompt_lens"]]
    assert "prompt_logprobs" not in results["burst"]["outputs"][0]
    assert "json_schema" in results  # a tokenizer: the JSON case runs
    assert max(t for p in llm.prompts for t in p) < 1000  # ids inside its vocabulary


def _compare(run_results, base_results, config="pcp2-dcp2-i1-auto"):
    run = {"returncode": 0, "feature_results": run_results}
    base = {"returncode": 0, "feature_results": base_results}
    return efc._feature_cases("m", f"{config} vs pcp1-v1, chunked", run, base, 0)


def test_n4_choices_must_equal_the_one_gpu_choices_exactly():
    base = [_out([5, 6]), _out([5, 6]), _out([5, 6]), _out([5, 6])]
    near_tie = [_out([5, 6]), _out([5, 6]), _out([5, 99]), _out([5, 6])]
    sampled, burst = _compare(
        [_result("sampled_n4", "sampled", near_tie, rule="exact", choices=4),
         _result("burst", "burst", near_tie)],
        [_result("sampled_n4", "sampled", base, rule="exact", choices=4),
         _result("burst", "burst", base)])
    assert (sampled["rule"], sampled["choices"], sampled["first_divergence"]) == ("exact", 4, 1)
    assert not sampled["passed"]
    assert burst["passed"] and burst["first_divergence"] == 1  # top-5 rule
    same = _compare([_result("sampled_n4", "sampled", base, rule="exact")],
                    [_result("sampled_n4", "sampled", base, rule="exact")])
    assert same[0]["passed"]
    fewer = _compare([_result("sampled_n4", "sampled", base[:3], rule="exact")],
                     [_result("sampled_n4", "sampled", base, rule="exact")])
    assert not fewer[0]["passed"]


def test_prompt_logprobs_are_held_position_by_position():
    base = [_out([5], prompt_logprobs=[-1.0] * 100)]
    close = [_out([5], prompt_logprobs=[-1.0] * 99 + [-1.5])]
    far = [_out([5], prompt_logprobs=[-1.0] * 99 + [-2.5])]
    short = [_out([5], prompt_logprobs=[-1.0] * 99)]
    got = [_compare([_result("prompt_logprobs", "prompt_logprobs", o)],
                    [_result("prompt_logprobs", "prompt_logprobs", base)])[0]
           for o in (close, far, short)]
    assert got[0]["passed"] and got[0]["max_abs_prompt_logprob_diff"] == 0.5
    assert got[0]["prompt_positions"] == 100 and got[0]["prompt_positions_over_limit"] == 0
    assert 0 < got[0]["p99_abs_prompt_logprob_diff"] <= 0.5
    assert not got[1]["passed"] and got[1]["prompt_positions_over_limit"] == 1
    assert not got[2]["passed"] and not got[2]["prompt_positions_match"]


def test_preemption_must_happen_and_json_that_parses_on_one_gpu_must_parse():
    outs = [_out([5, 6])]
    none, some = (_compare([_result("preemption", "preemption", outs, preemptions=n)],
                           [_result("preemption", "preemption", outs, preemptions=2)],
                           "pcp2-preempt")[0] for n in (0, 3))
    assert not none["passed"] and (some["preemptions"], some["baseline_preemptions"]) == (3, 2)
    assert some["passed"]
    good = '{"name": "x", "count": 3, "tags": ["a"]}'
    base = [_result("json_schema", "json_schema", [_out([5], text=good)])]
    ok, bad = (_compare([_result("json_schema", "json_schema", [_out([5], text=t)])], base)[0]
               for t in (good, '{"name": "x"'))
    assert ok["passed"] and ok["json_valid"] == ok["baseline_json_valid"] == 1
    assert not bad["passed"] and bad["json_valid"] == 0
    assert not ef.json_valid('{"name": "x", "count": 3}') and not ef.json_valid(None)


VLLM_SM90_LOG = """exactness-worker engine start at 1000.0
(EngineCore pid=7) INFO 12-01 10:00:01 [core.py:100] Initializing a V1 LLM engine
(Worker_PCP0 pid=8) ERROR 12-01 10:00:30 [multiproc_executor.py:800] NotImplementedError: \
FlashInfer backend on SM90 currently crashes with sliding-window attention layers. Use the \
default attention backend.
(EngineCore pid=7) ERROR 12-01 10:00:31 [core.py:1330] Exception: WorkerProc initialization failed
RuntimeError: Engine core initialization failed. See root cause above."""
PLUGIN_LOG = """exactness-worker engine start at 1000.0
Traceback (most recent call last):
vllm_pcp.config.PCPConfigError: vllm-pcp cannot run --prefill-context-parallel-size 2 with:
  - sliding-window attention (the model's sliding_window = 512): vllm-pcp's DCP attention \
has no window; drop -dcp (run -pcp 2 alone), or pass --disable-sliding-window
  - --kv-cache-dtype fp8: vllm-pcp's DCP runs unquantized KV caches"""


def test_refusal_record_names_the_setting_and_the_seconds_from_engine_start():
    vllm = ef.refusal_record(VLLM_SM90_LOG, 1, False, 45.0, 1031.5, ef.SLIDING_WINDOW_PATTERN)
    assert vllm["refused"] and vllm["seconds_to_failure"] == 31.5
    assert vllm["message"].startswith("NotImplementedError: FlashInfer backend on SM90")
    assert vllm["errors"][-1].startswith("RuntimeError: Engine core initialization failed")
    plugin = ef.refusal_record(PLUGIN_LOG, 1, False, 12.04, 1004.0, r"--kv-cache-dtype fp8")
    assert plugin["refused"] and plugin["process_seconds"] == 12.0
    assert plugin["message"].splitlines() == [
        "vllm_pcp.config.PCPConfigError: vllm-pcp cannot run --prefill-context-parallel-size "
        "2 with:", PLUGIN_LOG.splitlines()[3].strip(), PLUGIN_LOG.splitlines()[4].strip()]
    started = ef.refusal_record("exactness-worker engine start at 1000.0\nok", 0, False, 90,
                                1080, ef.SLIDING_WINDOW_PATTERN)
    hung = ef.refusal_record(VLLM_SM90_LOG, -9, True, 300, 1300, ef.SLIDING_WINDOW_PATTERN)
    unnamed = ef.refusal_record(VLLM_SM90_LOG, 1, False, 45, 1031, r"soft-cap")
    assert not (started["refused"] or hung["refused"] or unnamed["refused"])
    assert unnamed["message"].startswith("NotImplementedError")  # the first error, for the record
    case = ef.refusal_case("mistral-swa512", "pcp2, unchunked", vllm)
    assert case["passed"] and PCP_CASE_KEYS <= set(case) and case["case"] == "refusal"
    assert not ef.refusal_case("m", "c", vllm, limit_s=30)["passed"]


# the plugin's refusal raised while vLLM builds its VllmConfig (a pydantic dataclass), as
# an H200 run's log shows it
PYDANTIC_LOG = """exactness-worker engine start at 1000.0
pydantic_core._pydantic_core.ValidationError: 1 validation error for VllmConfig
  Value error, vllm-pcp cannot run --prefill-context-parallel-size 2 with:
  - --kv-cache-dtype fp8: vllm-pcp's DCP runs unquantized KV caches [type=value_error]
    For further information visit https://errors.pydantic.dev/2.14/v/value_error"""


def test_a_refusal_inside_vllms_config_validation_is_read_as_one():
    record = ef.refusal_record(PYDANTIC_LOG, 1, False, 9.0, 1008.4, r"--kv-cache-dtype fp8")
    assert record["refused"] and record["seconds_to_failure"] == 8.4
    assert record["message"].splitlines()[1:] == [
        "vllm-pcp cannot run --prefill-context-parallel-size 2 with:",
        "- --kv-cache-dtype fp8: vllm-pcp's DCP runs unquantized KV caches [type=value_error]"]
    judged_before = {**record, "refused": False, "message": "ValidationError"}
    again = ef.rejudge_refusal(judged_before, PYDANTIC_LOG, r"--kv-cache-dtype fp8")
    assert again["refused"] and again["message"] == record["message"]
    hung = ef.rejudge_refusal({**judged_before, "timed_out": True}, PYDANTIC_LOG, r"fp8")
    assert not hung["refused"]


def test_run_refusal_judges_a_quick_refusal_and_kills_a_hung_worker():
    mark = f"print({ef.ENGINE_START_MARK!r}, __import__('time').time(), flush=True)"
    refuse = f"{mark}; raise NotImplementedError('crashes with sliding-window attention')"
    entry = {"model": "m", "variant": "unchunked", "config": "pcp2"}
    got = efc._run_refusal([sys.executable, "-c", refuse], entry, {}, ef.SLIDING_WINDOW_PATTERN,
                          timeout=60)
    assert got["returncode"] == 0 and got["refusal"]["refused"]
    assert got["refusal"]["seconds_to_failure"] < 10
    start = time.perf_counter()
    hang = efc._run_refusal([sys.executable, "-c", f"{mark}; __import__('time').sleep(60)"],
                           entry, {}, ef.SLIDING_WINDOW_PATTERN, timeout=1)
    assert time.perf_counter() - start < 30
    assert hang["returncode"] == 1 and hang["refusal"]["timed_out"]
    assert not hang["refusal"]["refused"]


def test_features_run_gives_each_configuration_its_cases_and_routes_refusals(tmp_path,
                                                                            monkeypatch):
    tokenizer = tmp_path / "tokenizer"
    tokenizer.mkdir()
    monkeypatch.setitem(ce.FEATURE_TOKENIZERS, "dense", str(tokenizer))
    monkeypatch.setattr(ce, "versions", lambda: {"gpu": "2 x test"})
    monkeypatch.setattr(ce, "_gpu_count", lambda: 2)
    seen = {}

    def fake_worker(cmd, out, key, entry, env, extra):
        assert key == "feature_results"  # the worker's key of the feature groups
        seen[(entry["model"], entry["config"])] = cmd
        return {**entry, "returncode": 0, "feature_results": []}

    def fake_refusal(cmd, entry, env, pattern, timeout):
        seen[(entry["model"], entry["config"])] = ("refusal", pattern, cmd)
        return {**entry, "returncode": 0, "refusal": {}}

    monkeypatch.setattr(efc, "run_worker", fake_worker)
    monkeypatch.setattr(efc, "_run_refusal", fake_refusal)
    args = SimpleNamespace(features_cmd="run", models="dense,mistral-swa512",
                           configs="pcp1,pcp2-dcp2-i1-keys,pcp2-dcp2-i1-fp8,pcp2-preempt",
                           variants="chunked", overlap=True, lanes=2, one_gpu_lanes=1,
                           fail_fast=True, raw=str(tmp_path / "raw.json"), models_dir="/m",
                           gpu_memory_utilization=0.05, max_tokens=32, kv_cache_gib=2.0,
                           refusal_timeout=300, cases="standard", max_model_len=0)
    ce.features(args)
    cmd = seen[("dense", "pcp2-dcp2-i1-keys")]
    assert cmd[cmd.index("--cases") + 1] == "same-step"
    assert cmd[cmd.index("--dcp-context-exchange") + 1] == "keys"
    assert cmd[cmd.index("--tokenizer") + 1] == str(tokenizer)
    preempt = seen[("dense", "pcp2-preempt")]
    assert preempt[preempt.index("--cases") + 1] == "preemption"
    assert preempt[preempt.index("--kv-pool-tokens") + 1] == str(ef.PREEMPT_CAPACITY_TOKENS)
    assert seen[("dense", "pcp2-dcp2-i1-fp8")][:2] == ("refusal", r"--kv-cache-dtype fp8")
    kind, pattern, swa = seen[("mistral-swa512", "pcp1")]
    assert pattern == ef.SLIDING_WINDOW_PATTERN and swa[swa.index("--cases") + 1] == "none"
    assert "--tokenizer" not in swa
    assert len(json.load(open(args.raw))["runs"]) == 8
    with pytest.raises(SystemExit, match="unknown configurations"):
        ce.features(SimpleNamespace(**{**vars(args), "configs": "pcp2-dcp2-i8-auto"}))


def _pcp_result_schema():
    path = os.path.join(os.path.dirname(__file__), "gpu", "results", "exactness-pcp.json")
    with open(path) as f:
        return json.load(f)


def test_features_compare_writes_the_schema_of_exactness_pcp(tmp_path):
    def run(config, results, returncode=0, **extra):
        return {"model": "m", "variant": "chunked", "config": config,
                "returncode": returncode, "feature_results": results, **extra}

    sampled = [_out([5, 6])] * 4
    results = [_result("sampled_n4", "sampled", sampled, rule="exact", choices=4),
               _result("burst", "burst", [_out([5, 6]), _out([5, 6])])]
    refusal = ef.refusal_record(VLLM_SM90_LOG, 1, False, 45, 1031.5, ef.SLIDING_WINDOW_PATTERN)
    raw = tmp_path / "raw.json"
    raw.write_text(json.dumps({"versions": {"gpu": "2 x NVIDIA H200", "vllm": "0.26.0",
                                            "flashinfer": "0.6.14", "torch": "2.11"},
                               "runs": [run("pcp1-v1", results),
                                        run("pcp2-dcp2-i1-auto", results),
                                        run("pcp2-dcp2-i1-keys", results[1:]),
                                        run("pcp2", [], returncode=1, errors=["E: x"]),
                                        {**run("pcp2-dcp2-i1-auto", []), "model": "swa",
                                         "refusal": refusal}]}))
    out = tmp_path / "exactness-features.json"
    ce.features(SimpleNamespace(features_cmd="compare", raw=[str(raw)], git_rev="abc",
                                command="c", out=str(out), note="", date="2026-12-01",
                                tokens=0))
    got, pcp = json.load(open(out)), _pcp_result_schema()
    assert set(got) == {"meta", "summary", "cases"}
    required = {"git_rev", "command", "gpu", "vllm", "flashinfer", "torch", "date"}
    # the fields of every result's meta (a run adds note, jobs, ranks_shared_gpus)
    assert required == set(got["meta"]) and required <= set(pcp["meta"])
    assert got["meta"]["git_rev"] == "abc"
    assert set(pcp["summary"]) - {"noise_floor", "not_compared"} <= set(got["summary"])
    assert all(PCP_CASE_KEYS <= set(c) for c in got["cases"])
    by = {(c["config"], c["case"]): c for c in got["cases"]}
    assert by[("pcp2-dcp2-i1-auto vs pcp1-v1, chunked", "sampled_n4")]["passed"]
    assert ("pcp2-dcp2-i1-keys vs pcp1-v1, chunked", "burst") in by
    assert not by[("pcp2 vs pcp1-v1, chunked", "engine")]["passed"]
    assert by[("pcp2-dcp2-i1-auto, chunked", "refusal")]["seconds_to_failure"] == 31.5
    summary = got["summary"]
    assert (summary["cases"], summary["passed"]) == (4, 3)
    assert summary["by_case"]["burst"]["cases"] == 2
    assert summary["refusals"] == {"cases": 1, "passed": 1, "max_seconds_to_failure": 31.5}


def test_model_configs_build_a_random_moe_on_cpu_in_seconds(tmp_path):
    from safetensors import safe_open
    from transformers import AutoConfig

    start = time.perf_counter()
    ce.build_models(str(tmp_path), layers=1, device="cpu", only=["qwen3-moe-8e"])
    assert time.perf_counter() - start < 30  # about 3 s on two cores
    assert os.listdir(tmp_path) == ["qwen3-moe-8e"]
    hf = json.load(open(tmp_path / "qwen3-moe-8e" / "config.json"))
    experts = hf.get("num_experts", hf.get("num_local_experts"))
    assert hf["model_type"] == "qwen3_moe" and experts >= 8 and hf["num_experts_per_tok"] == 2
    assert hf["num_attention_heads"] > hf["num_key_value_heads"] > 1
    assert hf["head_dim"] in (64, 128) and hf["num_hidden_layers"] == 1
    llama = json.load(open(os.path.join(ce.ROOT, "configs", "models", "llama-8kv-hd64.json")))
    assert hf["vocab_size"] == llama["vocab_size"]
    keys = safe_open(str(tmp_path / "qwen3-moe-8e" / "model.safetensors"), "pt").keys()
    assert "model.layers.0.mlp.experts.7.gate_proj.weight" in keys  # vLLM's loader's names
    with open(os.path.join(ce.ROOT, "configs", "models", "mistral-swa512.json")) as f:
        fields = json.load(f)
    swa = AutoConfig.for_model(fields.pop("model_type"), **fields)
    assert type(swa).__name__ == "MistralConfig"
    assert swa.sliding_window < min(ef.SPLIT_LENGTHS[2:] + ef.SAMPLED_LENGTHS)
    assert "mistral-swa512" in efc.FEATURE_REFUSED_MODELS


def test_worker_flags_of_the_features_and_the_plugins_exchanges():
    import argparse

    from vllm_pcp.config import CONTEXT_EXCHANGES

    assert set(efc.FEATURE_EXCHANGES) == set(CONTEXT_EXCHANGES)
    ap = argparse.ArgumentParser()
    ef.add_feature_args(ap)
    args = ap.parse_args(["--cases", "features", "--kv-cache-dtype", "fp8", "--tokenizer", "/t"])
    assert ef.engine_feature_args(args) == {"tokenizer": "/t", "kv_cache_dtype": "fp8",
                                            "disable_log_stats": False}
    assert ef.engine_feature_args(ap.parse_args([])) == {}
    assert ap.parse_args([]).max_model_len == 0


def test_worker_runs_a_case_group_on_the_engine_it_asks_for(tmp_path, monkeypatch, capsys):
    """exactness_worker.main with a stand-in vllm.LLM: the feature flags reach the
    engine, the start mark is printed, and the group's results are written."""
    import vllm

    import exactness_worker

    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({
        "max_position_embeddings": 40960, "vocab_size": VOCAB, "num_hidden_layers": 4,
        "num_key_value_heads": 2, "num_attention_heads": 16, "hidden_size": 2048,
        "head_dim": 128}))
    engines = []

    class Engine(FakeLLM):
        def __init__(self, **kwargs):
            super().__init__()
            engines.append(kwargs)
            cache = SimpleNamespace(num_gpu_blocks=384, block_size=16)
            self.llm_engine = SimpleNamespace(vllm_config=SimpleNamespace(cache_config=cache))

        def get_tokenizer(self):
            return list(range(500))

    monkeypatch.setattr(vllm, "LLM", Engine)
    monkeypatch.delenv(exactness_worker.SHARED_GPUS_ENGAGED, raising=False)
    out = tmp_path / "out.json"
    monkeypatch.setattr(sys, "argv", [
        "exactness_worker.py", "--model", str(model), "--pcp", "2", "--dcp", "2",
        "--variant", "chunked", "--cases", "preemption", "--tokenizer", "/tok",
        "--kv-pool-tokens", "6144", "--max-model-len", "4096", "--out", str(out)])
    exactness_worker.main()
    kwargs = engines[0]
    assert (kwargs["tokenizer"], kwargs["skip_tokenizer_init"], kwargs["max_model_len"]) == (
        "/tok", False, 4096)
    assert kwargs["disable_log_stats"] is False and "kv_cache_dtype" not in kwargs
    assert kwargs["kv_cache_memory_bytes"] == 6144 * 4 * 2 * 2 * 128 * 2
    assert ef.ENGINE_START_MARK in capsys.readouterr().out
    written = json.load(open(out))
    assert written["kv_capacity_tokens"] == ef.PREEMPT_CAPACITY_TOKENS
    assert [r["case"] for r in written["feature_results"]] == ["preemption"]
    assert written["feature_results"][0]["preemptions"] == 1
    assert "results" not in written and "scores" not in written  # no standard cases, no teacher
    assert written["step_counts"] is None and written["shared_gpus"] is None  # stock engine
    assert written["sampled_token_checks"] is None and written["memory"] is None


def test_feature_cases_the_baseline_ran_otherwise_are_not_judged():
    not_compared = []
    run = {"returncode": 0, "feature_results": [
        _result("burst", "burst", [_out([5, 6])]),
        {**_result("split_12000", "split", [_out([5, 6])]), "prompt_lens": [8152]},
        _result("json_schema", "json_schema", [_out([5, 6])])]}
    base = {"returncode": 0, "feature_results": [
        _result("burst", "burst", [_out([5, 6])]),
        {**_result("split_12000", "split", [_out([5, 9])]), "prompt_lens": [12000]}]}
    cases = efc._feature_cases("m", "pcp2 vs pcp1-v1, chunked", run, base, 0, not_compared)
    assert [(c["case"], c["passed"]) for c in cases] == [("burst", True)]
    assert [(c["case"], c["reason"]) for c in not_compared] == [
        ("split_12000", "the baseline ran prompts of [12000] tokens"),
        ("json_schema", "the baseline did not run this case")]


def test_fp8_runs_its_cases_at_pcp_and_is_refused_with_dcp():
    assert efc._refusal_pattern("m", "pcp2-fp8") is None
    assert efc._refusal_pattern("m", "pcp4-fp8") is None
    assert efc._refusal_pattern("m", "pcp2-dcp2-i1-fp8") == r"--kv-cache-dtype fp8"
    assert efc._refusal_pattern("mistral-swa512", "pcp2-fp8") is not None