"""Benchmark report: medians, the goal ratios and the result files."""
import json
import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "scripts"))
import bench_report  # noqa: E402

RAW = {"runs": [
    {"config": "pcp1", "returncode": 0, "rows": [
        {"kind": "ttft", "prompt_len": 32768, "ttft_s": [0.60, 0.58, 0.59]},
        {"kind": "itl", "context": 32768, "batch": 1, "itl_s": [0.010, 0.011, 0.012]}]},
    {"config": "pcp2", "returncode": 0, "rows": [
        {"kind": "ttft", "prompt_len": 32768, "ttft_s": [0.31, 0.30, 0.32]}]},
    {"config": "tp2", "returncode": 1, "log_tail": "boom"},
]}


def test_ratios_use_medians():
    rows = bench_report._ttft_rows(RAW)
    assert [r["median_s"] for r in rows] == [0.59, 0.31]
    assert bench_report.ratios(rows) == {"pcp1/pcp2@32768": round(0.59 / 0.31, 4),
                                         "pcp2/pcp1@32768": round(0.31 / 0.59, 4)}


def test_write_reports(tmp_path, monkeypatch):
    plotted = []
    monkeypatch.setattr(bench_report, "plot", lambda rows, path: plotted.append(path))
    summary = bench_report.write_reports(RAW, {"git_rev": "abc"}, str(tmp_path))
    assert summary["failed_configs"] == {"tp2": "boom"}
    assert summary["itl_ratios"] == {} and summary["kv_capacity_tokens"] == {}
    ttft = json.load(open(tmp_path / "ttft.json"))
    assert ttft["meta"] == {"git_rev": "abc"} and len(ttft["rows"]) == 2
    itl = json.load(open(tmp_path / "itl.json"))
    assert itl["rows"][0]["median_s"] == pytest.approx(0.011)
    assert plotted == [str(tmp_path / "ttft.png")]


def test_gsm8k_task_mirrors_lm_eval_and_takes_a_data_dir():
    yaml = pytest.importorskip("yaml")
    path = os.path.join(os.path.dirname(__file__), "..", "configs", "lm_eval", "gsm8k_local.yaml")
    task = yaml.safe_load(open(path))
    assert task["dataset_path"] == "json" and task["num_fewshot"] == 5
    assert task["dataset_kwargs"]["data_files"]["test"] == "@DATA_DIR@/test.jsonl"
    assert [f["name"] for f in task["filter_list"]] == ["strict-match", "flexible-extract"]


def test_serve_rows_read_vllm_bench_results(tmp_path):
    for conc, ttft in ((4, 120.5), (16, 410.0)):
        json.dump({"num_prompts": 32, "p99_ttft_ms": ttft, "mean_itl_ms": 9.5, "extra": 1},
                  open(tmp_path / f"pcp2-c{conc}.json", "w"))
    rows = bench_report.serve_rows([str(p) for p in tmp_path.glob("*.json")])
    assert rows == [
        {"config": "pcp2", "max_concurrency": 16, "num_prompts": 32, "p99_ttft_ms": 410.0,
         "mean_itl_ms": 9.5},
        {"config": "pcp2", "max_concurrency": 4, "num_prompts": 32, "p99_ttft_ms": 120.5,
         "mean_itl_ms": 9.5}]


def test_bench_model_covers_the_longest_prompt_and_its_tokens(tmp_path):
    import bench_pcp

    src = os.path.join(os.path.dirname(__file__), "..", "configs", "models",
                       "qwen2.5-3b-shape.json")
    need = bench_pcp._max_len("4096,131072")
    assert need > 131072
    folder = bench_pcp._model_dir(src, str(tmp_path / "m"), need)
    config = json.load(open(os.path.join(folder, "config.json")))
    assert config["max_position_embeddings"] == need
    assert config["num_hidden_layers"] == json.load(open(src))["num_hidden_layers"]


def test_gsm8k_rows_compare_every_config_with_pcp1(tmp_path):
    def result(name, strict, flexible):
        (tmp_path / f"gsm8k-{name}.json").write_text(json.dumps({
            "exact_match_strict": strict, "exact_match_flexible": flexible,
            "lm_eval_results": {"sample_len": 1319}}))
        return str(tmp_path / f"gsm8k-{name}.json")

    files = [result("pcp2", 0.1183, 0.1334), result("pcp1", 0.1205, 0.1342),
             result("pcp2-dcp2", 0.100, 0.130)]
    out = bench_report.gsm8k_rows(files)
    rows = {r["config"]: r for r in out["rows"]}
    assert rows["pcp1"] == {"config": "pcp1", "questions": 1319, "strict": 12.05,
                            "flexible": 13.42}
    assert rows["pcp2"]["delta_strict"] == -0.22 and rows["pcp2"]["within_tolerance"]
    assert rows["pcp2-dcp2"]["delta_strict"] == -2.05
    assert not rows["pcp2-dcp2"]["within_tolerance"]
    assert "delta_strict" not in bench_report.gsm8k_rows(files[:1])["rows"][0]


def test_bench_model_positions_cover_the_longest_prompt_and_its_decode(tmp_path):
    import bench_pcp

    out = bench_pcp.bench_model(str(tmp_path / "m"), "4096,200000")
    config = json.load(open(os.path.join(out, "config.json")))
    assert config["max_position_embeddings"] >= 200000 + bench_pcp.ITL_TOKENS
    assert config["num_hidden_layers"] == 36 and config["num_key_value_heads"] == 2


def test_report_records_the_chunk_size_of_a_chunked_run(tmp_path, monkeypatch):
    from types import SimpleNamespace

    import bench_pcp

    monkeypatch.setattr(bench_report, "plot", lambda rows, path: None)
    raw = {**RAW, "versions": {"gpu": "g"}, "eager": False, "chunk": 8192}
    path = tmp_path / "raw.json"
    path.write_text(json.dumps(raw))
    args = SimpleNamespace(raw=[str(path)], git_rev="abc", command="c", date=None,
                           out_dir=str(tmp_path), serve_dir=None, gsm8k_dir=None)
    bench_pcp.report(args)
    assert json.load(open(tmp_path / "ttft.json"))["meta"]["max_num_batched_tokens"] == 8192
    path.write_text(json.dumps({**raw, "chunk": 0}))
    bench_pcp.report(args)
    assert "max_num_batched_tokens" not in json.load(open(tmp_path / "ttft.json"))["meta"]


def test_report_writes_serve_json_alone_with_the_sittings_versions(tmp_path):
    """A sitting whose bench stage did not run still reports its serving results:
    versions from another raw file of that sitting, no ttft.json written; the out-dir
    (a new run-REV folder) is made."""
    from types import SimpleNamespace

    import bench_pcp

    serve = tmp_path / "serve"
    serve.mkdir()
    for config, conc, ttft in (("pcp2", 4, 537.0), ("pcp2-dcp2", 16, 1534.3)):
        (serve / f"{config}-c{conc}.json").write_text(json.dumps(
            {"num_prompts": 16, "p50_ttft_ms": ttft, "not_a_metric": 1}))
    versions = tmp_path / "raw-dcp.json"
    versions.write_text(json.dumps({"versions": {"gpu": "2 x H200", "vllm": "0.26.0"},
                                    "runs": []}))
    args = SimpleNamespace(raw=None, versions_from=str(versions), git_rev="abc",
                           command="c", date="2026-11-30", out_dir=str(tmp_path / "run-abc"),
                           serve_dir=str(serve), serve_command="s", serve_note="n",
                           gsm8k_dir=None)
    bench_pcp.report(args)
    out = json.load(open(tmp_path / "run-abc" / "serve.json"))
    assert out["meta"] == {"git_rev": "abc", "command": "s", "gpu": "2 x H200",
                           "vllm": "0.26.0", "date": "2026-11-30", "note": "n"}
    assert [(r["config"], r["max_concurrency"], r["p50_ttft_ms"]) for r in out["rows"]] == [
        ("pcp2", 4, 537.0), ("pcp2-dcp2", 16, 1534.3)]
    assert not (tmp_path / "run-abc" / "ttft.json").exists()
    with pytest.raises(SystemExit, match="--versions-from"):
        bench_pcp.report(SimpleNamespace(**{**vars(args), "versions_from": None}))


def test_profile_flags_reach_only_the_profiled_configs():
    from types import SimpleNamespace

    import bench_pcp

    args = SimpleNamespace(profile_len=16384, profile_decode=0, profile_mixed=True,
                           profile_stack=False, profile_configs="pcp2,pcp2-dcp2",
                           raw="/tmp/x/raw.json")
    flags = bench_pcp._profile_args(args, "pcp2-dcp2")
    assert flags[:2] == ["--profile-len", "16384"] and flags[-1] == "--profile-mixed"
    assert bench_pcp._profile_args(SimpleNamespace(**{**vars(args), "profile_stack": True}),
                                   "pcp2")[-1] == "--profile-stack"
    assert flags[flags.index("--profile-dir") + 1] == "/tmp/x/profile-pcp2-dcp2"
    assert bench_pcp._profile_args(args, "pcp1") == []
    assert bench_pcp._profile_args(SimpleNamespace(**{**vars(args), "profile_len": 0}),
                                   "pcp2") == []
    assert "--profile-mixed" not in bench_pcp._profile_args(
        SimpleNamespace(**{**vars(args), "profile_mixed": False}), "pcp2")


def test_timing_table_gives_ttft_speed_ups_and_itl_ratios_against_one_gpu():
    ttft = {"rows": bench_report._ttft_rows(RAW)}
    itl = {"rows": bench_report._itl_rows(RAW)
           + [{"config": "pcp2", "context": 32768, "batch": 1, "median_s": 0.0099}]}
    lines = bench_report.timing_table(ttft, itl).split("\n")
    assert lines[0] == "| ms | TTFT 32K (speed-up) | ITL batch 1 (x 1 GPU) |"
    assert lines[2] == "| plugin, 1 GPU | 590 | 11.0 |"
    assert lines[3] == f"| `-pcp 2` | 310 ({0.59 / 0.31:.2f}x) | 9.90 ({0.0099 / 0.011:.2f}x) |"
    assert len(lines) == 4  # tp2 failed: no row


def test_serve_table_puts_both_concurrencies_in_a_cell_and_names_each_rows_revision():
    row = {"p50_ttft_ms": 537.2, "p90_ttft_ms": 679.0, "p50_tpot_ms": 4.61,
           "p50_itl_ms": 3.72, "p99_itl_ms": 63.1}
    docs = [{"meta": {"git_rev": "87d2d5d3c1"},
             "rows": [{"config": "pcp2", "max_concurrency": 4, **row},
                      {"config": "pcp2", "max_concurrency": 16,
                       **{k: 2 * v for k, v in row.items()}}]},
            {"meta": {"git_rev": "fc2d1fc819"},
             "rows": [{"config": "tp2", "max_concurrency": 4, **row}]}]
    lines = bench_report.serve_table(docs).split("\n")
    assert lines[0].startswith("| ms, concurrency 4 / 16 | P50 TTFT |")
    assert lines[2] == "| `-pcp 2` | 537 / 1074 | 679 / 1358 | 4.6 / 9.2 | 3.7 / 7.4 | " \
                       "63.1 / 126 | 87d2d5d |"
    assert lines[3] == "| `-tp 2` | 537 / - | 679 / - | 4.6 / - | 3.7 / - | 63.1 / - | fc2d1fc |"


def test_readme_performance_tables_are_the_ones_the_result_files_give():
    root = os.path.join(os.path.dirname(__file__), "..")
    results = os.path.join(root, "benchmarks", "results")

    def load(name):
        with open(os.path.join(results, name)) as f:
            return json.load(f)

    with open(os.path.join(root, "README.md")) as f:
        readme = f.read()
    assert bench_report.timing_table(load("ttft.json")) in readme
    assert bench_report.timing_table(load("ttft-chunked.json"), load("itl.json")) in readme
    assert bench_report.serve_table([load("serve.json")]) in readme


def test_run_keeps_each_engines_log_beside_the_raw_file(tmp_path, monkeypatch):
    from types import SimpleNamespace

    import bench_pcp
    import gpu_runs

    seen = []
    monkeypatch.setattr(bench_pcp, "bench_model", lambda **kw: "/models/m")
    monkeypatch.setattr(gpu_runs, "versions", lambda: {"gpu": "none"})
    monkeypatch.setattr(gpu_runs, "run_worker", lambda cmd, out, key, entry, env, extra, log:
                        seen.append(log) or {**entry, "returncode": 0})
    args = SimpleNamespace(prompt_lens="4096", repeats=1, itl_repeats=1, chunk=0, eager=True,
                           parallel_one_gpu=False, profile_len=0, profile_decode=0,
                           profile_mixed=False, profile_stack=False, profile_configs="",
                           configs="pcp1,pcp2",
                           raw=str(tmp_path / "bench.json"))
    bench_pcp.run(args)
    assert seen == [str(tmp_path / "pcp1.log"), str(tmp_path / "pcp2.log")]
    assert [r["config"] for r in json.load(open(tmp_path / "bench.json"))["runs"]] == \
        ["pcp1", "pcp2"]
