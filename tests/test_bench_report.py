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


def test_report_writes_serve_json_alone_with_the_runs_versions(tmp_path):
    """A GPU run whose bench stage did not run still reports its serving results:
    versions from another raw file of that run, no ttft.json written; the out-dir
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


def _cells(line: str) -> list[str]:
    """The cells of one markdown table line, stripped of tabulate's padding."""
    return [cell.strip() for cell in line.strip().strip("|").split("|")]


def test_timing_table_gives_ttft_speed_ups_and_itl_ratios_against_one_gpu():
    ttft = {"rows": bench_report._ttft_rows(RAW)}
    itl = {"rows": bench_report._itl_rows(RAW)
           + [{"config": "pcp2", "context": 32768, "batch": 1, "median_s": 0.0099}]}
    lines = bench_report.timing_table(ttft, itl).split("\n")
    assert _cells(lines[0]) == ["configuration", "TTFT 32K (ms)", "32K speed-up",
                                "ITL batch 1 (ms)", "batch 1 / 1 GPU"]
    assert set(lines[1]) <= set("|-")  # GitHub's header rule
    assert _cells(lines[2]) == ["plugin, 1 GPU", "590", "1.00", "11.0", "1.00"]
    assert _cells(lines[3]) == ["`-pcp 2`", "310", f"{0.59 / 0.31:.2f}", "9.90",
                                f"{0.0099 / 0.011:.2f}"]
    assert len(lines) == 4  # tp2 failed: no row
    assert len({len(line) for line in lines}) == 1  # tabulate pads the columns


def test_serve_table_gives_a_row_per_concurrency_and_names_each_rows_revision():
    row = {"p50_ttft_ms": 537.2, "p90_ttft_ms": 679.0, "p50_tpot_ms": 4.61,
           "p50_itl_ms": 3.72, "p99_itl_ms": 63.1}
    docs = [{"meta": {"git_rev": "87d2d5d3c1"},
             "rows": [{"config": "pcp2", "max_concurrency": 4, **row},
                      {"config": "pcp2", "max_concurrency": 16,
                       **{k: 2 * v for k, v in row.items()}}]},
            {"meta": {"git_rev": "fc2d1fc819"},
             "rows": [{"config": "tp2", "max_concurrency": 4, **row}]}]
    lines = bench_report.serve_table(docs, revision=True).split("\n")
    assert _cells(lines[0])[:4] == ["configuration", "concurrency", "P50 TTFT (ms)",
                                    "P90 TTFT (ms)"]
    assert _cells(lines[0])[-1] == "revision"
    assert _cells(lines[2]) == ["`-pcp 2`", "4", "537", "679", "4.61", "3.72", "63.1",
                                "87d2d5d"]
    assert _cells(lines[3]) == ["`-tp 2`", "4", "537", "679", "4.61", "3.72", "63.1",
                                "fc2d1fc"]
    # tp2 ran at concurrency 4 only: no concurrency-16 row for it
    assert _cells(lines[4]) == ["`-pcp 2`", "16", "1074", "1358", "9.22", "7.44", "126",
                                "87d2d5d"]
    assert len(lines) == 5
    # without revision= no revision column; with the baseline's rows (default pcp1, here
    # none) its TTFT speed-up after P50 TTFT
    headline = bench_report.serve_table(docs[:1], ("p50_ttft_ms", "p50_tpot_ms"),
                                        baseline="pcp2").split("\n")
    assert _cells(headline[0]) == ["configuration", "concurrency", "P50 TTFT (ms)",
                                   "TTFT speed-up", "P50 TPOT (ms)"]
    assert _cells(headline[3]) == ["`-pcp 2`", "16", "1074", "1.00", "9.22"]


def test_gsm8k_table_gives_points_and_distances_from_one_gpu():
    doc = {"rows": [{"config": "pcp2-dcp2", "strict": 12.13, "flexible": 13.95,
                     "delta_strict": -0.23, "delta_flexible": -0.08},
                    {"config": "pcp1", "strict": 12.36, "flexible": 14.03}]}
    lines = bench_report.gsm8k_table(doc).split("\n")
    assert _cells(lines[2]) == ["plugin, 1 GPU", "12.36", "14.03", "+0.00", "+0.00"]
    assert _cells(lines[3]) == ["`-pcp 2 -dcp 2`", "12.13", "13.95", "-0.23", "-0.08"]


def test_exactness_table_counts_each_comparison_and_its_noise_floor():
    def case(config, model, first, margin=None):
        return {"config": config, "model": model, "passed": True, "first_divergence": first,
                **({} if margin is None else {"max_baseline_margin": margin})}

    doc = {"cases": [case("pcp2 vs pcp1", "a", None), case("pcp2 vs pcp1", "b", 11, 0.0625)],
           "noise_floor_cases": [case("pcp1-graphs vs pcp1", "a", None)]}
    lines = bench_report.exactness_table(doc).split("\n")
    assert _cells(lines[0]) == ["comparison", "model", "kind", "cases", "pass",
                                "no divergence", "widest margin"]
    assert _cells(lines[2]) == ["pcp2 vs pcp1", "a", "plugin", "1", "1", "1", "-"]
    assert _cells(lines[3]) == ["pcp2 vs pcp1", "b", "plugin", "1", "1", "0", "0.0625"]
    assert _cells(lines[4]) == ["pcp1-graphs vs pcp1", "a", "noise floor", "1", "1", "1", "-"]


ROOT = os.path.join(os.path.dirname(__file__), "..")


def _results(name):
    with open(os.path.join(ROOT, "benchmarks", "results", name)) as f:
        return json.load(f)


def _doc(path):
    with open(os.path.join(ROOT, path)) as f:
        return f.read()


def test_readme_and_docs_tables_are_the_ones_the_result_files_give():
    readme, bench_doc = _doc("README.md"), _doc(os.path.join("docs", "benchmarks.md"))
    ttft, serve, gsm8k = _results("ttft.json"), _results("serve.json"), _results("gsm8k.json")
    # README: the headline tables
    assert bench_report.timing_table(ttft) in readme
    assert bench_report.serve_table([serve], ("p50_ttft_ms", "p50_tpot_ms")) in readme
    assert bench_report.gsm8k_table(gsm8k) in readme
    # docs/benchmarks.md: those and the chunked-prefill + ITL table, all serving percentiles
    assert bench_report.timing_table(ttft) in bench_doc
    assert bench_report.timing_table(_results("ttft-chunked.json"),
                                     _results("itl.json")) in bench_doc
    assert bench_report.serve_table([serve]) in bench_doc  # as bench_pcp.py table --serve
    assert bench_report.gsm8k_table(gsm8k) in bench_doc
    # and every table generated_tables (python scripts/bench_report.py) prints
    for path, tables in bench_report.generated_tables(ROOT).items():
        text = _doc(path)
        for table in tables:
            assert table in text, (path, table.split("\n")[0])


def test_run_history_lists_every_result_file_with_its_revision_and_date():
    """benchmarks/results/README.md: a row per result file (those with a ``meta``), linking
    it and naming the revision and date of its meta."""
    import glob

    history = _doc(os.path.join("benchmarks", "results", "README.md")).split("\n")
    here = os.path.join(ROOT, "benchmarks", "results")
    files = [p for d in (here, os.path.join(ROOT, "tests", "gpu", "results"))
             for p in glob.glob(os.path.join(d, "**", "*.json"), recursive=True)]
    checked = 0
    for path in files:
        with open(path) as f:
            meta = json.load(f).get("meta")
        if meta is None:  # profiles' step summaries: profiles/README.md lists them
            continue
        link = f"]({os.path.relpath(path, here)})"
        rows = [line for line in history if link in line]
        assert rows, f"{link} missing from benchmarks/results/README.md"
        assert meta["git_rev"][:7] in rows[0] and meta["date"] in rows[0], rows[0]
        checked += 1
    assert checked >= 30


def test_readme_exactness_line_gives_the_result_files_counts():
    readme = _doc("README.md")
    results = os.path.join(ROOT, "tests", "gpu", "results")
    for name in bench_report.EXACTNESS_FILES:
        with open(os.path.join(results, name)) as f:
            summary = json.load(f)["summary"]
        assert f"{summary['passed']} of {summary['cases']}" in readme, name


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
