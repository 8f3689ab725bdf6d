"""tests/engine/rows.py: the committed result files, as rows, assemble back into themselves."""
import json
import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [os.path.join(ROOT, "tests", "engine"), ROOT]
import rows  # noqa: E402
from benchmarks import report  # noqa: E402

RESULTS = os.path.join(ROOT, "tests", "gpu", "results")
FILES = tuple(n for n in rows.FILES if os.path.exists(os.path.join(RESULTS, n)))  # committed
TABLES = dict(zip(FILES, (report.exactness_table, report.exactness_table,
                         report.features_table, report.teacher_table)))


def _load(name, results_dir=RESULTS):
    with open(os.path.join(results_dir, name)) as f:
        return json.load(f)


def _committed_rows() -> list[dict]:
    return rows.committed_rows(RESULTS)


def _goals_of(teacher_file: dict) -> dict[str, float]:
    """The teacher-forced goals a committed file was judged by: each model's factors, and
    the layouts it names as not measured."""
    summary = teacher_file["summary"]
    goals = dict.fromkeys(summary["not_measured"], 1.0)
    for model in summary["models"].values():
        goals.update(model["goal"]["factors"])
    return goals


@pytest.mark.parametrize("name", FILES)
def test_rows_assemble_into_the_committed_summaries_and_tables(name, monkeypatch):
    """Cut into rows and assembled again, each committed file gives its own summary and
    tables (under the teacher-forced goals it was judged by)."""
    if name == "exactness-teacher.json":
        monkeypatch.setattr(rows.judge, "TEACHER_GOALS", _goals_of(_load(name)))
    assembled, committed = rows.assemble(_committed_rows())[name][1], _load(name)
    assert set(assembled) == set(committed) - {"meta", "kv_capacity"}
    assert assembled["summary"] == committed["summary"]
    assert name not in TABLES or TABLES[name](assembled) == TABLES[name](committed)


@pytest.mark.parametrize("name", [n for n in FILES if "runs_by_git_rev" in _load(n)["meta"]])
def test_rows_keep_the_revisions_of_the_committed_runs(name):
    """An engine a file lists under two revisions (a baseline its rows took from two runs)
    stays under both once the file is cut into rows and merged again (a floor that several
    files hold may gain the revisions the others list)."""
    used = rows.assemble(_committed_rows())[name][0]
    merged = rows.meta_extra(used)["runs_by_git_rev"]
    for rev, keys in _load(name)["meta"]["runs_by_git_rev"].items():
        assert set(keys) <= set(merged.get(rev, ())), rev


@pytest.mark.parametrize("name", FILES)
def test_rows_keep_the_commands_and_gpus_of_the_committed_file(name):
    """Cut into rows and merged again, a file names every command it named and the GPU of
    each revision it ran at."""
    meta, used = _load(name)["meta"], rows.assemble(_committed_rows())[name][0]
    merged = rows.meta_extra(used)
    assert set(meta.get("commands") or []) <= set(merged.get("commands") or [meta["command"]])
    for rev, gpu in (meta.get("gpus_by_git_rev") or {}).items():
        assert merged["gpus_by_git_rev"][rev] == gpu, rev


def test_an_engine_under_two_revisions_keeps_both(tmp_path):
    doc = {"meta": {"git_rev": "ccc", "runs_by_git_rev": {
        "aaa": ["m:chunked:pcp1", "m:chunked:pcp2"], "bbb": ["m:chunked:pcp1",
                                                                 "m:chunked:pcp4"]}},
        "cases": [{"model": "m", "config": f"{c} vs pcp1, chunked", "passed": True}
                  for c in ("pcp2", "pcp4")]}
    (tmp_path / "exactness-pcp.json").write_text(json.dumps(doc))
    cut = rows.committed_rows(str(tmp_path))
    assert rows.meta_extra(cut)["runs_by_git_rev"] == doc["meta"]["runs_by_git_rev"]


def test_written_files_carry_meta_and_only_from_a_session_that_recorded(tmp_path):
    (tmp_path / "rows").mkdir()
    for i, row in enumerate(_committed_rows()):
        row["runs"] = [{"model": "m", "variant": "v", "config": f"c{i}", "shared_gpus": "1",
                        "git_rev": "aaa" if i % 2 else "bbb"}]
        row["session"] = "s"
        (tmp_path / "rows" / f"{i}.json").write_text(json.dumps(row))
    assert rows.write_results(str(tmp_path), str(tmp_path / "out"), "another session") == []
    paths = rows.write_results(str(tmp_path), str(tmp_path / "out"), "s")
    assert sorted(os.path.basename(p) for p in paths) == sorted(FILES)
    meta = json.loads((tmp_path / "out" / "exactness-teacher.json").read_text())["meta"]
    assert {"git_rev", "command", "gpu", "vllm", "flashinfer", "torch", "date",
            "measure"} <= set(meta) and set(meta["runs_by_git_rev"]) == {"aaa", "bbb"}
    assert meta["ranks_shared_gpus"]["gpus"] == 1


def test_a_session_replaces_its_engines_rows_and_keeps_the_others(tmp_path):
    """A slice run into a folder of committed files of the same vLLM: its engines' cases
    replace theirs, every other engine's stay, and a file it holds no row of is left as
    it was."""
    results_dir = tmp_path / "results"
    results_dir.mkdir()
    for name in FILES:
        (results_dir / name).write_text(json.dumps(_load(name)))
    committed = _load("exactness-pcp.json")
    label, model = next((c["config"], c["model"]) for c in committed["cases"]
                        if c["config"].startswith("pcp2 vs ") and c["config"].endswith("chunked"))
    key = [model, "chunked", "pcp2"]
    base = label.split(" vs ")[1].split(",")[0]  # the baseline the committed run had
    old = [c for c in committed["cases"] if c["config"] == label and c["model"] == key[0]]
    case = {**old[0], "passed": False, "first_divergence": 3}
    row = {"kind": "greedy", "key": key, "session": "new", "command": "pytest slice", "dcp": 1,
           "cases": [case], "not_compared": [], "runs": [
               {"model": key[0], "variant": "chunked", "config": c, "git_rev": "ccc",
                "shared_gpus": "1"} for c in ("pcp2", base)]}
    (tmp_path / "rows").mkdir()
    (tmp_path / "rows" / "r.json").write_text(json.dumps(row))
    paths = rows.write_results(str(tmp_path), str(results_dir), "new",
                               host={"gpu": "g", "vllm": committed["meta"]["vllm"]})
    assert [os.path.basename(p) for p in paths] == ["exactness-pcp.json"]
    merged = _load("exactness-pcp.json", results_dir)
    assert [c for c in merged["cases"] if c["config"] == case["config"]
            and c["model"] == key[0]] == [case]
    assert len(merged["cases"]) == len(committed["cases"]) - len(old) + 1
    assert merged["summary"]["passed"] == (committed["summary"]["passed"]
                                           - sum(c["passed"] for c in old))
    assert merged["meta"]["runs_by_git_rev"]["ccc"] == sorted(
        f"{key[0]}:chunked:{c}" for c in ("pcp2", base))
    assert "pytest slice" in merged["meta"]["commands"]
    gpus = merged["meta"]["gpus_by_git_rev"]
    assert gpus["ccc"] == "g" and "g (ccc)" in merged["meta"]["gpu"]
    assert {rev: gpu for rev, gpu in gpus.items() if rev != "ccc"} == {
        rev: gpu for rev, gpu in committed["meta"]["gpus_by_git_rev"].items()
        if rev in merged["meta"]["runs_by_git_rev"]}
    assert merged["meta"].get("note") == committed["meta"].get("note")
    assert _load("memory.json", results_dir) == _load("memory.json")


def test_a_merged_file_names_the_gpu_of_each_revision_and_keeps_its_note(tmp_path,
                                                                         monkeypatch):
    """Rows of two sessions on two GPUs: the file names each GPU with its revisions (in
    ``gpu``, and ``gpus_by_git_rev``), a third session on either keeps both, and a ``note``
    written for the file stays unless the merge gives one of its own."""
    key = ["qwen2.5-3b-shape", "chunked", "pcp2"]
    case = {"model": key[0], "config": "pcp2 vs pcp1, chunked", "case": "len_7",
            "prompt_lens": [7], "first_divergence": None, "max_abs_logprob_diff": 0.0,
            "passed": True}

    def run_session(session, rev, gpu, config, **meta_fields):
        monkeypatch.setenv("GIT_REV", rev)  # as on the GPU host: the revision that ran
        work = tmp_path / session
        (work / "rows").mkdir(parents=True)
        row = {"kind": "greedy", "key": [*key[:2], config], "session": session,
               "command": session, "dcp": 1, "not_compared": [],
               "cases": [{**case, "config": f"{config} vs pcp1, chunked"}],
               "runs": [{"model": key[0], "variant": "chunked", "config": c, "git_rev": rev}
                        for c in (config, "pcp1")]}
        (work / "rows" / "r.json").write_text(json.dumps(row))
        rows.write_results(str(work), str(tmp_path / "out"), session,
                           host={"gpu": gpu, "vllm": "v"}, **meta_fields)
        return _load("exactness-pcp.json", tmp_path / "out")["meta"]

    first = run_session("a", "aaa1111", "1 x H200", "pcp2", note="about pcp2")
    assert first["gpu"] == "1 x H200" and "gpus_by_git_rev" not in first
    second = run_session("b", "bbb2222", "1 x H100", "pcp4")
    assert second["gpus_by_git_rev"] == {"aaa1111": "1 x H200", "bbb2222": "1 x H100"}
    assert second["gpu"] == "1 x H100 (bbb2222), 1 x H200 (aaa1111)"
    assert second["note"] == "about pcp2"
    third = run_session("c", "ccc3333", "1 x H100", "pcp8", note="about pcp8")
    assert third["gpus_by_git_rev"] == {"aaa1111": "1 x H200", "bbb2222": "1 x H100",
                                        "ccc3333": "1 x H100"}
    assert third["gpu"] == "1 x H100 (bbb2222, ccc3333), 1 x H200 (aaa1111)"
    assert third["note"] == "about pcp8"


def test_files_of_another_vllm_are_replaced_whole_and_meta_names_the_installed_one(tmp_path):
    """A session on this host's vLLM keeps no row of a committed file that ran on another
    (its meta's ``vllm``): the file it writes holds this session's engines alone, its meta
    the vLLM read at run time (``vllm.__version__``) and the GPU the ranks shared."""
    import vllm

    results_dir, key = tmp_path / "results", ["qwen2.5-3b-shape", "chunked", "pcp2"]
    results_dir.mkdir()
    committed = _load("exactness-pcp.json")
    committed["meta"]["vllm"] = "0.26.0"  # a file of another vLLM than the installed one
    assert committed["meta"]["vllm"] != vllm.__version__
    (results_dir / "exactness-pcp.json").write_text(json.dumps(committed))
    case = {"model": key[0], "config": "pcp2 vs pcp1, chunked", "case": "len_7",
            "prompt_lens": [7], "first_divergence": None, "max_abs_logprob_diff": 0.0,
            "passed": True}
    row = {"kind": "greedy", "key": key, "session": "new", "command": "c", "dcp": 1,
           "cases": [case], "not_compared": [], "runs": [
               {"model": key[0], "variant": "chunked", "config": c, "git_rev": "ccc",
                "shared_gpus": shared, "mps": bool(shared)}
               for c, shared in (("pcp2", "1"), ("pcp1", None))]}
    (tmp_path / "rows").mkdir()
    (tmp_path / "rows" / "r.json").write_text(json.dumps(row))
    rows.write_results(str(tmp_path), str(results_dir), "new")
    written = _load("exactness-pcp.json", results_dir)
    assert written["cases"] == [case] and written["meta"]["vllm"] == vllm.__version__
    assert written["meta"]["ranks_shared_gpus"]["gpus"] == 1
    assert written["meta"]["ranks_shared_gpus"]["configs"] == ["pcp2"]
    kept = rows.committed_rows(str(results_dir), committed["meta"]["vllm"])
    assert kept == [] and rows.committed_rows(str(results_dir), vllm.__version__)


def test_repeated_engines_make_a_file_that_cuts_back_into_their_rows(tmp_path):
    (tmp_path / "rows").mkdir()
    judged = {"pcp1": (21, []), "pcp2": (21, ["results:mixed_batch"])}
    for config, (compared, differ) in judged.items():
        row = {"kind": "repeat", "key": ["m", "chunked", config], "session": "s", "command": "c",
               "compared": compared, "differ": differ, "runs": [
                   {"model": "m", "variant": "chunked", "config": config, "git_rev": "aaa"}] * 2}
        (tmp_path / "rows" / f"{config}.json").write_text(json.dumps(row))
    rows.write_results(str(tmp_path), str(tmp_path / "out"), "s", host={})
    doc = _load("repeatability.json", tmp_path / "out")
    assert doc["summary"] == {"engines": 2, "repeatable": False}
    assert {r["key"][2]: (r["compared"], r["differ"]) for r in rows.committed_rows(
        str(tmp_path / "out"))} == judged


def test_agreement_rows_make_a_file_that_cuts_back_into_them(tmp_path):
    (tmp_path / "rows").mkdir()
    judged = {"tp2-pcp2": ([256, 256], [1100, 1100], True, []),
              "tp4-pcp2-dcp2-i8": ([256, 40], [300] * 8, False, ["RuntimeError: step 41"])}
    for config, fields in judged.items():
        row = {"kind": "agreement", "key": ["m", "chunked", config], "session": "s",
               "command": "c", **dict(zip(rows.AGREEMENT_FIELDS, fields)), "runs": [
                   {"model": "m", "variant": "chunked", "config": config, "git_rev": "aaa"}]}
        (tmp_path / "rows" / f"{config}.json").write_text(json.dumps(row))
    rows.write_results(str(tmp_path), str(tmp_path / "out"), "s", host={})
    doc = _load("sampled-agreement.json", tmp_path / "out")
    assert doc["summary"] == {"engines": 2, "agree": False}
    assert {r["key"][2]: tuple(r[f] for f in rows.AGREEMENT_FIELDS)
            for r in rows.committed_rows(str(tmp_path / "out"))} == judged


def test_feature_floor_rows_make_a_file_that_cuts_back_into_them(tmp_path):
    """A floor row with feature cases (one GPU against itself) lands in the features file as
    its noise floor, apart from the layouts' comparisons, and cuts back into the same row."""
    (tmp_path / "rows").mkdir()

    def case(config, name, passed):
        return {"model": "smollm2", "config": f"{config}, chunked", "case": name,
                "prompt_lens": [5], "first_divergence": None if passed else 3,
                "max_abs_logprob_diff": 0.1, "passed": passed, "kind": name}
    floor = [case("pcp1-flash-attn vs pcp1", n, n != "prompt_logprobs")
             for n in ("prompt_logprobs", "burst")]
    made = {"features": (["smollm2", "chunked", "pcp2"], "pcp1", dict(cases=[
                case("pcp2 vs pcp1", "prompt_logprobs", False)])),
            "floor": (["smollm2", "chunked", "pcp1-flash-attn"], "pcp1", dict(
                cases=[], teacher=None, features=floor))}
    for kind, (key, base, judged) in made.items():
        runs = [{"model": key[0], "variant": key[1], "config": c, "git_rev": "aaa"}
                for c in (key[2], base)]
        row = {"kind": kind, "key": key, "session": "s", "command": "c", "runs": runs, **judged}
        (tmp_path / "rows" / f"{kind}.json").write_text(json.dumps(row))
    rows.write_results(str(tmp_path), str(tmp_path / "out"), "s", host={})
    doc = _load("exactness-features.json", tmp_path / "out")
    assert doc["summary"]["cases"] == 1 and doc["summary"]["noise_floor"]["passed"] == 1
    assert doc["noise_floor_cases"] == floor
    cut = {r["kind"]: r for r in rows.committed_rows(str(tmp_path / "out"))}
    assert cut["floor"]["features"] == floor and cut["floor"]["key"][2] == "pcp1-flash-attn"
    assert cut["features"]["cases"] == made["features"][2]["cases"]


def test_vllms_own_tp2_feature_cases_land_beside_the_floor_not_among_the_comparisons(tmp_path):
    """A MoE model's stock -tp 2 feature cases (test_features' expected failure, the floor
    its layouts are held to) go into ``noise_floor_cases``, outside the summary of the
    plugin's comparisons, and cut back into the same ``features`` row."""
    (tmp_path / "rows").mkdir()
    for config, passed in (("pcp2", True), ("tp2", False)):
        cases = [{"model": "qwen3-moe-8e", "config": f"{config} vs pcp1, chunked",
                  "case": "burst", "prompt_lens": [5], "first_divergence": None if passed else 2,
                  "max_abs_logprob_diff": 0.1, "passed": passed, "kind": "burst"}]
        runs = [{"model": "qwen3-moe-8e", "variant": "chunked", "config": c, "git_rev": "aaa"}
                for c in (config, "pcp1")]
        row = {"kind": "features", "key": ["qwen3-moe-8e", "chunked", config], "session": "s",
               "command": "c", "runs": runs, "cases": cases}
        (tmp_path / "rows" / f"{config}.json").write_text(json.dumps(row))
    rows.write_results(str(tmp_path), str(tmp_path / "out"), "s", host={})
    doc = _load("exactness-features.json", tmp_path / "out")
    assert (doc["summary"]["cases"], doc["summary"]["passed"]) == (1, 1)
    assert doc["summary"]["noise_floor"]["cases"] == 1
    assert [c["config"] for c in doc["noise_floor_cases"]] == ["tp2 vs pcp1, chunked"]
    cut = {tuple(r["key"]): r for r in rows.committed_rows(str(tmp_path / "out"))}
    assert cut[("qwen3-moe-8e", "chunked", "tp2")]["kind"] == "features"
    assert [c["passed"] for c in cut[("qwen3-moe-8e", "chunked", "tp2")]["cases"]] == [False]


def test_engines_under_mps_are_named_and_stay_named_once_cut_back(tmp_path):
    """``meta.ranks_shared_gpus.mps_configs`` lists the shared engines that ran under an MPS
    daemon, and a file cut back into rows keeps them apart from the time-sliced ones."""
    (tmp_path / "rows").mkdir()
    row = {**_committed_rows()[0], "session": "s", "command": "c", "runs": [
        {"model": "m", "variant": "v", "config": c, "git_rev": "aaa", "shared_gpus": "1",
         "mps": mps} for c, mps in (("pcp2", True), ("pcp4", False))]}
    (tmp_path / "rows" / "r.json").write_text(json.dumps(row))
    written = rows.write_results(str(tmp_path), str(tmp_path / "out"), "s", host={"gpu": "g"})
    shared = json.loads(open(written[0]).read())["meta"]["ranks_shared_gpus"]
    assert (shared["configs"], shared["mps_configs"]) == (["pcp2", "pcp4"], ["pcp2"])
    assert "MPS" in shared["note"]
    again = rows.meta_extra(rows.committed_rows(str(tmp_path / "out")))["ranks_shared_gpus"]
    assert again["mps_configs"] == ["pcp2"]
    assert "mps_configs" not in rows.results.shared_gpus({"pcp2": "1"}, ["pcp1"])
