"""benchmarks/report.py: README/docs hold the tables the committed result files give."""
import glob
import json
import os
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


def test_readme_and_docs_tables_are_the_ones_the_result_files_give():
    tables = report.generated_tables(ROOT)
    assert len(tables) == 3 and sum(map(len, tables.values())) == 12
    for path, generated in tables.items():
        text = _doc(path)
        for table in generated:
            assert table in text, (path, table.split("\n")[0])


def test_readme_exactness_line_gives_the_result_files_counts():
    readme = _doc("README.md")
    for name in report.EXACTNESS_FILES:
        with open(os.path.join(ROOT, "tests", "gpu", "results", name)) as f:
            summary = json.load(f)["summary"]
        assert f"{summary['passed']} of {summary['cases']}" in readme, name


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
    assert checked >= 30
