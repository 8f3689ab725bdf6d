"""benchmarks/decode_policy.py: a decode-only step's collectives and bytes under each decode
policy, from the plugin manager's own split (CPU); its result file; the GPU times (CUDA)."""
import json
import math
import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))
import decode_policy as dp  # noqa: E402

ROOT = os.path.join(os.path.dirname(__file__), "..")


def _config(name: str) -> dict:
    with open(os.path.join(ROOT, "configs", "models", name)) as f:
        return json.load(f)


QWEN = dp.Shape.from_config(_config("qwen2.5-3b-shape.json"))
MOE = dp.Shape.from_config(_config("qwen3-moe-8e.json"))


def test_the_bench_shape_is_qwen25_3b():
    assert (QWEN.layers, QWEN.q_heads, QWEN.kv_heads, QWEN.head_dim, QWEN.hidden,
            QWEN.dtype_bytes, QWEN.experts) == (36, 16, 2, 128, 2048, 2, 0)
    assert (MOE.experts, MOE.moe_layers) == (8, MOE.layers)


def test_expert_layers_follow_the_sparse_step_and_the_dense_list():
    hf = {**_config("qwen3-moe-8e.json"), "num_hidden_layers": 8, "decoder_sparse_step": 2,
          "mlp_only_layers": [1]}
    assert dp.Shape.from_config(hf).moe_layers == 3  # layers 3, 5, 7


@pytest.mark.parametrize("world", [2, 3, 4])
@pytest.mark.parametrize("batch", [1, 15, 64])
def test_replicate_runs_no_collective_at_dcp1(world, batch):
    row = dp.count_row(QWEN, batch, 4096, world, "replicate")
    assert row["gathered"] is False and row["decodes_per_rank"] == [batch] * world
    assert row["padded_rows"] == batch and row["collectives"] == []
    assert (row["collectives_per_step"], row["out_bytes_per_step"],
            row["wire_bytes_per_rank_per_step"]) == (0, 0, 0)


@pytest.mark.parametrize("world", [2, 3, 4])
@pytest.mark.parametrize("batch", [1, 15, 64])
def test_shard_gathers_kv_per_layer_and_hidden_states_per_step(world, batch):
    row = dp.count_row(QWEN, batch, 4096, world, "shard")
    p = math.ceil(batch / world)
    assert row["gathered"] is True and row["padded_rows"] == p
    assert sorted(row["decodes_per_rank"], reverse=True) == row["decodes_per_rank"]
    assert sum(row["decodes_per_rank"]) == batch and row["decodes_per_rank"][0] == p
    kv, hidden = row["collectives"]
    kv_bytes = p * 2 * 2 * 128 * 2  # P rows of K and V, 2 KV heads of 128, bf16
    assert (kv["name"], kv["count"], kv["send_bytes"], kv["out_bytes"]) == (
        "kv_all_gather", 36, kv_bytes, world * kv_bytes)
    assert (hidden["name"], hidden["count"], hidden["send_bytes"], hidden["out_bytes"]) == (
        "hidden_restore", 1, p * 2048 * 2, world * p * 2048 * 2)
    assert row["collectives_per_step"] == 37
    assert row["out_bytes_per_step"] == world * (36 * kv_bytes + p * 2048 * 2)
    assert row["wire_bytes_per_rank_per_step"] == (world - 1) * (36 * kv_bytes + p * 2048 * 2)


@pytest.mark.parametrize("policy,gathered", [("replicate", False), ("shard", True)])
def test_an_moe_model_gathers_its_expert_tokens_under_both_policies(policy, gathered):
    batch, world = 15, 4
    row = dp.count_row(MOE, batch, 4096, world, policy)
    rows = batch if policy == "replicate" else math.ceil(batch / world)
    moe = {c["name"]: c for c in row["collectives"] if c["name"].startswith("moe_")}
    assert row["gathered"] is gathered and row["padded_rows"] == rows
    hidden = rows * MOE.hidden * 2
    assert moe["moe_hidden"]["out_bytes"] == world * hidden
    assert moe["moe_router_logits"]["send_bytes"] == rows * MOE.experts * 2
    combine = moe["moe_combine"]  # the reduce-scatter: every rank's N x P rows in, P out
    assert (combine["kind"], combine["send_bytes"], combine["out_bytes"]) == (
        "reduce_scatter", world * hidden, hidden)
    assert all(c["count"] == MOE.moe_layers for c in moe.values())
    assert row["collectives_per_step"] == 3 * MOE.moe_layers + (MOE.layers + 1) * gathered


def test_summary_sets_each_policys_step_beside_the_others():
    rows = [dict(dp.count_row(QWEN, 8, 1024, 2, p), gpu_ms={"step": ms})
            for p, ms in (("replicate", 10.0), ("shard", 6.0))]
    (s,) = dp.summarize(rows)
    assert (s["batch"], s["context"], s["N"]) == (8, 1024, 2)
    assert s["gpu_step_ms"] == {"replicate": 10.0, "shard": 6.0}
    assert s["shard_over_replicate"] == 0.6
    assert s["replicate_collectives_per_step"] == 0 and s["shard_collectives_per_step"] == 37
    assert s["shard_out_bytes_per_step"] == rows[1]["out_bytes_per_step"] > 0


def test_counts_only_file_has_meta_rows_and_summary(tmp_path):
    out = tmp_path / "decode-policy.json"
    dp.main(["--out", str(out), "--cases", "4x512,3x64", "--worlds", "2", "--counts-only"])
    with open(out) as f:
        doc = json.load(f)
    meta = doc["meta"]
    assert {"command", "git_rev", "vllm", "flashinfer", "torch", "gpu", "date"} <= set(meta)
    assert meta["command"].startswith("python benchmarks/decode_policy.py --out")
    assert meta["timed"] is False and meta["shape"]["layers"] == 36
    assert [(r["batch"], r["context"], r["policy"]) for r in doc["rows"]] == [
        (4, 512, "replicate"), (4, 512, "shard"), (3, 64, "replicate"), (3, 64, "shard")]
    assert all(r["gpu_ms"] is None for r in doc["rows"]) and len(doc["summary"]) == 2


def test_cases_parse_and_a_zero_is_refused():
    assert dp.parse_cases("8x32768,64X4096") == [(8, 32768), (64, 4096)]
    for bad in ("0x4096", "8x0", "8"):
        with pytest.raises(SystemExit, match="need BxC"):
            dp.parse_cases(bad)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="times FlashInfer on a GPU")
def test_gpu_times_of_both_policies():
    rows = dp.measure(QWEN, [(8, 2048)], [2], timed=True)
    rep, shard = rows
    for r in rows:
        ms = r["gpu_ms"]
        assert all(ms[k] > 0 for k in ("attention", "gemms", "write", "logits"))
        assert ms["step"] == pytest.approx(36 * ms["layer"] + ms["logits"], abs=1e-3)
    assert rep["gpu_ms"]["logits"] == shard["gpu_ms"]["logits"]  # the same B rows sampled
