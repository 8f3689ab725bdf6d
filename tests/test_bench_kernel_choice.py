"""scripts/bench_kernel_choice.py without a GPU: the rank rows it times are the plugin's
(vllm_pcp.pcp.partition), its paged and ragged layouts read the right keys, and its summary
and output file have their shape on made-up timings; its run_gpu_checks.sh stage."""
import json
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest

SCRIPTS = os.path.join(os.path.dirname(__file__), "..", "scripts")
sys.path.insert(0, SCRIPTS)
import bench_kernel_choice as bench  # noqa: E402
import kernel_choice_lib  # noqa: E402

from vllm_pcp.pcp.partition import build_pcp_metadata  # noqa: E402

ROW_KEYS = {"N", "prompt_len", "rank", "kernel", "backend", "median_ms", "p10_ms", "p90_ms",
            "exact"}


def test_importing_it_loads_no_gpu_library():
    code = ("import sys; sys.path.insert(0, sys.argv[1]); import bench_kernel_choice; "
            "print('flashinfer' in sys.modules, 'torch' in sys.modules)")
    res = subprocess.run([sys.executable, "-c", code, SCRIPTS], capture_output=True, text=True,
                         timeout=120)
    assert res.returncode == 0, res.stderr
    assert res.stdout.split() == ["False", "False"]


@pytest.mark.parametrize("world", [2, 3, 4])
@pytest.mark.parametrize("prompt_len", [32768, 131072, 1000, 4099])
def test_rank_rows_are_the_plugins_dual_chunk_swap(world, prompt_len):
    for rank in range(world):
        rows = bench.rank_rows(prompt_len, world, rank)
        meta = build_pcp_metadata([0], [prompt_len], world, rank)
        np.testing.assert_array_equal(rows.qo_indptr, meta.query_start_loc.numpy())
        np.testing.assert_array_equal(rows.kv_lens, meta.seq_lens.numpy())
        np.testing.assert_array_equal(rows.local_tokens, meta.local_token_indices.numpy())
        assert rows.qo_indptr.dtype == np.int32 and rows.kv_lens.dtype == np.int32
        head, tail = rows.chunks  # chunks r and 2N-1-r, each ending its row's keys
        assert head[0] == prompt_len * rank // (2 * world)
        assert tail[1] == prompt_len * (2 * world - rank) // (2 * world)


def test_the_ranks_cover_the_prompt_once():
    tokens = np.concatenate([bench.rank_rows(4099, 4, r).local_tokens for r in range(4)])
    np.testing.assert_array_equal(np.sort(tokens), np.arange(4099))


def test_paged_layout_reads_each_rows_first_kv_len_keys_from_page_zero():
    indptr, indices, last = bench.paged_layout(np.array([16, 33, 1], np.int32), page_size=16)
    np.testing.assert_array_equal(indptr, [0, 1, 4, 5])
    np.testing.assert_array_equal(indices, [0, 0, 1, 2, 0])
    np.testing.assert_array_equal(last, [16, 1, 1])
    assert indptr.dtype == indices.dtype == last.dtype == np.int32


def test_ragged_layout_lays_each_rows_prefix_after_the_last():
    indptr, index = bench.ragged_layout(np.array([3, 5], np.int32))
    np.testing.assert_array_equal(indptr, [0, 3, 8])
    np.testing.assert_array_equal(index, [0, 1, 2, 0, 1, 2, 3, 4])


def test_parse_cases_and_the_default_grid():
    assert bench.parse_cases(bench.DEFAULT_CASES) == [(2, 32768), (4, 32768), (2, 131072)]
    assert bench.parse_cases(" 4X1024 ") == [(4, 1024)]
    for bad in ("1x32768", "4x15"):
        with pytest.raises(ValueError):
            bench.parse_cases(bad)


def test_kv_exchange_bytes_of_the_qwen_shape():
    assert bench.kv_exchange_bytes(16384) == 16384 * 2 * 2 * 128 * 2


def test_spread_of_runs():
    assert bench.spread([float(x) for x in range(1, 22)]) == {
        "median_ms": 11.0, "p10_ms": 3.0, "p90_ms": 19.0}


def _fake_rows():
    """N = 2, 32K: ragged fa3 fastest on both ranks; ragged fa2 fastest on rank 0 but not
    exact on rank 1; a one-GPU row."""
    times = {("paged", "auto"): (5.0, 5.2), ("paged", "fa2"): (7.0, 7.1),
             ("paged", "fa3"): (5.0, 5.1), ("ragged", "auto"): (4.1, 4.3),
             ("ragged", "fa2"): (3.0, 3.0), ("ragged", "fa3"): (4.0, 4.2)}
    rows = [bench._row(1, 32768, 0, "paged", "auto", [9.0] * 20, None)]
    for rank in range(2):
        for (kernel, backend), ms in times.items():
            exact = not (kernel, backend, rank) == ("ragged", "fa2", 1)
            rows.append(bench._row(2, 32768, rank, kernel, backend, [ms[rank]] * 20, exact,
                                   max_abs_diff=0.004))
        rows.append(bench._row(2, 32768, rank, "kv_gather", "torch", [0.05 + rank] * 20, None))
        rows.append(bench._row(2, 32768, rank, "kv_copy", "torch", [0.01] * 20, None,
                               bytes=bench.kv_exchange_bytes(16384)))
    return rows


def test_summary_picks_the_fastest_exact_choice_on_the_slowest_rank():
    (summary,) = kernel_choice_lib.summarize(_fake_rows())
    assert (summary["N"], summary["prompt_len"]) == (2, 32768)
    assert summary["slowest_rank_ms"]["paged-auto"] == 5.2
    assert summary["exact"]["ragged-fa2"] is False and summary["exact"]["ragged-fa3"] is True
    assert summary["best"] == {"kernel": "ragged", "backend": "fa3", "ms": 4.2}
    assert summary["speedup_over_paged_auto"] == round(5.2 / 4.2, 3)
    assert summary["kv_gather_ms"] == 1.05 and summary["kv_copy_ms"] == 0.01
    assert summary["best_ragged_with_gather_ms"] == 5.25
    assert summary["one_gpu_ms"] == 9.0
    assert summary["one_gpu_over_best"] == round(9.0 / 4.2, 3)
    assert summary["one_gpu_over_paged_auto"] == round(9.0 / 5.2, 3)


def test_result_file_shape():
    result = bench.build_result(_fake_rows(), {"git_rev": "abc"})
    result = json.loads(json.dumps(result))  # plain JSON all through
    assert set(result) == {"meta", "rows", "summary"}
    assert all(ROW_KEYS <= set(row) for row in result["rows"])
    assert {row["kernel"] for row in result["rows"]} == {"paged", "ragged", "kv_gather",
                                                         "kv_copy"}
    assert len(result["summary"]) == 1


def test_choices_time_paged_auto_first():
    assert bench._choices(("fa2", "fa3", "auto"))[0] == ("paged", "auto")
    assert bench._choices(("fa2",)) == [("paged", "auto"), ("paged", "fa2"), ("ragged", "fa2")]


def test_git_rev_prefers_the_environment(monkeypatch):
    monkeypatch.setenv("GIT_REV", "deadbeef")
    assert bench.git_rev() == "deadbeef"


FAKE_BENCH = """import json, sys
out = sys.argv[sys.argv.index("--out") + 1]
json.dump({"meta": {}, "rows": [], "summary": []}, open(out, "w"))
sys.exit(int(__import__("os").environ.get("BENCH_RC", "0")))
"""


@pytest.mark.parametrize("rc", [0, 3])
def test_kernel_choice_stage_writes_its_json_and_keeps_the_bench_status(tmp_path, rc):
    scripts = tmp_path / "scripts"
    scripts.mkdir()
    shutil.copy(os.path.join(SCRIPTS, "run_gpu_checks.sh"), scripts / "run_gpu_checks.sh")
    (scripts / "bench_kernel_choice.py").write_text(FAKE_BENCH)
    env = {**os.environ, "GPU_CHECKS_DIR": str(tmp_path / "checks"), "BENCH_RC": str(rc)}
    res = subprocess.run(["bash", str(scripts / "run_gpu_checks.sh"), "kernel-choice",
                          str(tmp_path / "out")], env=env, capture_output=True, text=True,
                         timeout=60)
    assert res.returncode == rc, res.stderr
    assert json.loads((tmp_path / "out" / "kernel-choice.json").read_text())["rows"] == []
