"""benchmarks/projection.py without a GPU: the projection from made-up piece timings."""
import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))
import projection as pj  # noqa: E402


def _row(world, rank, gemms, paged, ragged, gather=0.1, write=0.5, length=32768):
    return {"N": world, "prompt_len": length, "rank": rank, "rows": length // world,
            "gemms": gemms, "attention_paged": paged, "attention_ragged": ragged,
            "ragged_gather": gather, "write": write}


def test_the_slowest_rank_on_each_kernel_against_one_gpus_model():
    rows = [_row(1, 0, 10.0, 8.0, 7.0), _row(2, 0, 5.0, 1.0, 0.8), _row(2, 1, 5.0, 3.0, 2.0)]
    (case,) = pj.project(rows, layers=36)
    assert case["one_gpu_ms"] == pytest.approx((10.0 + 8.0 + 0.5) * 36)
    assert case["slowest_rank_ms"] == {"paged": pytest.approx((5.0 + 3.0 + 0.5) * 36),
                                       "ragged": pytest.approx((5.0 + 2.1 + 0.5) * 36)}
    assert case["projected_speedup"]["paged"] == pytest.approx(18.5 / 8.5, abs=1e-3)
    assert case["projected_speedup"]["ragged"] == pytest.approx(18.5 / 7.6, abs=1e-3)


@pytest.mark.parametrize("world, length", [(2, 32768), (4, 131072), (4, 4099)])
def test_all_gather_bytes_are_the_padded_rows_every_rank_sends(world, length):
    rows = [_row(1, 0, 1, 1, 1, length=length)] + [
        _row(world, r, 1, 1, 1, length=length) for r in range(world)]
    (case,) = pj.project(rows)
    per_rank = -(-length // world)
    kv_heads, head_dim = pj.kc.HEADS[1], pj.kc.HEAD_DIM
    assert case["kv_gather_bytes_per_layer"] == world * per_rank * 2 * kv_heads * head_dim * 2
    assert case["restore_bytes"] == world * per_rank * pj.HIDDEN * 2
    assert case["layers"] == pj.LAYERS == 36


def test_cases_parse_and_a_split_too_short_for_its_ranks_is_refused():
    assert pj.kc.parse_cases("2x32768,4X131072") == [(2, 32768), (4, 131072)]
    for bad in ("1x4096", "4x15"):
        with pytest.raises(SystemExit, match="need N >= 2"):
            pj.kc.parse_cases(bad)


def test_cases_with_a_goal_say_whether_the_ragged_projection_meets_it():
    rows = [_row(1, 0, 10.0, 8.0, 7.0), _row(2, 0, 5.0, 1.0, 0.8), _row(2, 1, 5.0, 3.0, 2.0),
            _row(1, 0, 10.0, 8.0, 7.0, length=4096), _row(2, 0, 5.0, 3.0, 2.0, length=4096)]
    goal, other = pj.project(rows, layers=36)  # 32K: 18.5 / 7.6 = 2.43x on the ragged kernel
    assert (goal["goal"], goal["goal_met"]) == (pj.GOALS[(2, 32768)], True)
    assert "goal" not in other and "goal_met" not in other
    slow = [_row(1, 0, 10.0, 8.0, 7.0), _row(2, 0, 8.0, 2.0, 1.5), _row(2, 1, 8.0, 3.0, 1.5)]
    (case,) = pj.project(slow, layers=36)  # 18.5 / 10.1: under 2.10
    assert case["goal_met"] is False
