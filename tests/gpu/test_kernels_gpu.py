"""FlashInfer kernels as vllm-pcp drives them, against the plain-torch reference (GPU only).

    python -m pytest -q tests/gpu            # on a CUDA machine with vLLM installed

1. PCP (DCP = 1): local chunk rows over a paged cache holding the whole prefix,
   ``causal=True`` (bottom-right) -- exact without a custom mask.
2. PCP x DCP: DCPAttention over paged shards of 2 and 4 ranks (threads on one GPU).
"""
import math

import pytest
import torch

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

TOL = dict(atol=3e-2, rtol=3e-2)  # bf16 inputs


def test_chunk_rows_with_bottom_right_causal_mask():
    import flashinfer

    from vllm_pcp.partition import build_pcp_metadata
    from vllm_pcp.reference import rank_prefill_attention

    hq, hkv, dim, page = 16, 2, 128, 16
    computed, scheduled = [0, 300, 7], [1000, 517, 1]
    g = torch.Generator().manual_seed(0)
    kv = [(torch.randn(c + s, hkv, dim, generator=g), torch.randn(c + s, hkv, dim, generator=g))
          for c, s in zip(computed, scheduled)]
    q_all = torch.randn(sum(scheduled), hq, dim, generator=g)
    pages = [(len(k) + page - 1) // page for k, _ in kv]
    k_cache = torch.zeros(sum(pages), page, hkv, dim)
    v_cache = torch.zeros_like(k_cache)
    table, nxt = [], 0
    for (k, v), n in zip(kv, pages):
        ids = torch.arange(nxt, nxt + n)
        nxt += n
        flat = torch.zeros(n * page, hkv, dim)
        flat[: len(k)] = k
        k_cache[ids] = flat.view(n, page, hkv, dim)
        flat = torch.zeros(n * page, hkv, dim)
        flat[: len(v)] = v
        v_cache[ids] = flat.view(n, page, hkv, dim)
        table.append(ids)
    for rank in range(2):
        meta = build_pcp_metadata(computed, scheduled, 2, rank)
        rows = meta.row_req_indices.long()
        n_pages = (meta.seq_lens + page - 1) // page
        indices = torch.cat([table[r][:n] for r, n in zip(rows.tolist(), n_pages.tolist())])
        indptr = torch.cat([torch.zeros(1, dtype=torch.int64), n_pages.cumsum(0)])
        last = meta.seq_lens - (n_pages - 1) * page
        wrapper = flashinfer.BatchPrefillWithPagedKVCacheWrapper(
            torch.empty(128 << 20, dtype=torch.uint8, device="cuda"), "NHD")
        wrapper.plan(meta.query_start_loc.cuda(), indptr.int().cuda(), indices.int().cuda(),
                     last.int().cuda(), hq, hkv, dim, page, causal=True,
                     sm_scale=1 / math.sqrt(dim), q_data_type=torch.bfloat16,
                     kv_data_type=torch.bfloat16)
        q_local = q_all[meta.local_token_indices]
        out = wrapper.run(q_local.cuda().bfloat16(),
                          (k_cache.cuda().bfloat16(), v_cache.cuda().bfloat16()))
        ref = rank_prefill_attention(q_local, kv, meta.query_start_loc, meta.seq_lens,
                                     meta.row_req_indices)
        torch.testing.assert_close(out.float().cpu(), ref, **TOL)


@pytest.mark.parametrize("world,interleave", [(2, 1), (2, 16), (4, 8)])
@pytest.mark.parametrize("min_split", [2, 16])
@pytest.mark.parametrize("kv_layout", ["NHD", "HND"])
@pytest.mark.parametrize("context_exchange", ["queries", "keys"])
def test_dcp_attention_on_flashinfer(world, interleave, min_split, kv_layout,
                                     context_exchange):
    from dcp_harness import run_dcp_step

    outs, expect = run_dcp_step(world, interleave, min_split, "cuda", torch.bfloat16,
                                kv_layout=kv_layout, context_exchange=context_exchange)
    for out in outs:
        torch.testing.assert_close(out.float(), expect, **TOL)


@pytest.mark.parametrize("computed,scheduled", [([40, 1, 77], [1, 1, 1]), ([3, 0], [1, 50])])
def test_dcp_attention_decode_and_thin_context_on_flashinfer(computed, scheduled):
    from dcp_harness import run_dcp_step

    outs, expect = run_dcp_step(2, 8, 2, "cuda", torch.bfloat16, hq=16, hkv=2, dim=128,
                                computed=computed, scheduled=scheduled, kv_layout="HND")
    for out in outs:
        torch.testing.assert_close(out.float(), expect, **TOL)


@pytest.mark.parametrize("world,hq,hkv,dim", [(2, 16, 2, 128), (2, 9, 3, 64), (4, 14, 2, 64)])
@pytest.mark.parametrize("rows", [1, 3, 8])
def test_folded_decode_on_flashinfer(world, hq, hkv, dim, rows):
    """Pure decode steps: one paged call writing out and LSE into the packed buffer,
    one all-gather, FlashInfer's merge; odd head counts check the block alignment."""
    from dcp_harness import run_dcp_step
    from vllm_pcp.dcp_plan import build_dcp_plan

    computed, scheduled = [40 + 37 * i for i in range(rows)], [1] * rows
    assert build_dcp_plan(computed, scheduled, world, 0, 8).decode is not None
    outs, expect = run_dcp_step(world, 8, 2, "cuda", torch.bfloat16, hq=hq, hkv=hkv, dim=dim,
                                computed=computed, scheduled=scheduled, kv_layout="HND")
    for out in outs:
        torch.testing.assert_close(out.float(), expect, **TOL)
        assert torch.equal(out, outs[0])


@pytest.mark.parametrize("world,graph_rows", [(2, 4), (2, 8), (4, 8)])
def test_folded_decode_on_the_graph_wrapper(world, graph_rows):
    """The CUDA-graph decode wrapper (fixed buffers, padding rows without keys), run
    outside a graph after planning vLLM's capture batch: the batch's rows as the reference."""
    from dcp_harness import run_dcp_step

    computed, scheduled = [40, 300, 77], [1, 1, 1]
    outs, expect = run_dcp_step(world, 8, 2, "cuda", torch.bfloat16, hq=16, hkv=2, dim=128,
                                computed=computed, scheduled=scheduled, kv_layout="HND",
                                graph_rows=graph_rows)
    for out in outs:
        torch.testing.assert_close(out[:3].float(), expect, **TOL)


class _MirrorGroup:
    """Two ranks with the same partials; its all-gather (two copies) is capturable."""
    world_size = 2

    def all_gather(self, x, dim=0):
        return torch.cat([x, x], dim=dim)


def test_folded_decode_replays_as_a_cuda_graph():
    """Capture the decode attention of 8 rows once; plan a batch of 3 into the fixed
    buffers, replay: its rows equal the eager decode wrapper's."""
    from vllm_pcp.dcp_attention import DCPAttention
    from vllm_pcp.dcp_plan import build_dcp_plan

    hq, hkv, dim, page, rows = 16, 2, 128, 16, 8
    g = torch.Generator(device="cuda").manual_seed(0)
    cache = tuple(torch.randn(64, hkv, page, dim, generator=g, device="cuda").bfloat16()
                  for _ in range(2))
    table = torch.randint(1, 64, (rows, 20), generator=g, device="cuda", dtype=torch.int32)

    def attention(max_graph_rows):
        ws = torch.empty(128 * 1024 * 1024, dtype=torch.uint8, device="cuda")
        return DCPAttention(ws, hq, hkv, dim, page, torch.bfloat16, 1 / math.sqrt(dim), "HND",
                            max_graph_rows=max_graph_rows)

    graph_attn, eager_attn, group = attention(rows), attention(0), _MirrorGroup()
    q = torch.randn(rows, hq, dim, generator=g, device="cuda").bfloat16()
    graph_attn.plan(build_dcp_plan([16] * rows, [1] * rows, 2, 0, 8), table, rows)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up off the default stream, as torch asks
        graph_attn.run(group, q, None, None, cache)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = graph_attn.run(group, q, None, None, cache)

    step = build_dcp_plan([40, 300, 77], [1, 1, 1], 2, 0, 8)
    graph_attn.plan(step, table, rows)
    q.copy_(torch.randn(rows, hq, dim, generator=g, device="cuda").bfloat16())
    graph.replay()
    eager_attn.plan(step, table[:3])
    expect = eager_attn.run(group, q[:3].clone(), None, None, cache)
    torch.cuda.synchronize()
    torch.testing.assert_close(out[:3].float(), expect.float(), **TOL)
    assert not torch.equal(out[:3], torch.zeros_like(out[:3]))


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("computed,scheduled,graph_rows", [
    (None, None, None), ([40, 300, 77], [1, 1, 1], None), ([40, 300, 77], [1, 1, 1], 4)])
def test_dcp_inside_tp_on_flashinfer(world, computed, scheduled, graph_rows):
    """-tp N -dcp N: each rank's query heads, gathered over the DCP group, against one
    kv head (the 1-kv-head model under TP); each rank's heads equal the reference."""
    from dcp_harness import COMPUTED, SCHEDULED, run_dcp_step

    computed, scheduled = (computed, scheduled) if computed else (COMPUTED, SCHEDULED)
    outs, expect = run_dcp_step(world, 8, 2, "cuda", torch.bfloat16, hq=8, hkv=1, dim=128,
                                computed=computed, scheduled=scheduled, kv_layout="HND",
                                graph_rows=graph_rows, heads_gathered=True)
    out = torch.cat(outs, dim=1)[: len(expect)]
    torch.testing.assert_close(out.float(), expect, **TOL)
