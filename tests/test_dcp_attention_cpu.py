"""DCPAttention's data movement on the CPU, with FlashInfer's kernels replaced by the
reference ones (``tests/fake_flashinfer.py``): every rank's output, restored as vLLM
restores it, must equal one process's attention.

Two fakes: ``reference_flashinfer`` keeps FlashInfer's dtype contract (16-bit attention
outputs and merges: it builds no float32-output kernel), and ``float32_flashinfer`` lifts
it, so that float32 inputs check the index logic to 1e-5. Steps are split as vLLM's PCP
manager splits them under ``-pcp N -dcp N`` (``tests/dcp_harness.py``)."""
import pytest
import torch

import fake_flashinfer
from dcp_harness import dcp_plan, run_dcp_step, short_split_step


@pytest.fixture
def reference_flashinfer(monkeypatch):
    fake_flashinfer.install(monkeypatch, float32=False)


@pytest.fixture
def float32_flashinfer(monkeypatch):
    fake_flashinfer.install(monkeypatch, float32=True)


def _assert_all_close(outs, expect, tol=1e-5):
    for out in outs:
        torch.testing.assert_close(out.float(), expect, atol=tol, rtol=tol)


@pytest.mark.parametrize("world,interleave", [(2, 1), (2, 16), (4, 8)])
@pytest.mark.parametrize("min_split", [2, 16])
@pytest.mark.parametrize("context_exchange", ["queries", "keys"])
def test_dcp_attention_matches_one_process(float32_flashinfer, world, interleave, min_split,
                                           context_exchange):
    _assert_all_close(*run_dcp_step(world, interleave, min_split, "cpu", torch.float32,
                                    context_exchange=context_exchange))


@pytest.mark.parametrize("kv_layout", ["NHD", "HND"])
def test_both_cache_layouts(float32_flashinfer, kv_layout):
    """The paged kernels read the shard in the layout vLLM picked (HND on Hopper)."""
    _assert_all_close(*run_dcp_step(2, 8, 2, "cpu", torch.float32, kv_layout=kv_layout,
                                    context_exchange="keys"))


@pytest.mark.parametrize("world,interleave", [(2, 1), (4, 8)])
@pytest.mark.parametrize("context_exchange", ["queries", "keys"])
def test_a_step_runs_in_every_layer(float32_flashinfer, world, interleave, context_exchange):
    """A planned step keeps its partial-state buffers from layer to layer: after two
    layers of other queries and K/V, a layer still gives one process's output."""
    _assert_all_close(*run_dcp_step(world, interleave, 2, "cpu", torch.float32,
                                    context_exchange=context_exchange, earlier_layers=2))


@pytest.mark.parametrize("world,interleave", [(2, 1), (4, 8)])
@pytest.mark.parametrize("context_exchange", ["queries", "keys"])
def test_bf16_partials_are_merged_by_flashinfer(reference_flashinfer, world, interleave,
                                                context_exchange):
    """bf16 model: partial states in bf16, merged by FlashInfer's 16-bit kernels."""
    outs, expect = run_dcp_step(world, interleave, 2, "cpu", torch.bfloat16,
                                context_exchange=context_exchange)
    assert all(out.dtype == torch.bfloat16 for out in outs)
    _assert_all_close(outs, expect, 3e-2)


@pytest.mark.parametrize("world,interleave", [(2, 1), (2, 8), (4, 16)])
@pytest.mark.parametrize("computed,scheduled", [
    ([300, 12, 0], [64, 1, 40]),    # a long context next to its chunk, a decode, a fresh one
    ([5, 1000], [200, 33]),         # short and long contexts (ranks store unequal counts)
    ([17], [96])])                  # one request, a rank storing 1 token more
def test_fetched_context_matches_one_process(float32_flashinfer, world, interleave, computed,
                                             scheduled):
    """Split rows that all-gather their context K/V attend in the new-part call alone."""
    _assert_all_close(*run_dcp_step(world, interleave, 2, "cpu", torch.float32,
                                    computed=computed, scheduled=scheduled,
                                    context_exchange="keys"))


def test_the_strict_fake_refuses_float32_like_flashinfer(reference_flashinfer):
    with pytest.raises(AssertionError, match="output dtype"):
        run_dcp_step(2, 8, 2, "cpu", torch.float32)


@pytest.mark.parametrize("computed,scheduled", [
    ([40, 1, 77], [1, 1, 1]),      # decodes, one of a rank's shard empty: not folded
    ([0, 0], [64, 9]),             # fresh prefills: no context anywhere
    ([3, 0], [1, 50]),             # a rank with no context tokens of request 0
    ([0, 40], [50, 1])])           # a prefill before a decode: replicated rows out of order
def test_dcp_attention_steps_without_split_context(float32_flashinfer, computed, scheduled):
    _assert_all_close(*run_dcp_step(2, 8, 2, "cpu", torch.float32, computed=computed,
                                    scheduled=scheduled))


FOLDED_DECODES = [([40, 17, 77, 300], [1, 1, 1, 1]), ([9], [1])]


@pytest.mark.parametrize("world,interleave", [(2, 1), (2, 8), (4, 1)])
@pytest.mark.parametrize("computed,scheduled", FOLDED_DECODES)
def test_decode_steps_attend_the_shard_once(float32_flashinfer, world, interleave, computed,
                                           scheduled):
    """One paged call per rank with the new token in its owner's shard, one packed
    all-gather, one merge: the same output as one process, on every rank."""
    assert dcp_plan(computed, scheduled, world, 0, interleave).decode is not None
    _assert_all_close(*run_dcp_step(world, interleave, 2, "cpu", torch.float32,
                                    computed=computed, scheduled=scheduled))


@pytest.mark.parametrize("world", [2, 4])
def test_decode_steps_in_bf16(reference_flashinfer, world):
    outs, expect = run_dcp_step(world, 1, 2, "cpu", torch.bfloat16,
                                computed=FOLDED_DECODES[0][0], scheduled=FOLDED_DECODES[0][1])
    _assert_all_close(outs, expect, 3e-2)
    for out in outs:
        assert out.dtype == torch.bfloat16
        torch.testing.assert_close(out, outs[0], atol=0, rtol=0)  # identical on every rank


@pytest.mark.parametrize("world,interleave,folded", [(3, 1, True), (3, 8, True),
                                                     (8, 1, True), (8, 8, False)])
def test_decode_steps_at_three_and_eight_ranks(float32_flashinfer, world, interleave, folded):
    """Folded (every rank stores a token of every request) and replicated decodes, the
    latter with the step's K/V in step order (no exchange)."""
    computed, scheduled = FOLDED_DECODES[0]
    assert (dcp_plan(computed, scheduled, world, 0, interleave).decode is not None) == folded
    _assert_all_close(*run_dcp_step(world, interleave, 2, "cpu", torch.float32,
                                    computed=computed, scheduled=scheduled))


@pytest.mark.parametrize("world,interleave", [(3, 1), (3, 8), (8, 1), (8, 16)])
@pytest.mark.parametrize("context_exchange", ["queries", "keys"])
def test_short_split_chunks_at_three_and_eight_ranks(float32_flashinfer, world, interleave,
                                                     context_exchange):
    """Chunks of 2N tokens, split into one-token rows, beside a 2N - 1 token chunk that
    every rank computes whole."""
    computed, scheduled = short_split_step(world)
    assert dcp_plan(computed, scheduled, world, 0, interleave).pcp.split.tolist() == [
        True, False, False, True]
    _assert_all_close(*run_dcp_step(world, interleave, 2, "cpu", torch.float32,
                                    computed=computed, scheduled=scheduled,
                                    context_exchange=context_exchange))


@pytest.mark.parametrize("world,interleave", [(2, 1), (4, 8), (3, 16)])
def test_fetched_and_queried_context_in_one_step(float32_flashinfer, world, interleave):
    """Split requests reaching their context both ways in one step: the one with the
    shortest context fetches it with the new K/V, the one whose context the other may
    write in this step (``context_maybe_written_in_step``) sends its queries."""
    computed, scheduled = [64, 300, 80], [96, 200, 1]
    plan = dcp_plan(computed, scheduled, world, 0, interleave, context_exchange="keys")
    assert plan.ctx_gather.req.tolist() == [0] and set(plan.ctx_split.req.tolist()) == {1}
    _assert_all_close(*run_dcp_step(world, interleave, 2, "cpu", torch.float32, hq=16, hkv=2,
                                    computed=computed, scheduled=scheduled,
                                    context_exchange="keys"))


LAYER_STEPS = {  # (computed, scheduled): a split step, a folded decode, unfolded decodes
    "split": (None, None), "decode": ([40, 17, 77, 300], [1, 1, 1, 1]),
    "short-decode": ([15, 40], [1, 1])}


@pytest.mark.parametrize("world,interleave,exchange,kv_layout", [
    (2, 1, "queries", "NHD"), (2, 8, "keys", "HND"), (2, 16, "auto", "NHD"),
    (3, 8, "keys", "NHD"), (4, 8, "queries", "HND")])
@pytest.mark.parametrize("step", sorted(LAYER_STEPS))
def test_the_dcp_layer_gathers_writes_and_attends(float32_flashinfer, monkeypatch, world,
                                                  interleave, exchange, kv_layout, step):
    """The plugin's layer on a PCP x DCP step as vLLM's runner drives it
    (``tests/layer_harness.py``): each rank's output, restored by vLLM's manager, is the
    one-process attention, and its cache holds its own tokens, the step's included."""
    import vllm.v1.attention.backends.flashinfer as vllm_flashinfer

    from layer_harness import run_dcp_layer_step

    computed, scheduled = LAYER_STEPS[step]
    batch = {} if computed is None else dict(computed=computed, scheduled=scheduled)
    monkeypatch.setattr(vllm_flashinfer.FlashInferImpl, "do_kv_cache_update",
                        fake_flashinfer.torch_cache_write)
    results, expect = run_dcp_layer_step(monkeypatch, world, interleave, exchange, "cpu",
                                         torch.float32, hq=8, dim=16, kv_layout=kv_layout,
                                         **batch)
    for out, cache, expect_cache, pcp_step in results:
        assert pcp_step.gathered == (step == "split")
        torch.testing.assert_close(out, expect, atol=1e-5, rtol=1e-5)
        assert torch.equal(cache, expect_cache)


@pytest.mark.parametrize("world,interleave", [(2, 1), (2, 8), (4, 16)])
def test_context_rows_ride_in_the_kv_exchange_from_both_cache_layouts(world, interleave):
    """The K/V context exchange reads each rank's shard from the paged cache: NHD
    ``[pages, page, Hkv, D]`` and HND ``[pages, Hkv, page, D]`` (Hopper's), K and V apart
    or packed in the last dim (vLLM's, read in one gather), give the same rows, every
    context token of the split requests once, in request order; one all-gather returns
    each rank's block as ``[P new rows | Pc context rows]``."""
    from dcp_harness import _paged_shard, make_batch
    from helpers import ThreadGroup
    from vllm_pcp.dcp.attention import PlannedDCPStep
    from vllm_pcp.dcp.index import context_slots
    from vllm_pcp.dcp.layout import dcp_owner
    from vllm_pcp.pcp.exchange import gather_kv

    # equal contexts: none of them may be written in this step, all are fetched
    computed, scheduled, page_size = [45, 45, 45], [64, 7, 30], 16
    full, _ = make_batch(8, 2, 16, 0, computed, scheduled)
    new_k = torch.randn(sum(scheduled), 2, 16)
    group = ThreadGroup(world)

    def rank_fn(rank):
        plan = dcp_plan(computed, scheduled, world, rank, interleave, context_exchange="keys")
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
    assert plan0.ctx_gather.req.tolist() == ([0, 1, 2] if world == 2 else [0, 2])
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
