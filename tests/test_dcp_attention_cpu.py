"""DCPAttention's data movement on the CPU, with FlashInfer's kernels replaced by
the reference ones: every rank's output must equal one process's attention.

Two fakes: ``reference_flashinfer`` keeps FlashInfer 0.6.14's dtype contract
(16-bit attention outputs and merges: it builds no float32-output kernel), and
``float32_flashinfer`` lifts it, so that float32 inputs check the index logic
to 1e-5. ``float32_flashinfer_planning_no_empty_batch`` also refuses to plan a
batch of no rows, which a rank without local tokens (N >= 3) must not ask for."""
import sys
from types import SimpleNamespace

import pytest
import torch
import vllm.v1.attention.backends.flashinfer  # noqa: F401  (imported before the fakes)

from dcp_harness import (COMPUTED, SCHEDULED, ZERO_TOKEN_STEPS, ranks_without_tokens,
                         run_dcp_step, short_split_step)
import reference
from vllm_pcp.dcp.plan import build_dcp_plan


SIXTEEN_BIT = (torch.float16, torch.bfloat16)


class _Wrapper:
    """FlashInfer's contract as used here: ``out`` must have the planned
    ``o_data_type`` (default: the query dtype); results are written into it.
    ``plans_empty_batches`` False: ``plan`` refuses a batch of no rows."""
    dtypes = SIXTEEN_BIT
    plans_empty_batches = True

    def __init__(self, workspace, layout, backend="auto"):
        assert layout == "NHD" and backend == "auto"

    def _check_batch(self, qo_indptr):
        assert self.plans_empty_batches or len(qo_indptr) > 1, "a plan of no rows"

    def _plan_common(self, q_data_type, o_data_type=None, **kw):
        self.o_dtype = o_data_type or q_data_type
        assert self.o_dtype in self.dtypes, "FlashInfer 0.6.14 JIT: no such output dtype"

    def _finish(self, out, lse, into, return_lse, lse_into=None):
        assert into is not None and into.dtype == self.o_dtype, "out must be o_data_type"
        into.copy_(out)
        if lse_into is not None:  # FlashInfer checks shape, dtype and device only
            assert lse_into.shape == lse.shape and lse_into.dtype == torch.float32
            lse = lse_into.copy_(lse)
        return (into, lse) if return_lse else into


class _Ragged(_Wrapper):
    def plan(self, qo_indptr, kv_indptr, hq, hkv, dim, causal=False, **kw):
        self._check_batch(qo_indptr)
        self.qo, self.kv, self.causal = qo_indptr.cpu(), kv_indptr.cpu(), causal
        self._plan_common(**kw)

    def run(self, q, k, v, out=None, return_lse=False):
        o, lse = _rows(q, self.qo, lambda r: (k[self.kv[r]:self.kv[r + 1]],
                                              v[self.kv[r]:self.kv[r + 1]]), self.causal)
        return self._finish(o, lse, out, return_lse)


class _Paged(_Wrapper):
    def plan(self, qo_indptr, indptr, indices, last, hq, hkv, dim, page_size,
             causal=False, **kw):
        self._check_batch(qo_indptr)
        self.qo, self.indptr, self.indices = qo_indptr.cpu(), indptr.cpu(), indices.cpu()
        self.last, self.causal = last.cpu(), causal
        self._plan_common(**kw)

    def run(self, q, kv_cache, out=None, lse=None, return_lse=False):
        k_cache, v_cache = kv_cache

        def kv(r):
            pages = self.indices[self.indptr[r]:self.indptr[r + 1]].long()
            n = (len(pages) - 1) * k_cache.shape[1] + int(self.last[r])
            return (k_cache[pages].flatten(0, 1)[:n], v_cache[pages].flatten(0, 1)[:n])
        o, s = _rows(q, self.qo, kv, self.causal)
        return self._finish(o, s, out, return_lse, lse)


class _Decode(_Paged):
    """The decode wrapper: one query per row, no qo_indptr. With ``use_cuda_graph``
    the kernel reads the fixed index buffers when it runs, as a replayed graph does:
    whatever ``plan`` was given, the buffers must hold the step's indices."""

    def __init__(self, workspace, layout, use_tensor_cores=False, use_cuda_graph=False,
                 paged_kv_indptr_buffer=None, paged_kv_indices_buffer=None,
                 paged_kv_last_page_len_buffer=None):
        assert layout == "NHD" and use_tensor_cores
        self.is_cuda_graph_enabled = use_cuda_graph
        self.buffers = (paged_kv_indptr_buffer, paged_kv_indices_buffer,
                        paged_kv_last_page_len_buffer)

    # vLLM's fast_plan_decode calls plan() on a wrapper's first call only
    vllm_first_call = property(lambda self: True, lambda self, value: None)

    def plan(self, indptr, indices, last_page_len, num_qo_heads, num_kv_heads, head_dim,
             page_size, **kw):
        if self.is_cuda_graph_enabled:
            assert len(last_page_len) == len(self.buffers[2]), "batch size fixed by the graph"
        super().plan(torch.arange(len(indptr), dtype=torch.int32), indptr, indices,
                     last_page_len, num_qo_heads, num_kv_heads, head_dim, page_size,
                     causal=False, **kw)

    def run(self, q, kv_cache, out=None, lse=None, return_lse=False):
        if self.is_cuda_graph_enabled:
            assert len(q) == len(self.buffers[2])
            indptr = self.buffers[0].cpu()
            self.indptr, self.last = indptr, self.buffers[2].cpu()
            self.indices = self.buffers[1][: int(indptr[-1])].cpu()
        return super().run(q, kv_cache, out, lse, return_lse)


def _rows(q, qo, kv_of_row, causal):
    out = torch.zeros(q.shape)
    lse = torch.zeros(q.shape[:2])
    for r in range(len(qo) - 1):
        k, v = kv_of_row(r)
        o, s = reference.causal_attention(q[qo[r]:qo[r + 1]].float(), k.float(), v.float(),
                                          causal=causal)
        out[qo[r]:qo[r + 1]], lse[qo[r]:qo[r + 1]] = o, s
    return out, lse


def _merge(merge, dtypes):
    """FlashInfer's merge kernels: values of ``dtypes`` in, the same dtype out."""
    def run(v, *rest):
        assert v.dtype in dtypes, "merge kernels take 16-bit values"
        o, s = merge(v, *rest)
        return o.to(v.dtype), s
    return run


def _merge_in_place(merge, dtypes):
    """FlashInfer's ``merge_state_in_place(v, s, v_other, s_other)``: ``(v, s)`` updated."""
    def run(v, s, v_other, s_other):
        assert v.dtype in dtypes and s.dtype == torch.float32
        o, t = merge(v, s, v_other, s_other)
        v.copy_(o.to(v.dtype)), s.copy_(t)
    return run


def _fake_flashinfer(dtypes, plans_empty_batches=True):
    contract = {"dtypes": dtypes, "plans_empty_batches": plans_empty_batches}
    ragged = type("Ragged", (_Ragged,), contract)
    paged = type("Paged", (_Paged,), contract)
    decode = type("Decode", (_Decode,), contract)
    return SimpleNamespace(BatchPrefillWithRaggedKVCacheWrapper=ragged,
                           BatchPrefillWithPagedKVCacheWrapper=paged,
                           BatchDecodeWithPagedKVCacheWrapper=decode,
                           merge_state=_merge(reference.merge_state, dtypes),
                           merge_states=_merge(reference.merge_states, dtypes),
                           merge_state_in_place=_merge_in_place(reference.merge_state, dtypes))


@pytest.fixture
def reference_flashinfer(monkeypatch):
    monkeypatch.setitem(sys.modules, "flashinfer", _fake_flashinfer(SIXTEEN_BIT))


@pytest.fixture
def float32_flashinfer(monkeypatch):
    monkeypatch.setitem(sys.modules, "flashinfer",
                        _fake_flashinfer((*SIXTEEN_BIT, torch.float32)))


@pytest.fixture
def float32_flashinfer_planning_no_empty_batch(monkeypatch):
    """``float32_flashinfer`` whose wrappers refuse to plan a batch of no rows: a
    rank without local tokens must leave the kernels it has no rows for unplanned."""
    monkeypatch.setitem(sys.modules, "flashinfer",
                        _fake_flashinfer((*SIXTEEN_BIT, torch.float32),
                                         plans_empty_batches=False))


@pytest.mark.parametrize("world,interleave", [(2, 1), (2, 16), (4, 8)])
@pytest.mark.parametrize("min_split", [2, 16])
@pytest.mark.parametrize("context_exchange", ["queries", "keys"])
def test_dcp_attention_matches_one_process(float32_flashinfer, world, interleave, min_split,
                                           context_exchange):
    outs, expect = run_dcp_step(world, interleave, min_split, "cpu", torch.float32,
                                context_exchange=context_exchange)
    for out in outs:
        torch.testing.assert_close(out, expect, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("world,interleave", [(2, 1), (4, 8)])
@pytest.mark.parametrize("context_exchange", ["queries", "keys"])
def test_a_step_runs_in_every_layer(float32_flashinfer, world, interleave, context_exchange):
    """A planned step keeps its partial-state buffers from layer to layer: after two
    layers of other queries and K/V, a layer still gives one process's output."""
    outs, expect = run_dcp_step(world, interleave, 2, "cpu", torch.float32,
                                context_exchange=context_exchange, earlier_layers=2)
    for out in outs:
        torch.testing.assert_close(out, expect, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("world,interleave", [(2, 1), (4, 8)])
@pytest.mark.parametrize("context_exchange", ["queries", "keys"])
def test_bf16_partials_are_merged_by_flashinfer(reference_flashinfer, world, interleave,
                                                context_exchange):
    """bf16 model: partial states in bf16, merged by FlashInfer's 16-bit kernels."""
    outs, expect = run_dcp_step(world, interleave, 2, "cpu", torch.bfloat16,
                                context_exchange=context_exchange)
    for out in outs:
        assert out.dtype == torch.bfloat16
        torch.testing.assert_close(out.float(), expect, atol=3e-2, rtol=3e-2)


@pytest.mark.parametrize("world,interleave", [(2, 1), (2, 8), (4, 16)])
@pytest.mark.parametrize("computed,scheduled", [
    ([300, 12, 0], [64, 1, 40]),    # a long context next to its chunk, a decode, a fresh one
    ([5, 1000], [200, 33]),         # short and long contexts (ranks store unequal counts)
    ([17], [96])])                  # one request, a rank storing 1 token more
def test_fetched_context_matches_one_process(float32_flashinfer, world, interleave, computed,
                                             scheduled):
    """Split rows that all-gather their context K/V attend in the new-part call alone."""
    outs, expect = run_dcp_step(world, interleave, 2, "cpu", torch.float32,
                                computed=computed, scheduled=scheduled,
                                context_exchange="keys")
    for out in outs:
        torch.testing.assert_close(out, expect, atol=1e-5, rtol=1e-5)


def test_the_strict_fake_refuses_float32_like_flashinfer(reference_flashinfer):
    with pytest.raises(AssertionError, match="output dtype"):
        run_dcp_step(2, 8, 2, "cpu", torch.float32)


@pytest.mark.parametrize("computed,scheduled", [
    ([40, 1, 77], [1, 1, 1]),      # decode only: no split rows, no Q all-gather
    ([0, 0], [64, 9]),             # fresh prefills: no context anywhere
    ([3, 0], [1, 50])])            # a rank with no context tokens of request 0
def test_dcp_attention_steps_without_split_context(float32_flashinfer, computed, scheduled):
    outs, expect = run_dcp_step(2, 8, 2, "cpu", torch.float32, computed=computed,
                                scheduled=scheduled)
    for out in outs:
        torch.testing.assert_close(out, expect, atol=1e-5, rtol=1e-5)


FOLDED_DECODES = [([40, 17, 77, 300], [1, 1, 1, 1]), ([9], [1])]


@pytest.mark.parametrize("world,interleave", [(2, 1), (2, 8), (4, 1)])
@pytest.mark.parametrize("computed,scheduled", FOLDED_DECODES)
def test_decode_steps_attend_the_shard_once(float32_flashinfer, world, interleave, computed,
                                           scheduled):
    """One paged call per rank with the new token in its owner's shard, one packed
    all-gather, one merge: the same output as one process, on every rank."""
    from vllm_pcp.dcp.plan import build_dcp_plan

    assert build_dcp_plan(computed, scheduled, world, 0, interleave).decode is not None
    outs, expect = run_dcp_step(world, interleave, 2, "cpu", torch.float32,
                                computed=computed, scheduled=scheduled)
    for out in outs:
        torch.testing.assert_close(out, expect, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("world", [2, 4])
def test_decode_steps_in_bf16(reference_flashinfer, world):
    outs, expect = run_dcp_step(world, 1, 2, "cpu", torch.bfloat16,
                                computed=FOLDED_DECODES[0][0], scheduled=FOLDED_DECODES[0][1])
    for out in outs:
        assert out.dtype == torch.bfloat16
        torch.testing.assert_close(out.float(), expect, atol=3e-2, rtol=3e-2)
        torch.testing.assert_close(out, outs[0], atol=0, rtol=0)  # identical on every rank


@pytest.mark.parametrize("world,interleave", [(2, 8), (4, 1)])
@pytest.mark.parametrize("graph_rows", [4, 8])
def test_decode_steps_as_cuda_graphs(float32_flashinfer, world, interleave, graph_rows):
    """A decode step replaying a captured graph: the rows past the batch are padding,
    the kernel reads the fixed buffers, the batch's rows equal one process."""
    computed, scheduled = FOLDED_DECODES[0]
    outs, expect = run_dcp_step(world, interleave, 2, "cpu", torch.float32,
                                computed=computed, scheduled=scheduled, graph_rows=graph_rows)
    for out in outs:
        assert out.shape[0] == graph_rows
        torch.testing.assert_close(out[: len(computed)], expect, atol=1e-5, rtol=1e-5)


def test_graph_rows_are_for_decode_steps_only(float32_flashinfer):
    with pytest.raises(ValueError, match="pure decode"):
        run_dcp_step(2, 8, 2, "cpu", torch.float32, graph_rows=8)


TP_DCP_STEPS = [(None, None), FOLDED_DECODES[0], ([0, 0], [64, 9]), ([3, 0], [1, 50])]


@pytest.mark.parametrize("world,interleave", [(2, 1), (2, 8), (4, 16)])
@pytest.mark.parametrize("step", TP_DCP_STEPS)
def test_dcp_inside_tp_gathers_the_query_heads(float32_flashinfer, world, interleave, step):
    """-tp N -dcp N: every rank holds every token and hq / N query heads; its heads of
    the result equal one process's attention, whether the step folds or not."""
    computed, scheduled = step if step[0] is not None else (COMPUTED, SCHEDULED)
    outs, expect = run_dcp_step(world, interleave, 2, "cpu", torch.float32, computed=computed,
                                scheduled=scheduled, heads_gathered=True)
    torch.testing.assert_close(torch.cat(outs, dim=1), expect, atol=1e-5, rtol=1e-5)


def test_dcp_inside_tp_as_cuda_graphs(float32_flashinfer):
    computed, scheduled = FOLDED_DECODES[0]
    outs, expect = run_dcp_step(2, 8, 2, "cpu", torch.float32, computed=computed,
                                scheduled=scheduled, heads_gathered=True, graph_rows=8)
    torch.testing.assert_close(torch.cat(outs, dim=1)[: len(computed)], expect,
                               atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("world,interleave", [(2, 1), (2, 8), (4, 16)])
def test_context_rows_ride_in_the_kv_exchange_from_both_cache_layouts(float32_flashinfer, world,
                                                                      interleave):
    """The K/V context exchange reads each rank's shard from the paged cache: NHD
    ``[pages, page, Hkv, D]`` and HND ``[pages, Hkv, page, D]`` (Hopper's), K and V apart
    or packed in the last dim (vLLM's, read in one gather), give the same rows, every context token of the split requests once, in request order; one
    all-gather returns each rank's block as ``[P new rows | Pc context rows]``."""
    from dcp_harness import _paged_shard, make_batch
    from helpers import ThreadGroup
    from vllm_pcp.dcp.attention import PlannedDCPStep
    from vllm_pcp.dcp.index import context_slots
    from vllm_pcp.dcp.plan import build_dcp_plan
    from vllm_pcp.pcp.exchange import gather_kv
    from vllm_pcp.dcp.layout import dcp_owner

    computed, scheduled, page_size = [300, 0, 45], [64, 7, 30], 16
    full, _ = make_batch(8, 2, 16, 0, computed, scheduled)
    new_k = torch.randn(sum(scheduled), 2, 16)
    group = ThreadGroup(world)

    def rank_fn(rank):
        plan = build_dcp_plan(computed, scheduled, world, rank, interleave,
                              context_exchange="keys")
        cache, table = _paged_shard(full, rank, world, interleave, page_size, "cpu",
                                    torch.float32)
        contexts = []
        hnd = tuple(c.transpose(1, 2).contiguous() for c in cache)
        for layout, kv in (("NHD", cache), ("HND", hnd),  # then K|V packed, as vLLM's
                           ("NHD", torch.cat(cache, dim=-1).split(16, dim=-1)),
                           ("HND", torch.cat(hnd, dim=-1).split(16, dim=-1))):
            step = PlannedDCPStep(plan, kv_layout=layout,
                                  context_slots=context_slots(plan.ctx_gather, table,
                                                              page_size))
            contexts.append(step.read_context(kv))
        local = new_k[plan.pcp.local_token_indices]
        k_buf, v_buf = gather_kv(group.rank(rank), local, -local,
                                 plan.pcp.num_padded_tokens_per_rank, contexts[0],
                                 plan.ctx_gather.num_padded)
        return plan, contexts, k_buf, v_buf

    results = group.run(rank_fn)
    plan0 = results[0][0]
    padded, ctx_rows = plan0.pcp.num_padded_tokens_per_rank, plan0.ctx_gather.num_padded
    for plan, (nhd, hnd, *packed), k_buf, v_buf in results:
        assert torch.equal(nhd, hnd) and nhd.shape[1:] == (2, 2, 16)
        assert all(torch.equal(nhd, p) for p in packed)
        assert k_buf.shape == (world * (padded + ctx_rows), 2, 16)
        # every rank holds the same buffer; its padding rows are unset (may hold NaN)
        for mine, first in ((k_buf, results[0][2]), (v_buf, results[0][3])):
            torch.testing.assert_close(mine, first, rtol=0, atol=0, equal_nan=True)
    blocks_k = results[0][2].view(world, padded + ctx_rows, 2, 16)
    blocks_v = results[0][3].view(world, padded + ctx_rows, 2, 16)
    for rank in range(world):
        plan = results[rank][0]
        mine = plan.pcp.local_token_indices
        torch.testing.assert_close(blocks_k[rank, :len(mine)], new_k[mine])
        torch.testing.assert_close(blocks_v[rank, :len(mine)], -new_k[mine])
        start = padded
        for req in plan.ctx_gather.req.tolist():
            pos = torch.arange(computed[req])
            stored = pos[dcp_owner(pos, world, interleave) == rank]
            torch.testing.assert_close(blocks_k[rank, start:start + len(stored)],
                                       full[req][0][stored])
            torch.testing.assert_close(blocks_v[rank, start:start + len(stored)],
                                       full[req][1][stored])
            start += len(stored)
        assert start - padded == int(plan.ctx_gather.local_len.sum())


ZERO_TOKEN_CASES = [(world, *step) for world, steps in ZERO_TOKEN_STEPS.items()
                    for step in steps]


def ranks_without_split_tokens(computed, scheduled, world, min_split=2):
    """Ranks of N = ``world`` whose local tokens are the replicated ones alone."""
    from vllm_pcp.pcp.partition import build_pcp_metadata_all_ranks, split_requests

    split = split_requests(scheduled, min_split)
    replicated = sum(n for n, is_split in zip(scheduled, split) if not is_split)
    counts = build_pcp_metadata_all_ranks(computed, scheduled, world,
                                          min_split_tokens=min_split)[0].num_tokens_per_rank
    return [rank for rank, count in enumerate(counts) if count == replicated]


@pytest.mark.parametrize("world,computed,scheduled", ZERO_TOKEN_CASES)
@pytest.mark.parametrize("interleave", [1, 16])
@pytest.mark.parametrize("context_exchange", ["queries", "keys"])
def test_ranks_without_tokens_match_one_process(float32_flashinfer_planning_no_empty_batch,
                                                world, computed, scheduled, interleave,
                                                context_exchange):
    """N >= 3, a split step of few tokens: the ranks without tokens plan no kernel for
    rows they lack, still serve every collective (their shard's context, the other
    ranks' split queries) and restore the same output as one process."""
    assert ranks_without_tokens(computed, scheduled, world)
    outs, expect = run_dcp_step(world, interleave, 2, "cpu", torch.float32,
                                computed=computed, scheduled=scheduled,
                                context_exchange=context_exchange)
    for out in outs:
        torch.testing.assert_close(out, expect, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("world", [4, 8])
@pytest.mark.parametrize("context_exchange", ["queries", "keys"])
def test_ranks_with_only_replicated_rows_match_one_process(
        float32_flashinfer_planning_no_empty_batch, world, context_exchange):
    """The last 2 tokens of a long prompt beside a decode: the middle ranks hold the
    decode's row only, no split row."""
    computed, scheduled = [1000, 60], [2, 1]
    assert ranks_without_split_tokens(computed, scheduled, world)
    outs, expect = run_dcp_step(world, 8, 2, "cpu", torch.float32, computed=computed,
                                scheduled=scheduled, context_exchange=context_exchange)
    for out in outs:
        torch.testing.assert_close(out, expect, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("world,interleave", [(3, 1), (3, 8), (8, 1), (8, 16)])
@pytest.mark.parametrize("context_exchange", ["queries", "keys"])
def test_short_split_chunks_at_three_and_eight_ranks(float32_flashinfer, world, interleave,
                                                     context_exchange):
    computed, scheduled = short_split_step(world)
    outs, expect = run_dcp_step(world, interleave, 2, "cpu", torch.float32,
                                computed=computed, scheduled=scheduled,
                                context_exchange=context_exchange)
    for out in outs:
        torch.testing.assert_close(out, expect, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("world,interleave,folded", [(3, 1, True), (3, 8, True),
                                                     (8, 1, True), (8, 8, False)])
def test_decode_steps_at_three_and_eight_ranks(float32_flashinfer, world, interleave, folded):
    """Folded (every rank stores a token of every request) and replicated decodes."""
    from vllm_pcp.dcp.plan import build_dcp_plan

    computed, scheduled = FOLDED_DECODES[0]
    plan = build_dcp_plan(computed, scheduled, world, 0, interleave)
    assert (plan.decode is not None) == folded
    outs, expect = run_dcp_step(world, interleave, 2, "cpu", torch.float32,
                                computed=computed, scheduled=scheduled)
    for out in outs:
        torch.testing.assert_close(out, expect, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("context_exchange", ["queries", "keys"])
def test_ranks_without_tokens_in_bf16(reference_flashinfer, context_exchange):
    computed, scheduled = ZERO_TOKEN_STEPS[4][1]
    assert ranks_without_tokens(computed, scheduled, 4)
    outs, expect = run_dcp_step(4, 8, 2, "cpu", torch.bfloat16, computed=computed,
                                scheduled=scheduled, context_exchange=context_exchange)
    for out in outs:
        assert out.dtype == torch.bfloat16
        torch.testing.assert_close(out.float(), expect, atol=3e-2, rtol=3e-2)


@pytest.mark.parametrize("world,interleave", [(2, 1), (4, 8), (3, 16)])
def test_fetched_and_queried_context_in_one_step(float32_flashinfer, world, interleave):
    """Split requests reaching their context both ways in one step: one whose context
    this step writes (queries), the others fetched with the new K/V (keys)."""
    computed, scheduled = [300, 64, 0, 40], [96, 200, 50, 1]
    written = [False, True, False, False]
    plan = build_dcp_plan(computed, scheduled, world, 0, interleave, context_exchange="keys",
                          context_written_in_step=written)
    assert plan.ctx_gather.req.tolist() == [0] and set(plan.ctx_split.req.tolist()) == {1}
    outs, expect = run_dcp_step(world, interleave, 2, "cpu", torch.float32, hq=16, hkv=2,
                                computed=computed, scheduled=scheduled,
                                context_exchange="keys", context_written_in_step=written)
    for out in outs:
        torch.testing.assert_close(out, expect, atol=1e-5, rtol=1e-5)


def _torch_cache_write(self, layer, key, value, kv_cache, slot_mapping):
    """vLLM's FlashInfer cache write (``reshape_and_cache_flash``) in plain torch:
    row i of key/value to slot ``slot_mapping[i]``, -1 skipped."""
    k_cache, v_cache = kv_cache.transpose(1, 2).split(self.head_size, dim=-1)
    keep = slot_mapping >= 0
    slots = slot_mapping[keep]
    page = k_cache.shape[1]
    k_cache[slots // page, slots % page] = key[:len(slot_mapping)][keep]
    v_cache[slots // page, slots % page] = value[:len(slot_mapping)][keep]


@pytest.mark.parametrize("world,interleave,exchange", [
    (2, 1, "queries"), (2, 8, "keys"), (2, 16, "auto"), (3, 8, "keys"), (4, 8, "queries")])
def test_the_dcp_layer_gathers_writes_and_attends(float32_flashinfer, monkeypatch, world,
                                                  interleave, exchange):
    """The plugin's layer on a PCP x DCP step (``tests/layer_harness.py``): each rank's
    restored output is the one-process attention and its cache holds its own tokens."""
    import vllm.v1.attention.backends.flashinfer as vllm_flashinfer

    from layer_harness import run_dcp_layer_step

    monkeypatch.setattr(vllm_flashinfer, "can_use_trtllm_attention", lambda *a, **k: False)
    monkeypatch.setattr(vllm_flashinfer.FlashInferImpl, "do_kv_cache_update",
                        _torch_cache_write)
    results, expect = run_dcp_layer_step(monkeypatch, world, interleave, exchange, "cpu",
                                         torch.float32, hq=8, dim=16)
    for out, cache, expect_cache in results:
        torch.testing.assert_close(out, expect, atol=1e-5, rtol=1e-5)
        assert torch.equal(cache, expect_cache)
