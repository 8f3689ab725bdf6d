"""FlashInfer kernels as vllm-pcp drives them, against the plain-torch reference (GPU only).

    python -m pytest -q tests/gpu            # on a CUDA machine with vLLM installed

1. PCP (DCP = 1): local chunk rows over a paged cache holding the whole prefix,
   ``causal=True`` (bottom-right) -- exact without a custom mask; N = 2, 3, 4, 8 ranks
   as sequential plans on one GPU, split as vLLM's PCP manager splits them, ranks
   without tokens (sharded decodes) included.
2. PCP x DCP: DCPAttention over paged shards of 2, 3, 4 and 8 ranks (threads on one
   GPU), on steps split as the manager splits them under ``-dcp`` (every request has a
   row on every rank), one-token rows included.

head_dim 64 / 128 / 256 and 1 / 2 / 8 kv heads are spread over the N = 3, 4, 8 cases
rather than crossed (FlashInfer compiles a kernel per head_dim on first use).
"""
import math

import pytest
import torch

from dcp_harness import dcp_plan, short_split_step

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

TOL = dict(atol=3e-2, rtol=3e-2)  # bf16 inputs


def test_chunk_rows_with_bottom_right_causal_mask():
    import flashinfer

    from vllm_pcp.pcp.partition import build_pcp_metadata
    from reference import rank_prefill_attention

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

    computed, scheduled = [40 + 37 * i for i in range(rows)], [1] * rows
    assert dcp_plan(computed, scheduled, world, 0, 8).decode is not None
    outs, expect = run_dcp_step(world, 8, 2, "cuda", torch.bfloat16, hq=hq, hkv=hkv, dim=dim,
                                computed=computed, scheduled=scheduled, kv_layout="HND")
    for out in outs:
        torch.testing.assert_close(out.float(), expect, **TOL)
        assert torch.equal(out, outs[0])


HEAD_DIMS, KV_HEADS, INTERLEAVES = (64, 128, 256), (1, 2, 8), (1, 8, 16)


def _query_heads(kv_heads):
    """Query heads of the GQA model with ``kv_heads`` KV heads: 8 per KV head, at most 16."""
    return min(8 * kv_heads, 16)


def _spread_shapes(cases):
    """Each case followed by ``(hq, hkv, dim, interleave, kv_layout)``: every 9
    consecutive cases take every head_dim x kv heads pair once."""
    return [(*case, _query_heads(KV_HEADS[i // 3 % 3]), KV_HEADS[i // 3 % 3],
             HEAD_DIMS[i % 3], INTERLEAVES[i // 2 % 3], ("HND", "NHD")[i % 2])
            for i, case in enumerate(cases)]


def _paged_prefix_cache(full, page_size):
    """Every request's whole K/V in one NHD paged cache on the GPU (bf16):
    ``((k_cache, v_cache), page ids of each request)``."""
    hkv, dim = full[0][0].shape[1:]
    pages = [-(-len(k) // page_size) for k, _ in full]
    k_flat, v_flat = (torch.zeros(sum(pages) * page_size, hkv, dim) for _ in range(2))
    tables, first = [], 0
    for (k, v), n in zip(full, pages):
        start = first * page_size
        k_flat[start:start + len(k)], v_flat[start:start + len(v)] = k, v
        tables.append(torch.arange(first, first + n))
        first += n
    cache = tuple(x.view(-1, page_size, hkv, dim).cuda().bfloat16() for x in (k_flat, v_flat))
    return cache, tables


def _pcp_rank_attention(wrapper, meta, q_local, cache, tables, page_size):
    """One PCP rank's local rows on FlashInfer's paged prefill, ``causal=True``, each
    row over its request's first ``seq_lens`` tokens. A rank without rows plans
    nothing and returns ``[0, Hq, D]``."""
    if meta.num_rows == 0:
        return q_local.new_empty(q_local.shape)
    hq, dim = q_local.shape[1:]
    seq_lens = meta.seq_lens.long()
    n_pages = (seq_lens + page_size - 1) // page_size
    indices = torch.cat([tables[req][:n] for req, n in
                         zip(meta.row_req_indices.tolist(), n_pages.tolist())])
    indptr = torch.cat([torch.zeros(1, dtype=torch.int64), n_pages.cumsum(0)])
    last = seq_lens - (n_pages - 1) * page_size
    wrapper.plan(meta.query_start_loc.cuda(), indptr.int().cuda(), indices.int().cuda(),
                 last.int().cuda(), hq, cache[0].shape[2], dim, page_size, causal=True,
                 sm_scale=1 / math.sqrt(dim), q_data_type=torch.bfloat16,
                 kv_data_type=torch.bfloat16)
    return wrapper.run(q_local, cache)


# N, head_dim, kv heads: every N with every head_dim and every kv head count once
PCP_KERNEL_CASES = [(world, dim, KV_HEADS[(i + j) % 3]) for i, world in enumerate((2, 3, 4, 8))
                    for j, dim in enumerate(HEAD_DIMS)]


def pcp_short_split_step(world):
    """A step at the split boundary of DCP = 1, 4N tokens: a fresh ``4N``-token chunk
    (split into two-token rows), a ``4N - 1`` token chunk over context (computed whole on
    every rank), a decode and a long chunk. ``(computed, scheduled)``."""
    return [0, 300, 12, 9], [4 * world, 4 * world - 1, 1, 517]


@pytest.mark.parametrize("world,dim,hkv", PCP_KERNEL_CASES)
def test_pcp_ranks_as_sequential_plans_on_one_gpu(world, dim, hkv):
    """-pcp N at DCP = 1, the N ranks planned one after the other on one wrapper, as
    vLLM's PCP manager splits the step: ``pcp_short_split_step`` and a step of decodes
    sharded over the ranks (``pcp_decode_policy shard``: the ranks past the decodes get
    no token, plan nothing and return no rows). Each rank's rows, placed by its local
    tokens, and their union over the ranks equal one GPU's attention for every token of
    the step."""
    import flashinfer

    from dcp_harness import expected_output, make_batch
    from helpers import pcp_step

    hq, page_size = _query_heads(hkv), 16
    wrapper = flashinfer.BatchPrefillWithPagedKVCacheWrapper(
        torch.empty(128 << 20, dtype=torch.uint8, device="cuda"), "NHD")
    decodes = ([40, 17][:world - 1], [1, 1][:world - 1])
    steps = [(*pcp_short_split_step(world), "replicate"), (*decodes, "shard")]
    for computed, scheduled, policy in steps:
        plans = pcp_step(computed, scheduled, world, decode_policy=policy).plans
        assert (min(p.num_local_tokens for p in plans) == 0) == (policy == "shard")
        full, q = make_batch(hq, hkv, dim, world * 1000 + dim, computed, scheduled)
        full = [(k.bfloat16().float(), v.bfloat16().float()) for k, v in full]
        q = q.bfloat16().float()
        cache, tables = _paged_prefix_cache(full, page_size)
        expect = expected_output(full, q, computed, scheduled)
        union = torch.full_like(expect, float("nan"))
        for meta in plans:
            local = meta.local_token_indices
            out = _pcp_rank_attention(wrapper, meta, q[local].cuda().bfloat16(), cache,
                                      tables, page_size).float().cpu()
            assert out.shape == (meta.num_local_tokens, hq, dim)
            torch.testing.assert_close(out, expect[local], **TOL)
            union[local] = out
        torch.testing.assert_close(union, expect, **TOL)


# (N, computed, scheduled, hq, hkv, dim, interleave, kv_layout): at N = 3, 4 and 8, steps
# of chunks at the split boundary of -dcp (2N tokens: one-token rows) beside chunks
# computed whole, decodes and long chunks
DCP_SHORT_STEPS = _spread_shapes(
    [(world, *step) for world in (3, 4, 8)
     for step in (short_split_step(world), ([1000, 1000, 1000], [2 * world] * 3),
                  ([0, 33], [2 * world, 2 * world - 1]))])


@pytest.mark.parametrize("world,computed,scheduled,hq,hkv,dim,interleave,kv_layout",
                         DCP_SHORT_STEPS)
@pytest.mark.parametrize("context_exchange", ["queries", "keys"])
def test_dcp_short_split_steps_on_flashinfer(world, computed, scheduled, hq, hkv, dim,
                                             interleave, kv_layout, context_exchange):
    """-pcp N -dcp N, split chunks of 2N tokens (one token per row on every rank) beside
    chunks one token shorter, computed whole: every rank restores one GPU's attention."""
    from dcp_harness import run_dcp_step

    assert dcp_plan(computed, scheduled, world, 0, interleave).pcp.is_split
    outs, expect = run_dcp_step(world, interleave, 2, "cuda", torch.bfloat16, hq=hq, hkv=hkv,
                                dim=dim, computed=computed, scheduled=scheduled,
                                kv_layout=kv_layout, context_exchange=context_exchange)
    for out in outs:
        torch.testing.assert_close(out.float(), expect, **TOL)


# (N, interleave, folded, hq, hkv, dim, kv_layout): decodes of 40, 17, 77, 300 tokens,
# folded unless some rank stores no token of a request (N = 8, interleave 8: 17 and 40)
DCP_DECODE_STEPS = [(3, 1, True, 8, 1, 64, "HND"), (3, 8, True, 16, 8, 256, "NHD"),
                    (8, 1, True, 16, 2, 128, "HND"), (8, 8, False, 16, 8, 64, "HND")]


@pytest.mark.parametrize("world,interleave,folded,hq,hkv,dim,kv_layout", DCP_DECODE_STEPS)
def test_dcp_decode_steps_at_three_and_eight_ranks_on_flashinfer(world, interleave, folded,
                                                                 hq, hkv, dim, kv_layout):
    from dcp_harness import run_dcp_step

    computed, scheduled = [40, 17, 77, 300], [1, 1, 1, 1]
    assert (dcp_plan(computed, scheduled, world, 0, interleave).decode is not None) == folded
    outs, expect = run_dcp_step(world, interleave, 2, "cuda", torch.bfloat16, hq=hq, hkv=hkv,
                                dim=dim, computed=computed, scheduled=scheduled,
                                kv_layout=kv_layout)
    for out in outs:
        torch.testing.assert_close(out.float(), expect, **TOL)
        assert torch.equal(out, outs[0])


@pytest.mark.parametrize("world,interleave,dim", [(2, 1, 128), (4, 8, 64), (3, 16, 256)])
def test_dcp_fetched_and_queried_context_in_one_step_on_flashinfer(world, interleave, dim):
    """A step whose split requests reach their context both ways: the one whose context
    another request may write in this step sends its queries, the other fetches its
    context with the new K/V."""
    from dcp_harness import run_dcp_step

    computed, scheduled = [64, 300, 80], [96, 200, 1]
    plan = dcp_plan(computed, scheduled, world, 0, interleave, context_exchange="keys")
    assert plan.ctx_gather is not None and plan.ctx_gather.req.tolist() == [0]
    assert set(plan.ctx_split.req.tolist()) == {1}
    outs, expect = run_dcp_step(world, interleave, 2, "cuda", torch.bfloat16, hq=16, hkv=2,
                                dim=dim, computed=computed, scheduled=scheduled,
                                kv_layout="HND", context_exchange="keys")
    for out in outs:
        torch.testing.assert_close(out.float(), expect, **TOL)
