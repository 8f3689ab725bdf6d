"""tests/engine/rows.py: the committed result files, as rows, assemble back into themselves."""
import json
import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [os.path.join(ROOT, "tests", "engine"), ROOT]
import rows  # noqa: E402
from benchmarks import report  # noqa: E402

FILES = ("exactness-pcp.json", "exactness-dcp.json", "exactness-features.json",
         "exactness-teacher.json", "memory.json")
TABLES = dict(zip(FILES, (report.exactness_table, report.exactness_table,
                         report.features_table, report.teacher_table)))


def _load(name):
    with open(os.path.join(ROOT, "tests", "gpu", "results", name)) as f:
        return json.load(f)


def _committed_rows() -> list[dict]:
    """A row per file's cases, per teacher-forced layout and per engine's memory."""
    pcp, dcp, features, teacher, memory = map(_load, FILES)

    def row(kind, key, doc={}, field="cases", **extra):
        return {"kind": kind, "key": key, "runs": [], "session": "s", "cases": doc.get(field, []),
                "not_compared": doc.get("not_compared", []), **extra}

    out = [row("greedy", ["pcp"], pcp, dcp=1), row("greedy", ["dcp"], dcp, dcp=2),
           row("floor", ["floor"], pcp, "noise_floor_cases", teacher=None),
           row("features", ["f"], features)]
    out += [row("memory", [r["model"], r["variant"], r["config"]], ranks=r["ranks"])
            for r in memory["runs"]]
    scored = [(model, group, label, stats) for model, m in teacher["summary"]["models"].items()
              for group in ("noise_floor", "configs") for label, stats in m[group].items()]
    for i, (model, group, label, stats) in enumerate(scored):
        config, base = label.split(" vs ")
        run = {"model": model, "config": config, "base": base, "pooled": stats, "cases": []}
        out.append(row("floor", [f"{i:03}"], teacher=run) if group == "noise_floor"
                   else row("teacher", [f"{i:03}"], **run))
    next(r for r in out if r["kind"] == "teacher")["cases"] = teacher["cases"]
    next(r for r in out if r.get("teacher"))["teacher"]["cases"] = teacher["noise_floor_cases"]
    return out


@pytest.mark.parametrize("name", FILES)
def test_rows_assemble_into_the_committed_summaries_and_tables(name):
    assembled, committed = rows.assemble(_committed_rows())[name][1], _load(name)
    assert set(assembled) == set(committed) - {"meta", "kv_capacity"}
    assert assembled["summary"] == committed["summary"]
    assert name not in TABLES or TABLES[name](assembled) == TABLES[name](committed)


def test_written_files_carry_meta_and_only_from_a_session_that_recorded(tmp_path):
    (tmp_path / "rows").mkdir()
    for i, row in enumerate(_committed_rows()):
        row["runs"] = [{"model": "m", "variant": "v", "config": f"c{i}", "shared_gpus": "1",
                        "git_rev": "aaa" if i % 2 else "bbb"}]
        (tmp_path / "rows" / f"{i}.json").write_text(json.dumps(row))
    assert rows.write_results(str(tmp_path), str(tmp_path / "out"), "another session") == []
    paths = rows.write_results(str(tmp_path), str(tmp_path / "out"), "s")
    assert sorted(os.path.basename(p) for p in paths) == sorted(FILES)
    meta = json.loads((tmp_path / "out" / "exactness-teacher.json").read_text())["meta"]
    assert {"git_rev", "command", "gpu", "vllm", "flashinfer", "torch", "date",
            "measure"} <= set(meta) and set(meta["runs_by_git_rev"]) == {"aaa", "bbb"}
    assert meta["ranks_shared_gpus"]["gpus"] == 1
