"""benchmarks/kernel_choice.py without a GPU: the rows it times are the plugin's split; its
summary picks on made-up timings and gives the committed file's summary."""
import json
import os
import sys

import numpy as np
import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))
import kernel_choice as kc  # noqa: E402

from vllm_pcp.pcp.partition import build_pcp_metadata  # noqa: E402


@pytest.mark.parametrize("world", [2, 3, 4])
@pytest.mark.parametrize("prompt_len", [32768, 1000, 4099])
def test_rank_rows_are_the_plugins_dual_chunk_swap(world, prompt_len):
    tokens = []
    for rank in range(world):
        rows = kc.rank_rows(prompt_len, world, rank)
        meta = build_pcp_metadata([0], [prompt_len], world, rank)
        np.testing.assert_array_equal(rows.qo_indptr, meta.query_start_loc.numpy())
        np.testing.assert_array_equal(rows.kv_lens, meta.seq_lens.numpy())
        np.testing.assert_array_equal(rows.local_tokens, meta.local_token_indices.numpy())
        tokens.append(rows.local_tokens)
    np.testing.assert_array_equal(np.sort(np.concatenate(tokens)), np.arange(prompt_len))


def test_summary_picks_the_fastest_exact_choice_on_the_slowest_rank():
    """ragged fa2 is fastest but not exact on rank 1: ragged fa3 wins."""
    times = {("paged", "auto"): (5.0, 5.2), ("paged", "fa3"): (5.0, 5.1),
             ("ragged", "fa2"): (3.0, 3.0), ("ragged", "fa3"): (4.0, 4.2)}
    rows = [kc.row(1, 32768, 0, "paged", "auto", [9.0] * 20, None)]
    for rank in range(2):
        rows += [kc.row(2, 32768, rank, k, b, [ms[rank]] * 20, (k, b, rank) != ("ragged", "fa2", 1))
                 for (k, b), ms in times.items()]
        rows += [kc.row(2, 32768, rank, "kv_gather", "torch", [0.05 + rank] * 20, None),
                 kc.row(2, 32768, rank, "kv_copy", "torch", [0.01] * 20, None)]
    (s,) = kc.summarize(rows)
    assert kc.row(1, 1, 0, "k", "b", [float(x) for x in range(1, 22)], None)["p90_ms"] == 19.0
    assert (s["N"], s["prompt_len"], s["slowest_rank_ms"]["paged-auto"]) == (2, 32768, 5.2)
    assert s["exact"]["ragged-fa2"] is False and s["exact"]["ragged-fa3"] is True
    assert s["best"] == {"kernel": "ragged", "backend": "fa3", "ms": 4.2}
    assert s["speedup_over_paged_auto"] == round(5.2 / 4.2, 3)
    assert (s["kv_gather_ms"], s["best_ragged_with_gather_ms"], s["kv_copy_ms"]) == (
        1.05, 5.25, 0.01)
    assert (s["one_gpu_ms"], s["one_gpu_over_best"]) == (9.0, round(9.0 / 4.2, 3))


def test_summary_of_the_committed_rows_is_the_committed_summary():
    with open(os.path.join(kc.ROOT, "benchmarks", "results", "kernel-choice.json")) as f:
        doc = json.load(f)
    assert kc.summarize(doc["rows"]) == doc["summary"]


@pytest.mark.parametrize("world", [2, 4])
def test_rows_of_a_chunk_after_cached_context_are_the_plugins(world):
    """``--context``: the chunk's rows sit at their positions after the cached tokens."""
    context, chunk = 4096, 8192
    for rank in range(world):
        rows = kc.rank_rows(chunk, world, rank, context)
        meta = build_pcp_metadata([context], [chunk], world, rank)
        np.testing.assert_array_equal(rows.kv_lens, meta.seq_lens.numpy())
        np.testing.assert_array_equal(rows.qo_indptr, meta.query_start_loc.numpy())
        np.testing.assert_array_equal(rows.local_tokens - context,
                                      meta.local_token_indices.numpy())


def test_summary_with_the_merged_choice_adds_its_gather():
    rows = [kc.row(1, 8192, 0, "paged", "auto", [4.0] * 20, None)]
    for rank in range(2):
        rows += [kc.row(2, 8192, rank, "paged", "auto", [2.0] * 20, True),
                 kc.row(2, 8192, rank, "ragged", "auto", [2.5] * 20, True),
                 kc.row(2, 8192, rank, "ragged+paged", "auto", [1.8] * 20, True),
                 kc.row(2, 8192, rank, "kv_gather", "torch", [0.3] * 20, None),
                 kc.row(2, 8192, rank, "kv_copy", "torch", [0.01] * 20, None),
                 kc.row(2, 8192, rank, "kv_gather_new", "torch", [0.1] * 20, None)]
    (s,) = kc.summarize(rows)
    assert s["best"] == {"kernel": "ragged+paged", "backend": "auto", "ms": 1.8}
    assert (s["kv_gather_new_ms"], s["ragged_paged_with_gather_ms"]) == (0.1, 1.9)
    assert s["best_ragged_with_gather_ms"] == 2.8
