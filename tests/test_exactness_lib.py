"""The pass rule and case list of the GPU exactness checks."""
import json
import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "scripts"))
from exactness_lib import build_cases, compare_outputs  # noqa: E402
from kv_capacity import kv_capacity, kv_pool_in_log  # noqa: E402


def _out(tokens, tops):
    return {"token_ids": tokens,
            "logprobs": [{str(t): lp for t, lp in top.items()} for top in tops]}


def test_identical_outputs_pass_with_their_logprob_gap():
    a = _out([5, 6], [{5: -0.1, 9: -3.0}, {6: -0.2}])
    b = _out([5, 6], [{5: -0.15, 9: -2.9}, {6: -0.2}])
    res = compare_outputs(a, b)
    assert res == {"first_divergence": None, "max_abs_logprob_diff": 0.05, "passed": True}


def test_divergence_passes_only_inside_each_others_top_k():
    a = _out([5, 7], [{5: -0.1}, {7: -0.6, 8: -0.7}])
    b = _out([5, 8], [{5: -0.1}, {8: -0.6, 7: -0.7}])
    assert compare_outputs(a, b) == {"first_divergence": 1, "max_abs_logprob_diff": 0.0,
                                     "passed": True, "baseline_margin": 0.1}
    c = _out([5, 3], [{5: -0.1}, {3: -0.5, 8: -0.7}])  # 3 not in b's top-k
    assert not compare_outputs(c, b)["passed"]
    assert not compare_outputs(a, b, top_k=1)["passed"]


def test_cases_fit_the_model_length():
    cases = build_cases(8152, 49152)
    names = [c["case"] for c in cases]
    assert "len_16384" not in names and "len_4097" in names
    for case in cases:
        assert all(1 <= len(p) <= 8152 for p in case["prompts"])
        assert all(100 <= t < 49152 - 100 for p in case["prompts"] for t in p)
    prefix = next(c for c in cases if c["case"] == "prefix_hit")["prompts"]
    shared = len(prefix[0]) * 5 // 6
    assert prefix[1][:shared] == prefix[0][:shared]


def test_overlap_puts_one_gpu_configs_on_the_last_gpu(tmp_path, monkeypatch):
    import json
    from types import SimpleNamespace

    import check_exactness as ce

    seen = []
    monkeypatch.setattr(ce, "versions", lambda: {"gpu": "2 x test"})
    monkeypatch.setattr(ce, "_gpu_count", lambda: 2)
    monkeypatch.setattr(ce, "_run_one", lambda args, tmp, m, v, c, env: seen.append(
        (m, v, c, env.get("CUDA_VISIBLE_DEVICES"))) or {"model": m, "variant": v,
                                                         "config": c, "returncode": 0})
    raw = tmp_path / "raw.json"
    args = SimpleNamespace(models="a,b", variants="chunked", configs="pcp1,pcp2",
                           overlap=True, lanes=1, fail_fast=False, raw=str(raw),
                           cases="standard")
    ce.run(args)
    assert sorted(seen) == [("a", "chunked", "pcp1", "1"), ("a", "chunked", "pcp2", None),
                            ("b", "chunked", "pcp1", "1"), ("b", "chunked", "pcp2", None)]
    assert len(json.load(open(raw))["runs"]) == 4


def test_lanes_spread_one_gpu_jobs_over_gpus_and_keep_every_job():
    import check_exactness as ce

    jobs = [(m, "chunked", c) for m in "abc" for c in ("pcp1", "pcp2", "pcp2-dcp2-i8")]
    lanes = ce._lanes(jobs, overlap=True, lanes=2, gpus=2)
    assert sorted(j for lane, _ in lanes for j in lane) == sorted(jobs)
    single = [(lane, env) for lane, env in lanes if "CUDA_VISIBLE_DEVICES" in env]
    assert sorted(env["CUDA_VISIBLE_DEVICES"] for _, env in single) == ["0", "1"]
    assert all(j[2] == "pcp1" for lane, _ in single for j in lane)
    assert len(lanes) == 4
    assert ce._lanes(jobs, overlap=False, lanes=2, gpus=2) == [(jobs, {})]
    three = ce._lanes(jobs, overlap=True, lanes=3, gpus=2, one_gpu_lanes=1)
    assert [len(lane) for lane, _ in three] == [3, 2, 2, 2]


def test_kv_capacity_compares_dcp_with_pcp_alone():
    runs = {("m", "chunked", "pcp2"): {"kv_capacity_tokens": 1000},
            ("m", "chunked", "pcp2-dcp2-i8"): {"kv_capacity_tokens": 1990},
            ("m", "chunked", "pcp1"): {"kv_capacity_tokens": 1000}}
    assert kv_capacity(runs) == {"model": "m", "variant": "chunked", "pcp2_tokens": 1000,
                                 "pcp2_dcp2_tokens": 1990, "ratio": 1.99}
    assert kv_capacity({("m", "chunked", "pcp2"): {"kv_capacity_tokens": 5}}) == {}


def test_kv_capacity_prefers_the_benchmark_pools_and_lists_small_pool_runs():
    runs = {("m", "chunked", "pcp2"): {"kv_capacity_tokens": 1000},
            ("m", "chunked", "pcp2-dcp2-i8"): {"kv_capacity_tokens": 2000},
            ("m", "unchunked", "pcp2-dcp2-i8-smallpool"): {
                "kv_capacity_tokens": 40960,
                "results": [{"prompt_lens": [32768]}, {"prompt_lens": [3, 12000]}]},
            ("m", "unchunked", "pcp1-smallpool-failed"): {"kv_capacity_tokens": 1}}
    bench = [{"config": "pcp2", "kv_capacity_tokens": 300000},
             {"config": "pcp2-dcp2", "kv_capacity_tokens": 597000}, {"config": "tp2"}]
    got = kv_capacity(runs, bench)
    assert (got["pcp2_tokens"], got["pcp2_dcp2_tokens"], got["ratio"]) == (300000, 597000, 1.99)
    assert "gpu_memory_utilization" in got["source"]
    assert got["beyond_one_gpu"] == [{
        "model": "m", "variant": "unchunked", "config": "pcp2-dcp2-i8-smallpool",
        "per_rank_pool_tokens": 20480, "longest_prompt": 32768}]
    assert kv_capacity(runs)["pcp2_dcp2_tokens"] == 2000  # no bench: the fixed pools
    bench[0]["config"] = "pcp2-min8k"  # the same pool as pcp2 (only the split threshold differs)
    got = kv_capacity(runs, bench)
    assert got["pcp2_tokens"] == 300000 and "pcp2-min8k" in got["source"]
    bench[1]["config"] = "pcp2-dcp2-keys"  # the same pool as pcp2-dcp2 (only the exchange)
    got = kv_capacity(runs, bench)
    assert got["pcp2_dcp2_tokens"] == 597000 and "pcp2-dcp2-keys" in got["source"]


def test_kv_pool_formulas_count_every_dcp_rank_once():
    from types import SimpleNamespace

    import kernel_choice_lib
    from kv_capacity import kv_bytes_per_token_layer, per_rank_tokens, pool_tokens

    cache = SimpleNamespace(num_gpu_blocks=384, block_size=16)
    assert (pool_tokens(cache, 1), pool_tokens(cache, 2)) == (384 * 16, 384 * 16 * 2)
    assert per_rank_tokens(pool_tokens(cache, 2), 2) == 384 * 16
    assert kv_bytes_per_token_layer(2, 128) == 2 * 2 * 128 * 2
    assert kernel_choice_lib.kv_exchange_bytes(10) == 10 * kv_bytes_per_token_layer(2, 128)


def test_small_pool_config_holds_fewer_tokens_per_rank_than_the_longest_prompt():
    import check_exactness as ce
    from exactness_lib import SINGLE_LENGTHS
    from exactness_worker import kv_bytes_per_token

    assert ce.SMALL_POOL_TOKENS < max(SINGLE_LENGTHS) <= 2 * ce.SMALL_POOL_TOKENS - 1024
    assert ce.BASELINE["pcp2-dcp2-i8-smallpool"] == "pcp1-v1"
    assert ce.CONFIGS["pcp1-flash-attn"][:2] == ["--pcp", "1"]  # a one-GPU lane job
    assert ce.CONFIGS["pcp1-v1"][:2] == ["--pcp", "1"] and "--v1-runner" in ce.CONFIGS["pcp1-v1"]
    hf = {"num_hidden_layers": 4, "num_key_value_heads": 2, "hidden_size": 2048,
          "num_attention_heads": 16}
    assert kv_bytes_per_token(hf) == 4 * 2 * 2 * 128 * 2
    assert kv_bytes_per_token({**hf, "head_dim": 64}) == 4 * 2 * 2 * 64 * 2


def test_run_worker_prints_a_failures_first_exception(tmp_path, capsys):
    import sys

    from gpu_runs import run_worker

    script = "import sys; print('RuntimeError: root cause', file=sys.stderr); sys.exit(1)"
    entry = run_worker([sys.executable, "-c", script], str(tmp_path / "w.json"), "rows",
                       {"config": "x"})
    assert entry["errors"] == ["RuntimeError: root cause"]
    assert capsys.readouterr().out.strip().endswith("RuntimeError: root cause")


def test_run_worker_keeps_a_failed_runs_saved_part_and_never_a_stale_file(tmp_path):
    import json
    import sys

    from gpu_runs import run_worker

    out = tmp_path / "w.json"
    out.write_text(json.dumps({"rows": ["stale"]}))
    script = ("import json, sys; json.dump({'rows': [1], 'kv': 7}, open(sys.argv[1], 'w'));"
              " sys.exit(3)")
    entry = run_worker([sys.executable, "-c", script, str(out)], str(out), "rows",
                       {"config": "x"}, extra=("kv",))
    assert entry["returncode"] == 3 and entry["rows"] == [1] and entry["kv"] == 7
    assert "log_tail" in entry
    entry = run_worker([sys.executable, "-c", "import sys; sys.exit(1)"], str(out), "rows",
                       {"config": "x"})
    assert entry["returncode"] == 1 and "rows" not in entry


def test_run_worker_keeps_the_whole_output_of_a_successful_run_when_asked(tmp_path):
    import sys

    from gpu_runs import run_worker

    out, log = tmp_path / "w.json", tmp_path / "w.log"
    script = ("import json, sys; print('engine up in 12 s'); print('warn', file=sys.stderr);"
              " json.dump({'rows': [1]}, open(sys.argv[1], 'w'))")
    entry = run_worker([sys.executable, "-c", script, str(out)], str(out), "rows",
                       {"config": "x"}, log=str(log))
    assert entry["returncode"] == 0 and "log_tail" not in entry
    assert log.read_text() == "engine up in 12 s\nwarn\n"


def test_pcp_exactness_runs_split_every_prompt():
    """The default threshold keeps short prompts whole; the exactness runs must split them."""
    from types import SimpleNamespace

    from exactness_worker import _knobs

    assert _knobs(SimpleNamespace(pcp=2, dcp=2)) == {"pcp_min_split_tokens": 2}
    assert _knobs(SimpleNamespace(pcp=1, dcp=1)) == {}
    assert _knobs(SimpleNamespace(pcp=2, dcp=2, dcp_context_exchange="keys")) == {
        "pcp_min_split_tokens": 2, "pcp_dcp_context_exchange": "keys"}
    import check_exactness as ce

    assert ce.BASELINE["pcp2-dcp2-i8-keys"] == ce.BASELINE["pcp2-dcp2-i8-queries"] == "pcp1-v1"


def test_error_lines_keep_a_workers_root_cause_before_the_wrappers():
    from gpu_runs import error_lines

    log = "\n".join([
        "(Worker_TP0 pid=1) ERROR 11-30 12:35:50 [multiproc_executor.py:800] RuntimeError: "
        "vllm-pcp runs on the V1 model runner",
        "(Worker_TP1 pid=2) ERROR 11-30 12:35:50 [multiproc_executor.py:800] RuntimeError: "
        "vllm-pcp runs on the V1 model runner",
        "(EngineCore pid=3) ERROR 11-30 12:35:53 [core.py:1330] Exception: WorkerProc "
        "initialization failed",
        "    raise e from None", "torch.OutOfMemoryError: CUDA out of memory",
        "RuntimeError: Engine core initialization failed."])
    assert error_lines(log) == ["RuntimeError: vllm-pcp runs on the V1 model runner",
                                "Exception: WorkerProc initialization failed",
                                "torch.OutOfMemoryError: CUDA out of memory",
                                "RuntimeError: Engine core initialization failed."]
    assert error_lines(log, limit=1) == ["RuntimeError: vllm-pcp runs on the V1 model runner"]


def test_kv_capacity_from_serve_logs_comes_first(tmp_path):
    logs = []
    for name, tokens in (("pcp2", "3,492,672"), ("pcp2-dcp2", "6,938,944")):
        path = tmp_path / f"{name}-server.log"
        path.write_text(f"(EngineCore pid=1) INFO 11-30 [kv_cache_utils.py:2177] GPU KV cache "
                        f"size: {tokens} tokens\nMaximum concurrency for 16,576 tokens\n")
        logs.append(str(path))
    bench = [{"config": "pcp2", "kv_capacity_tokens": 1},
             {"config": "pcp2-dcp2", "kv_capacity_tokens": 2}]
    got = kv_capacity({}, bench, logs)
    assert (got["pcp2_tokens"], got["pcp2_dcp2_tokens"], got["ratio"]) == (
        3492672, 6938944, 1.9867)
    assert "vllm serve" in got["source"]
    (tmp_path / "empty.log").write_text("no pool here\n")
    with pytest.raises(ValueError, match="GPU KV cache size"):
        kv_pool_in_log(str(tmp_path / "empty.log"))


def test_text_prompts_are_real_text_windows_ending_in_a_question():
    from exactness_lib import text_prompt

    corpus, questions = list(range(1000, 1200)), [[1, 2, 3], [4, 5]]
    p = text_prompt(corpus, questions, 50, seed=3)
    assert len(p) == 50 and p[-2:] == [4, 5]
    start = p[0] - 1000
    assert p[:48] == corpus[start:start + 48]
    assert text_prompt(corpus, questions, 2, seed=0) == [2, 3]  # shorter than a question
    assert text_prompt(corpus, questions, 50, seed=3) == p  # the same on every engine
    assert text_prompt(corpus, questions, 50, seed=4) != p
    with pytest.raises(ValueError, match="longer corpus"):
        text_prompt(corpus, questions, 500, seed=0)


def test_text_model_runs_the_shared_model_on_gsm8k_text(tmp_path, monkeypatch):
    import json
    from types import SimpleNamespace

    import check_exactness as ce
    from exactness_worker import text_prompts

    rows = [{"question": f"q{i} x", "answer": f"a{i} y #### {i}"} for i in range(40)]
    data = tmp_path / "train.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))

    class WordTokenizer:  # one id per whitespace-separated word
        def encode(self, text, add_special_tokens):
            assert not add_special_tokens
            return [len(w) for w in text.split()]

    make = text_prompts(WordTokenizer(), str(data))
    cases = {c["case"]: c["prompts"] for c in build_cases(60, 1000, make)}
    assert [len(p) for p in cases["len_7"]] == [7]
    assert cases["len_7"][0][-2:] == [len("x"), len("Answer:")]  # ends in an open question
    assert max(len(p) for ps in cases.values() for p in ps) == 60
    seen = {}
    monkeypatch.setattr(ce, "run_worker", lambda cmd, *a, **k: seen.setdefault("cmd", cmd))
    args = SimpleNamespace(models_dir="/m", gpu_memory_utilization=0.1, max_tokens=8,
                           kv_cache_gib=0, text_data=str(data), cases="standard")
    ce._run_one(args, str(tmp_path), "smollm2-text", "chunked", "pcp1", {})
    cmd = seen["cmd"]
    assert cmd[cmd.index("--model") + 1] == ce.SHARED_MODELS["smollm2"]
    assert cmd[cmd.index("--text-prompts") + 1] == str(data)
    seen.clear()
    ce._run_one(args, str(tmp_path), "smollm2", "chunked", "pcp1", {})
    assert "--text-prompts" not in seen["cmd"]


def test_compare_counts_real_text_cases_apart(tmp_path):
    import json
    from types import SimpleNamespace

    import check_exactness as ce

    def run(model, config, tokens):
        out = _out(tokens, [{t: -0.1, **{o: -0.2 for o in (2, 99) if o != t}}
                            for t in tokens])
        return {"model": model, "variant": "chunked", "config": config, "returncode": 0,
                "results": [{"case": "len_7", "prompt_lens": [7], "outputs": [out]}]}

    raw = tmp_path / "raw.json"
    raw.write_text(json.dumps({"versions": {"gpu": "g"}, "runs": [
        run("m", "pcp1-v1", [1, 2]), run("m", "pcp2-dcp2-i8", [1, 99]),
        run("m-text", "pcp1-v1", [3, 4]), run("m-text", "pcp2-dcp2-i8", [3, 4])]}))
    out = tmp_path / "out.json"
    ce.compare(SimpleNamespace(raw=[str(raw)], git_rev="r", command="c", out=str(out),
                               note="", tokens=0, date="d", bench_raw="", serve_logs=None))
    summary = json.load(open(out))["summary"]
    assert (summary["cases"], summary["passed"], summary["no_divergence"]) == (2, 2, 1)
    assert summary["text_prompts"] == {"cases": 1, "passed": 1, "no_divergence": 1,
                                       "max_baseline_margin_at_divergence": None}


def test_noise_floor_compares_one_gpu_with_itself(tmp_path):
    import json
    from types import SimpleNamespace

    import check_exactness as ce

    def run(variant, config, tokens, model="m"):
        out = _out(tokens, [{t: -0.1, **{o: -0.2 for o in (2, 99) if o != t}}
                            for t in tokens])
        return {"model": model, "variant": variant, "config": config, "returncode": 0,
                "results": [{"case": "len_7", "prompt_lens": [7], "outputs": [out]}]}

    raw = tmp_path / "raw.json"
    scoring_only = {"model": "m", "variant": "chunked", "config": "pcp2", "returncode": 0,
                    "scores": []}  # --cases none --teacher FILE: no "results", not compared
    raw.write_text(json.dumps({"versions": {}, "runs": [
        run("chunked", "pcp1", [1, 2]), run("chunked", "pcp1-graphs", [1, 99]),
        run("chunked", "pcp1-v1", [1, 2]),
        run("unchunked", "pcp1", [1, 2]), run("chunked", "pcp2-dcp2-i8", [1, 2]),
        scoring_only]}))
    out = tmp_path / "out.json"
    ce.compare(SimpleNamespace(raw=[str(raw)], git_rev="r", command="c", out=str(out),
                               note="", tokens=0, date="d", bench_raw="", serve_logs=None))
    result = json.load(open(out))
    assert [c["config"] for c in result["noise_floor_cases"]] == [
        "pcp1 vs pcp1-v1, chunked", "pcp1-graphs vs pcp1, chunked",
        "pcp1, chunked vs unchunked"]
    assert result["summary"]["noise_floor"]["no_divergence"] == 2
    assert (result["summary"]["cases"], result["summary"]["no_divergence"]) == (1, 1)
    assert [c["config"] for c in result["cases"]] == ["pcp2-dcp2-i8 vs pcp1-v1, chunked"]


def test_run_passes_the_case_groups_to_every_worker_and_self_teacher_to_chunked_ones(
        tmp_path, monkeypatch):
    import json

    import check_exactness as ce
    from gpu_runs import shared_gpu

    seen = {}

    def fake_worker(cmd, out, key, entry, env, extra=()):
        seen[entry["variant"]] = (cmd, env)
        return {**entry, "returncode": 0}

    monkeypatch.setattr(ce, "run_worker", fake_worker)
    monkeypatch.setattr(ce, "versions", lambda: {"gpu": "2 x test"})
    monkeypatch.setattr(ce, "_gpu_count", lambda: 2)
    raw = tmp_path / "raw.json"
    monkeypatch.setattr(sys, "argv", [
        "check_exactness.py", "run", "--models", "smollm2", "--variants", "chunked,unchunked",
        "--configs", "pcp2", "--raw", str(raw), "--cases", "standard,features",
        "--teacher", "self"])
    ce.main()
    assert sorted(seen) == ["chunked", "unchunked"]
    chunked, env = seen["chunked"]
    assert chunked.count("--cases") == 1
    assert chunked[chunked.index("--cases") + 1] == "standard,features"
    assert chunked.count("--teacher") == 1 and chunked[chunked.index("--teacher") + 1] == "self"
    assert "--teacher-model" not in chunked  # its own outputs: no model to look up
    assert shared_gpu.MODE_VAR in env  # gpu_runs.check_env: the shared-GPU harness
    unchunked, _ = seen["unchunked"]
    assert unchunked[unchunked.index("--cases") + 1] == "standard,features"
    assert "--teacher" not in unchunked and "--teacher-model" not in unchunked
    assert len(json.load(open(raw))["runs"]) == 2


@pytest.mark.parametrize("ranks", [4, 8])
def test_a_case_leaves_ranks_without_tokens_in_a_chunked_step(ranks):
    """The exactness cases hold a step whose split chunk is shorter than 2N tokens, so the
    engine checks see ranks without tokens under -dcp (their step counts say how often;
    with a whole cache on every rank such a chunk is computed whole:
    ``partition.min_chunk_tokens``)."""
    from exactness_worker import VARIANTS

    from vllm_pcp.pcp.partition import build_pcp_metadata_all_ranks

    chunk = VARIANTS["chunked"]
    lengths = [len(p) for c in build_cases(33000, 32000) if c["kind"] == "batch"
               for p in c["prompts"]]
    tails = [(n - n % chunk, n % chunk) for n in lengths
             if n > chunk and 2 <= n % chunk < 2 * ranks]
    assert tails, "no prompt ends in a chunk shorter than 2N tokens"
    plans = [build_pcp_metadata_all_ranks([c], [t], ranks, min_split_tokens=2,
                                          prefill_lens=[c + t])[0] for c, t in tails]
    assert all(p.num_split_requests == 1 for p in plans)
    assert any(min(p.num_tokens_per_rank) == 0 for p in plans)


def test_the_worker_refuses_a_model_length_past_the_models_positions(tmp_path, monkeypatch):
    import sys as _sys

    import exactness_worker

    (tmp_path / "config.json").write_text(json.dumps({"max_position_embeddings": 8192}))
    monkeypatch.setattr(_sys, "argv", ["w", "--model", str(tmp_path), "--max-model-len",
                                       "32832", "--out", str(tmp_path / "o.json")])
    with pytest.raises(SystemExit, match="past the model's 8192 positions"):
        exactness_worker.main()


def test_result_files_can_take_some_models_runs_only(tmp_path):
    import check_exactness as ce

    raw = tmp_path / "raw.json"
    raw.write_text(json.dumps({"versions": {"gpu": "g"}, "runs": [
        {"model": m, "variant": "chunked", "config": "pcp2", "returncode": 0}
        for m in ("a", "b", "c")]}))
    assert sorted(k[0] for k in ce._load_runs([str(raw)])[0]) == ["a", "b", "c"]
    assert sorted(k[0] for k in ce._load_runs([str(raw)], "a,c")[0]) == ["a", "c"]


def test_cases_the_baseline_ran_otherwise_are_listed_apart_not_judged(tmp_path):
    """An earlier run's baseline may lack a case added since, or have run it at another
    max_model_len (other prompts): such cases are neither passed nor failed."""
    import json
    from types import SimpleNamespace

    import check_exactness as ce

    def result(case, lens, tokens):
        out = _out(tokens, [{t: -0.1} for t in tokens])
        return {"case": case, "prompt_lens": lens, "outputs": [out] * len(lens)}

    base = {"model": "m", "variant": "chunked", "config": "pcp1-v1", "returncode": 0,
            "results": [result("len_7", [7], [1, 2]), result("mixed", [3, 12000], [1, 2])]}
    run = {**base, "config": "pcp2", "results": [
        result("len_7", [7], [1, 2]), result("mixed", [3, 8152], [5, 6]),
        result("len_4099", [4099], [1, 2])]}
    raw = tmp_path / "raw.json"
    raw.write_text(json.dumps({"versions": {}, "runs": [base, run]}))
    out = tmp_path / "out.json"
    ce.compare(SimpleNamespace(raw=[str(raw)], git_rev="r", command="c", out=str(out),
                               note="", tokens=0, date="d", bench_raw="", serve_logs=None))
    got = json.load(open(out))
    assert [(c["case"], c["passed"]) for c in got["cases"]] == [("len_7", True)]
    assert got["summary"]["not_compared"] == 2
    reasons = {c["case"]: c["reason"] for c in got["not_compared"]}
    assert reasons == {"mixed": "the baseline ran prompts of [3, 12000] tokens",
                       "len_4099": "the baseline did not run this case"}


def test_meta_names_the_revision_of_each_run_when_raw_files_differ(tmp_path):
    import json
    from types import SimpleNamespace

    import check_exactness as ce

    def raw(name, rev, config):
        path = tmp_path / name
        out = _out([1], [{1: -0.1}])
        path.write_text(json.dumps({"versions": {}, "git_rev": rev, "runs": [
            {"model": "m", "variant": "chunked", "config": config, "returncode": 0,
             "results": [{"case": "len_7", "prompt_lens": [7], "outputs": [out]}]}]}))
        return str(path)

    out = tmp_path / "out.json"
    args = SimpleNamespace(raw=[raw("a.json", "aaa", "pcp1-v1"), raw("b.json", "bbb", "pcp2")],
                           git_rev="bbb", command="c", out=str(out), note="", tokens=0,
                           date="d", bench_raw="", serve_logs=None)
    ce.compare(args)
    meta = json.load(open(out))["meta"]
    assert meta["runs_by_git_rev"] == {"aaa": ["m:chunked:pcp1-v1"], "bbb": ["m:chunked:pcp2"]}
    args.raw = [raw("c.json", "bbb", "pcp1-v1"), args.raw[1]]
    ce.compare(args)
    assert "runs_by_git_rev" not in json.load(open(out))["meta"]


def test_run_worker_writes_the_output_to_its_log_while_the_worker_runs(tmp_path):
    """A long engine's per-case lines are readable before it ends (default log: out.log)."""
    import sys
    import threading
    import time

    from gpu_runs import run_worker

    out, release = tmp_path / "w.json", tmp_path / "release"
    script = ("import json, os, sys, time; print('case len_1: 3.0 s', flush=True)\n"
              "while not os.path.exists(sys.argv[2]): time.sleep(0.05)\n"
              "json.dump({'rows': [1]}, open(sys.argv[1], 'w'))")
    done = {}
    worker = threading.Thread(target=lambda: done.update(run_worker(
        [sys.executable, "-c", script, str(out), str(release)], str(out), "rows",
        {"config": "x"})))
    worker.start()
    log = tmp_path / "w.json.log"
    deadline = time.monotonic() + 60
    while "case len_1" not in (log.read_text() if log.exists() else ""):
        assert time.monotonic() < deadline and worker.is_alive()
        time.sleep(0.05)
    release.touch()
    worker.join(60)
    assert done["returncode"] == 0 and done["rows"] == [1]
