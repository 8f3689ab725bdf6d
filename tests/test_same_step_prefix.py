"""Same-step prefix hits under -dcp: context that the step itself writes.

vLLM caches a request's blocks when it allocates them, so request B, scheduled beside
request A, can count as context tokens that A computes in the same step, on A's blocks.
The ``keys`` context exchange reads context from the cache before the step's cache
write; such a request must take the queries road. ``build_dcp_plan`` keeps every request
that ``context_maybe_written_in_step`` flags from fetching: a request is flagged when
another request of the step writes at positions inside its context (a superset of the
real hits, from the scheduler output alone).

One DCP step is emulated in the order of the plugin's layer (read the context, all-gather
it with the new K/V, write the cache, attend), with the plugin's plan, its
``DCPAttention`` on the reference kernels and its K/V exchange, over per-rank paged shards
whose blocks A and B share; outputs are compared with plain full attention.
"""
import math

import numpy as np
import pytest
import torch

import vllm_pcp.dcp.plan as plan_mod
from dcp_harness import dcp_plan, dcp_step
from helpers import ThreadGroup, restore
from reference import causal_attention
from test_dcp_attention_cpu import float32_flashinfer  # noqa: F401  (fixture)
from vllm_pcp.dcp.attention import DCPAttention
from vllm_pcp.dcp.layout import dcp_local_offset, dcp_owner
from vllm_pcp.dcp.plan import build_dcp_plan, context_maybe_written_in_step
from vllm_pcp.pcp.exchange import gather_kv

HQ, HKV, DIM, PAGE = 8, 2, 16, 8


def _write(cache, table_row, positions, keys, values, rank, world, interleave):
    """Write the tokens at ``positions`` that ``rank`` owns into its paged shard,
    at the slots vLLM's DCP slot mapping gives them."""
    mine = dcp_owner(positions, world, interleave) == rank
    offset = dcp_local_offset(positions[mine], world, interleave)
    page, slot = table_row[offset // PAGE].long(), offset % PAGE
    cache[0][page, slot], cache[1][page, slot] = keys[mine], values[mine]


def _shared_prefix_step(world, context_blocks):
    """Request A computes 2 blocks (and 5 tokens) after ``context_blocks`` blocks of
    context; request B, 30 new tokens, has a prefix hit on all of A's full blocks,
    those this step writes included. A block entry spans ``PAGE * world`` positions.

    Returns ``(computed, scheduled, written_before, table, kv, q)``: ``kv[r]`` is
    request r's whole ``(K, V)``, B's first ``computed[1]`` rows A's.
    """
    span = PAGE * world
    computed = [context_blocks * span, (context_blocks + 2) * span]
    scheduled = [2 * span + 5, 30]
    g = torch.Generator().manual_seed(world * 10 + context_blocks)
    k_a, v_a = (torch.randn(computed[0] + scheduled[0], HKV, DIM, generator=g)
                for _ in range(2))
    k_b, v_b = (torch.cat([x[:computed[1]], torch.randn(scheduled[1], HKV, DIM, generator=g)])
                for x in (k_a, v_a))
    shared, own_b = context_blocks + 2, -(-scheduled[1] // span)
    table = torch.zeros(2, 8, dtype=torch.int32)
    table[0, :shared + 1] = torch.arange(1, shared + 2)
    table[1, :shared] = table[0, :shared]
    table[1, shared:shared + own_b] = torch.arange(shared + 2, shared + 2 + own_b)
    written_before = [computed[0], computed[0]]  # B's other context is A's step
    q = torch.randn(sum(scheduled), HQ, DIM, generator=g)
    return computed, scheduled, written_before, table, [(k_a, v_a), (k_b, v_b)], q


def _expected(scheduled, kv, q):
    outs, start = [], 0
    for (k, v), s in zip(kv, scheduled):
        outs.append(causal_attention(q[start:start + s], k, v)[0])
        start += s
    return torch.cat(outs)


def _emulate_dcp_step(world, interleave, exchange, step_data):
    """Each rank's plan and restored output ``[T, HQ, DIM]`` for one DCP step."""
    computed, scheduled, written_before, table, kv, q = step_data
    k_step = torch.cat([k[c:] for (k, _), c in zip(kv, computed)])
    v_step = torch.cat([v[c:] for (_, v), c in zip(kv, computed)])
    positions = torch.cat([c + torch.arange(s) for c, s in zip(computed, scheduled)])
    req_of_token = torch.repeat_interleave(torch.arange(len(computed)),
                                           torch.tensor(scheduled))
    group = ThreadGroup(world)

    def rank_fn(rank):
        step = dcp_step(computed, scheduled, world, rank)
        plan = build_dcp_plan(step, interleave, context_exchange=exchange,
                              kv_to_q_heads=HKV / HQ)
        # the cache before the step: stale slots, then what earlier steps wrote
        stale = torch.Generator().manual_seed(rank)
        cache = tuple(torch.randn(int(table.max()) + 1, PAGE, HKV, DIM, generator=stale)
                      for _ in range(2))
        for r, ((k, v), n) in enumerate(zip(kv, written_before)):
            _write(cache, table[r], torch.arange(n), k[:n], v[:n], rank, world, interleave)
        attn = DCPAttention(torch.empty(0), HQ, HKV, DIM, PAGE, torch.float32,
                            1 / math.sqrt(DIM))
        planned = attn.plan(plan, table)
        pcp, local = plan.pcp, plan.pcp.local_token_indices
        context_rows = 0 if plan.ctx_gather is None else plan.ctx_gather.num_padded
        context = planned.read_context(cache)  # read before the write, as the layer does
        k_buf, v_buf = gather_kv(group.rank(rank), k_step[local], v_step[local],
                                 pcp.num_padded_tokens_per_rank, context, context_rows)
        padded = pcp.num_padded_tokens_per_rank
        rows = (pcp.restore_indices // padded * (padded + context_rows)
                + pcp.restore_indices % padded)
        for r in range(len(computed)):  # the cache write, from the exchange's buffer
            mine = req_of_token == r
            _write(cache, table[r], positions[mine], k_buf[rows[mine]], v_buf[rows[mine]],
                   rank, world, interleave)
        out = attn.run(planned, group.rank(rank), q[local], k_buf, v_buf, cache)
        return plan, restore(group.rank(rank), out, step)

    return group.run(rank_fn)


@pytest.mark.parametrize("world,interleave", [(2, 1), (2, 8), (4, 1), (4, 8)])
@pytest.mark.parametrize("context_blocks", [0, 1])
@pytest.mark.parametrize("exchange", ["keys", "queries", "auto"])
def test_same_step_prefix_hits_match_full_attention(float32_flashinfer, world, interleave,
                                                    context_blocks, exchange):
    """B's context blocks are A's, written in this step: B attends to what A writes,
    under every context exchange; A (context written earlier) may still fetch."""
    step = _shared_prefix_step(world, context_blocks)
    computed, scheduled, _, _, kv, q = step
    expect = _expected(scheduled, kv, q)
    a_rows, b_rows = slice(0, scheduled[0]), slice(scheduled[0], None)
    for plan, out in _emulate_dcp_step(world, interleave, exchange, step):
        torch.testing.assert_close(out[a_rows], expect[a_rows], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(out[b_rows], expect[b_rows], atol=1e-5, rtol=1e-5)
        fetched = [] if plan.ctx_gather is None else plan.ctx_gather.req.tolist()
        assert 1 not in fetched and 1 in plan.ctx_split.req.tolist()
        if exchange != "queries" and context_blocks:  # A's context was written earlier
            assert fetched == [0] and 0 not in plan.ctx_split.req.tolist()


def test_without_the_flags_keys_read_stale_context(float32_flashinfer, monkeypatch):
    """The emulation sees the fault: B fetching its context before A's write."""
    monkeypatch.setattr(plan_mod, "context_maybe_written_in_step",
                        lambda computed, scheduled: np.zeros(len(computed), dtype=bool))
    step = _shared_prefix_step(2, 1)
    _, scheduled, _, _, kv, q = step
    expect = _expected(scheduled, kv, q)
    for plan, out in _emulate_dcp_step(2, 1, "keys", step):
        assert plan.ctx_gather.req.tolist() == [0, 1]
        assert (out[scheduled[0]:] - expect[scheduled[0]:]).abs().max() > 0.1


def _written_in_context(computed, scheduled):
    """Brute force of ``context_maybe_written_in_step``: request i is flagged when another
    request writes a position of i's context ``[0, C_i)`` in this step (its positions
    ``[C_j, C_j + S_j)``), position by position."""
    writes = [set(range(c, c + s)) for c, s in zip(computed, scheduled)]
    return [any(writes[j] & set(range(computed[i])) for j in range(len(computed)) if j != i)
            for i in range(len(computed))]


def test_context_maybe_written_in_step_matches_the_positions_other_requests_write():
    rng = np.random.default_rng(0)
    for _ in range(300):
        num_reqs = int(rng.integers(0, 6))
        computed = rng.integers(0, 60, num_reqs) * rng.integers(0, 2, num_reqs)
        scheduled = rng.integers(0, 40, num_reqs) * (rng.random(num_reqs) < 0.9)
        got = context_maybe_written_in_step(computed, scheduled)
        assert got.dtype == bool and got.shape == (num_reqs,)
        assert got.tolist() == _written_in_context(computed.tolist(), scheduled.tolist()), (
            computed, scheduled)


def test_the_flags_of_some_steps():
    assert context_maybe_written_in_step([0, 32], [40, 5]).tolist() == [False, True]
    # n > 1: three samples of one prompt, the first computes it, the others hit it
    assert context_maybe_written_in_step([0, 32, 32], [33, 1, 1]).tolist() == [
        False, True, True]
    # equal contexts: no request writes inside another's
    assert context_maybe_written_in_step([64, 64], [8, 30]).tolist() == [False, False]
    # a request scheduling nothing writes nothing
    assert context_maybe_written_in_step([0, 32], [0, 5]).tolist() == [False, False]
    assert context_maybe_written_in_step([], []).tolist() == []


@pytest.mark.parametrize("exchange", ["keys", "auto"])
@pytest.mark.parametrize("world", [2, 3, 4])
def test_every_split_context_is_fetched_or_queried_never_both(exchange, world):
    """Random steps: on every rank each split request with context is in exactly one of
    the K/V gather and the query rows; a flagged one never fetches."""
    rng = np.random.default_rng(world)
    for _ in range(8):
        computed = rng.choice([0, 7, 45, 300, 2000], 5)
        scheduled = rng.integers(1, 80, 5)
        flags = context_maybe_written_in_step(computed, scheduled)
        for rank in range(world):
            plan = dcp_plan(computed, scheduled, world, rank, 4, context_exchange=exchange,
                            kv_to_q_heads=0.125)
            with_context = np.flatnonzero(plan.pcp.split.numpy() & (computed > 0))
            fetched = set() if plan.ctx_gather is None else set(plan.ctx_gather.req.tolist())
            queried = set(plan.ctx_split.req.tolist())
            assert not fetched & queried and fetched | queried == set(with_context.tolist())
            assert not fetched & set(np.flatnonzero(flags).tolist())


def test_auto_sizes_only_the_requests_that_may_fetch(monkeypatch):
    """A long flagged context does not push the step's other split chunk to queries."""
    computed, scheduled = [120_000, 16], [4096, 4096]  # 60,008 x 1/8 > 4,096 queries
    flagged = dcp_plan(computed, scheduled, 2, 0, 1, context_exchange="auto",
                       kv_to_q_heads=2 / 16)
    assert flagged.ctx_gather.req.tolist() == [1] and flagged.ctx_gather.num_padded == 8
    assert set(flagged.ctx_split.req.tolist()) == {0}
    monkeypatch.setattr(plan_mod, "context_maybe_written_in_step",
                        lambda computed, scheduled: np.zeros(len(computed), dtype=bool))
    unflagged = dcp_plan(computed, scheduled, 2, 0, 1, context_exchange="auto",
                         kv_to_q_heads=2 / 16)
    assert unflagged.ctx_gather is None  # sized with the long one: queries for both
