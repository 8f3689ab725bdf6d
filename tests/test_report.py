"""benchmarks/report.py: the docs hold the tables, and README.md the figures, that the committed
result files give; the tables it makes."""
import glob
import json
import os
import shutil
import sys

ROOT = os.path.join(os.path.dirname(__file__), "..")
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
import report  # noqa: E402


def _doc(path: str) -> str:
    with open(os.path.join(ROOT, path)) as f:
        return f.read()


def test_serve_table_gives_the_speed_up_over_one_gpu_where_it_ran():
    row = {"p50_ttft_ms": 537.2, "p90_ttft_ms": 679.0, "p50_tpot_ms": 4.61,
           "p50_itl_ms": 3.72, "p99_itl_ms": 63.1}
    doc = {"rows": [{"config": "pcp2", "max_concurrency": c, **{k: c * v for k, v in row.items()}}
                    for c in (4, 16)] + [{"config": "pcp1", "max_concurrency": 4, **row}]}
    lines = [[c.strip() for c in line.strip("|").split("|")]
             for line in report.serve_table(doc).split("\n")]
    assert lines[0] == ["configuration", "concurrency", "P50 TTFT (ms)", "TTFT speed-up",
                        "P90 TTFT (ms)", "P50 TPOT (ms)", "P50 ITL (ms)", "P99 ITL (ms)"]
    assert lines[2] == ["`-pcp 2`", "4", "2149", "0.25", "2716", "18.4", "14.9", "252"]
    assert lines[3][:4] == ["plugin, 1 GPU", "4", "537", "1.00"]
    assert lines[4][:4] == ["`-pcp 2`", "16", "8595", "-"] and len(lines) == 5


def test_docs_tables_are_the_ones_the_result_files_give():
    tables = report.generated_tables(ROOT)
    assert set(tables) == {os.path.join("docs", "benchmarks.md"),
                           os.path.join("docs", "exactness.md")}
    assert sum(map(len, tables.values())) >= 9
    for path, generated in tables.items():
        text = _doc(path)
        for table in generated:
            assert table in text, (path, table.split("\n")[0])


def test_readme_quotes_the_result_files_figures():
    readme = _doc("README.md")
    figures = report.readme_figures(ROOT)
    assert len(figures) == 6 + 4 + 1
    for figure in figures:
        assert figure in readme, figure


def test_readme_figures_follow_the_files(tmp_path):
    """A result file re-made with other numbers changes the figures README must quote."""
    results = tmp_path / "benchmarks" / "results"
    results.mkdir(parents=True)
    for name in ("ttft.json", "projection.json", "gsm8k.json"):
        shutil.copy(os.path.join(ROOT, "benchmarks", "results", name), results / name)
    before = report.readme_figures(str(tmp_path))
    with open(results / "projection.json") as f:
        doc = json.load(f)
    doc["summary"][0]["projected_speedup"]["ragged"] = 9.876
    with open(results / "projection.json", "w") as f:
        json.dump(doc, f)
    after = report.readme_figures(str(tmp_path))
    assert after[6] == "9.88x" and after[:6] + after[7:] == before[:6] + before[7:]


def test_run_history_lists_every_result_file_with_its_revision_and_date():
    history = _doc(os.path.join("benchmarks", "results", "README.md")).split("\n")
    here = os.path.join(ROOT, "benchmarks", "results")
    checked = 0
    for d in (here, os.path.join(ROOT, "tests", "gpu", "results")):
        for path in glob.glob(os.path.join(d, "**", "*.json"), recursive=True):
            with open(path) as f:
                meta = json.load(f).get("meta")
            if meta is None:  # profiles' step summaries: profiles/README.md lists them
                continue
            rows = [line for line in history if f"]({os.path.relpath(path, here)})" in line]
            assert rows, f"{path} missing from benchmarks/results/README.md"
            assert meta["git_rev"][:7] in rows[0] and meta["date"] in rows[0], rows[0]
            checked += 1
    assert checked > 0


def _cells(table: str) -> list[list[str]]:
    return [[c.strip() for c in line.strip("|").split("|")] for line in table.split("\n")]


DECODE_POLICY = {"summary": [
    {"batch": 8, "context": 32768, "N": 2, "gpu_step_ms": {"replicate": 12.5, "shard": 7.25},
     "replicate_collectives_per_step": 0, "shard_collectives_per_step": 37,
     "replicate_wire_bytes_per_rank_per_step": 0,
     "shard_wire_bytes_per_rank_per_step": 36 * 4096 + 16384},
    {"batch": 1, "context": 5000, "N": 4, "gpu_step_ms": {"replicate": None, "shard": None},
     "replicate_collectives_per_step": 12, "shard_collectives_per_step": 49,
     "replicate_wire_bytes_per_rank_per_step": 512,
     "shard_wire_bytes_per_rank_per_step": 2048}]}


def test_decode_policy_table_sets_the_policies_side_by_side():
    lines = _cells(report.decode_policy_table(DECODE_POLICY))
    assert lines[0][:5] == ["case", "N", "replicate: GPU step (ms, 1 GPU)",
                            "shard: GPU step (ms, busiest rank)", "shard / replicate"]
    assert lines[2] == ["B = 8, 32K", "2", "12.5", "7.25", "0.58", "0 / 37", "0.0 / 160.0"]
    assert lines[3] == ["B = 1, 5000", "4", "-", "-", "-", "12 / 49", "0.5 / 2.0"]
    assert len(lines) == 4


def test_latency_files_give_ttft_and_itl_rows_for_the_timing_table():
    doc = {"runs": [
        {"config": "pcp1-stock", "input_len": 32768, "output_len": 1, "ttft_s": 0.6},
        {"config": "pcp1-stock", "input_len": 32768, "output_len": 129, "itl_ms": 5.0},
        {"config": "pcp1", "input_len": 32768, "output_len": 1, "ttft_s": 0.58},
        {"config": "pcp1", "input_len": 32768, "output_len": 129, "itl_ms": 5.5},
        {"config": "pcp1", "input_len": 4096, "output_len": 129, "itl_ms": 4.0},
        {"config": "pcp1", "input_len": 4096, "returncode": 1}]}
    ttft, itl = report.latency_timing(doc)
    assert ttft["rows"] == [{"config": "pcp1-stock", "prompt_len": 32768, "median_s": 0.6},
                            {"config": "pcp1", "prompt_len": 32768, "median_s": 0.58}]
    assert itl["rows"] == [{"config": "pcp1-stock", "batch": 1, "median_s": 0.005},
                           {"config": "pcp1", "batch": 1, "median_s": 0.0055}]
    lines = _cells(report.timing_table(ttft, itl, baseline="pcp1-stock"))
    assert lines[3] == ["plugin, 1 GPU", "580", "1.03", "5.50", "1.10"]


def test_the_decode_policy_table_joins_the_docs_with_its_file(tmp_path):
    """Without decode-policy.json the docs hold no such table; with it, docs/benchmarks.md."""
    results = tmp_path / "benchmarks" / "results"
    shutil.copytree(os.path.join(ROOT, "benchmarks", "results"), results,
                    ignore=shutil.ignore_patterns("run-*", "profiles", "decode-policy.json"))
    (tmp_path / "tests").mkdir()
    os.symlink(os.path.join(os.path.abspath(ROOT), "tests", "gpu"), tmp_path / "tests" / "gpu")
    bench_doc = os.path.join("docs", "benchmarks.md")
    before = report.generated_tables(str(tmp_path))[bench_doc]
    with open(results / "decode-policy.json", "w") as f:
        json.dump(DECODE_POLICY, f)
    after = report.generated_tables(str(tmp_path))[bench_doc]
    assert after == [*before, report.decode_policy_table(DECODE_POLICY)]
