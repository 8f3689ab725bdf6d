"""Padding rows of a full decode CUDA graph under DCP (GPU only).

vLLM pads a decode batch to the captured graph's size; the plugin plans the rows past
the batch with ``kv_len = 0`` on every rank (``DCPAttention._plan_decode``), so every
rank's partial state of such a row is "no keys", and the merge of the gathered
partials (``flashinfer.merge_state`` for 2 ranks, ``merge_states`` beyond) sees only
empty states. Those rows' outputs are written into the layer's output as they come
out of the merge (``PCPFlashInferImpl._forward_dcp`` zeroes pad rows only on steps
with a K/V exchange). This file records what FlashInfer returns there and checks the
padded rows stay finite.

    python -m pytest -q tests/gpu/test_dcp_padding_gpu.py -rA   # the recorded values
    python -m pytest -q tests/gpu/test_dcp_padding_gpu.py --junitxml=padding.xml  # as properties
"""
import math

import pytest
import torch

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

TOL = dict(atol=3e-2, rtol=3e-2)  # bf16 inputs


def _summary(t: torch.Tensor) -> dict:
    """What a tensor holds: NaN / inf counts and a few values."""
    t = t.float()
    return dict(nan=int(t.isnan().sum()), inf=int(t.isinf().sum()), numel=t.numel(),
                first=[float(x) for x in t.flatten()[:4].tolist()])


def _record(record_property, name: str, value) -> None:
    print(f"{name}: {value}")
    record_property(name, value)


@pytest.mark.parametrize("lse_value", [float("-inf"), -5e4])
def test_merge_of_rows_whose_lses_are_all_minus_inf(record_property, lse_value):
    """Records FlashInfer's merges of rows with no keys on any side: LSE ``-inf``, and
    ``-5e4`` (FlashInfer's own ``-math::inf``, what its kernels write for an empty
    row). The values are recorded, not asserted."""
    import flashinfer

    rows, hq, dim = 4, 8, 128
    v = torch.zeros(rows, hq, dim, dtype=torch.bfloat16, device="cuda")
    s = torch.full((rows, hq), lse_value, dtype=torch.float32, device="cuda")
    out, lse = flashinfer.merge_state(v, s, v.clone(), s.clone())
    torch.cuda.synchronize()
    _record(record_property, f"merge_state[lse={lse_value}].out", _summary(out))
    _record(record_property, f"merge_state[lse={lse_value}].lse", _summary(lse))
    states = torch.zeros(rows, 4, hq, dim, dtype=torch.bfloat16, device="cuda")
    out, lse = flashinfer.merge_states(
        states, torch.full((rows, 4, hq), lse_value, dtype=torch.float32, device="cuda"))
    torch.cuda.synchronize()
    _record(record_property, f"merge_states[4 ranks, lse={lse_value}].out", _summary(out))
    _record(record_property, f"merge_states[4 ranks, lse={lse_value}].lse", _summary(lse))
    assert out.shape == (rows, hq, dim) and lse.shape == (rows, hq)


@pytest.mark.parametrize("world", [2, 4])  # merge_state; merge_states
@pytest.mark.parametrize("kv_layout", ["NHD", "HND"])
def test_padded_rows_of_a_decode_graph_merge_to_finite_outputs(record_property, world,
                                                                kv_layout):
    """A decode batch of 3 rows planned into the graph wrapper of 8 rows (after vLLM's
    capture batch, as a replay does), on every rank of ``world``: the padded rows 3..7
    have no keys anywhere. Their merged output must be finite (it reaches o_proj and
    the rest of the model, MoE routing and per-tensor activation scales included); the
    real rows equal the reference. The decode kernel's own partials of the padded rows
    are recorded (NaN: not written by the kernel, or NaN)."""
    from dcp_harness import _capture_like_vllm, _paged_shard, expected_output, make_batch
    from helpers import ThreadGroup
    from vllm_pcp.dcp.attention import DCPAttention
    from vllm_pcp.dcp.plan import build_dcp_plan

    hq, hkv, dim, page, interleave, graph_rows = 16, 2, 128, 16, 8, 8
    computed, scheduled = [40, 300, 77], [1, 1, 1]
    full, q = make_batch(hq, hkv, dim, world, computed, scheduled)
    full = [(k.bfloat16().float(), v.bfloat16().float()) for k, v in full]
    q = q.bfloat16().float()
    pad = torch.randn(graph_rows - len(q), hq, dim, generator=torch.Generator().manual_seed(1))
    q_graph = torch.cat([q, pad]).to("cuda", torch.bfloat16)
    group = ThreadGroup(world)

    def rank_fn(rank):
        cache, table = _paged_shard(full, rank, world, interleave, page, "cuda",
                                    torch.bfloat16)
        if kv_layout == "HND":  # [pages, Hkv, page_size, D]
            cache = tuple(c.transpose(1, 2).contiguous() for c in cache)
        workspace = torch.empty(128 << 20, dtype=torch.uint8, device="cuda")
        attn = DCPAttention(workspace, hq, hkv, dim, page, torch.bfloat16,
                            1 / math.sqrt(dim), kv_layout, max_graph_rows=graph_rows)
        captured = _capture_like_vllm(attn, world, rank, interleave, graph_rows, table)
        step = attn.plan(build_dcp_plan(computed, scheduled, world, rank, interleave),
                         table, graph_rows)
        assert step.decode_wrapper is captured
        # the kernel's partials, into NaN-filled buffers: NaN left in a padded row means
        # the kernel did not write it (or wrote NaN); the plugin's buffer is torch.empty
        part_out = torch.full_like(q_graph, float("nan"))
        part_lse = torch.full(q_graph.shape[:2], float("nan"), device="cuda")
        step.decode_wrapper.run(q_graph, cache, out=part_out, lse=part_lse, return_lse=True)
        out = attn.run(step, group.rank(rank), q_graph, None, None, cache)
        torch.cuda.synchronize()
        return out.cpu(), part_out[len(q):].cpu(), part_lse[len(q):].cpu()

    expect = expected_output(full, q, computed, scheduled)
    for rank, (out, part_out, part_lse) in enumerate(group.run(rank_fn)):
        _record(record_property, f"world {world} {kv_layout} rank {rank} padded partial out",
                _summary(part_out))
        _record(record_property, f"world {world} {kv_layout} rank {rank} padded partial lse",
                _summary(part_lse))
        _record(record_property, f"world {world} {kv_layout} rank {rank} padded merged out",
                _summary(out[len(q):]))
        torch.testing.assert_close(out[: len(q)].float(), expect, **TOL)
        assert torch.isfinite(out[len(q):].float()).all(), \
            f"rank {rank}: padded rows of the decode graph are not finite"
