"""Same-step prefix hits under -dcp: context that the step itself writes.

vLLM 0.26.0 caches a request's blocks when it allocates them, so request B,
scheduled beside request A, can count as context tokens that A computes in the
same step, on A's blocks. The ``keys`` context exchange reads context from the
cache before the step's cache write; such a request must take the queries road.

One DCP step is emulated in the order of ``PCPFlashInferImpl.do_kv_cache_update``
(read the context, all-gather it with the new K/V, write the cache, attend),
with the plugin's plan, its ``DCPAttention`` on the reference kernels and its
K/V exchange, over per-rank paged shards whose blocks A and B share; outputs
are compared with plain full attention.
"""
import math
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from vllm.v1.worker.gpu_model_runner import GPUModelRunner

from helpers import ThreadGroup
from test_dcp_attention_cpu import float32_flashinfer  # noqa: F401  (fixture)
from test_runner_cpu import _make_runner
from vllm_pcp.dcp.attention import DCPAttention
from vllm_pcp.dcp.plan import build_dcp_plan
from vllm_pcp.dcp.prefix import context_written_in_step
from vllm_pcp.pcp.exchange import gather_kv, restore_hidden_states
from vllm_pcp.dcp.layout import dcp_local_offset, dcp_owner
from reference import causal_attention

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


def _expected(computed, scheduled, kv, q):
    outs, start = [], 0
    for (k, v), s in zip(kv, scheduled):
        outs.append(causal_attention(q[start:start + s], k, v)[0])
        start += s
    return torch.cat(outs)


def _emulate_dcp_step(world, interleave, exchange, step, use_flags=True):
    """Each rank's plan and restored output ``[T, HQ, DIM]`` for one DCP step."""
    computed, scheduled, written_before, table, kv, q = step
    flags = (context_written_in_step(computed, scheduled, table.numpy(), PAGE, world,
                                     interleave) if use_flags else None)
    k_step = torch.cat([k[c:] for (k, _), c in zip(kv, computed)])
    v_step = torch.cat([v[c:] for (_, v), c in zip(kv, computed)])
    positions = torch.cat([c + torch.arange(s) for c, s in zip(computed, scheduled)])
    req_of_token = torch.repeat_interleave(torch.arange(len(computed)),
                                           torch.tensor(scheduled))
    group = ThreadGroup(world)

    def rank_fn(rank):
        plan = build_dcp_plan(computed, scheduled, world, rank, interleave,
                              context_exchange=exchange, kv_to_q_heads=HKV / HQ,
                              context_written_in_step=flags)
        # the cache before the step: stale slots, then what earlier steps wrote
        stale = torch.Generator().manual_seed(rank)
        cache = tuple(torch.randn(int(table.max()) + 1, PAGE, HKV, DIM, generator=stale)
                      for _ in range(2))
        for r, ((k, v), n) in enumerate(zip(kv, written_before)):
            _write(cache, table[r], torch.arange(n), k[:n], v[:n], rank, world, interleave)
        attn = DCPAttention(torch.empty(0), HQ, HKV, DIM, PAGE, torch.float32,
                            1 / math.sqrt(DIM))
        step = attn.plan(plan, table)
        pcp, local = plan.pcp, plan.pcp.local_token_indices
        context_rows = 0 if plan.ctx_gather is None else plan.ctx_gather.num_padded
        context = step.read_context(cache)  # read before the write, as the backend does
        k_buf, v_buf = gather_kv(group.rank(rank), k_step[local], v_step[local],
                                 pcp.num_padded_tokens_per_rank, context, context_rows)
        padded = pcp.num_padded_tokens_per_rank
        rows = (pcp.restore_indices // padded * (padded + context_rows)
                + pcp.restore_indices % padded)
        for r in range(len(computed)):  # the cache write, from the exchange's buffer
            mine = req_of_token == r
            _write(cache, table[r], positions[mine], k_buf[rows[mine]], v_buf[rows[mine]],
                   rank, world, interleave)
        out = attn.run(step, group.rank(rank), q[local], k_buf, v_buf, cache)
        restored = restore_hidden_states(group.rank(rank), out.reshape(len(local), HQ * DIM),
                                         padded, pcp.restore_indices)
        return plan, restored.reshape(-1, HQ, DIM)

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
    expect = _expected(computed, scheduled, kv, q)
    a_rows, b_rows = slice(0, scheduled[0]), slice(scheduled[0], None)
    for plan, out in _emulate_dcp_step(world, interleave, exchange, step):
        torch.testing.assert_close(out[a_rows], expect[a_rows], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(out[b_rows], expect[b_rows], atol=1e-5, rtol=1e-5)
        fetched = [] if plan.ctx_gather is None else plan.ctx_gather.req.tolist()
        assert 1 not in fetched and 1 in plan.ctx_split.req.tolist()
        if exchange != "queries" and context_blocks:  # A's context was written earlier
            assert fetched == [0] and 0 not in plan.ctx_split.req.tolist()


def test_without_the_flags_keys_read_stale_context(float32_flashinfer):
    """The emulation sees the fault: B fetching its context before A's write."""
    step = _shared_prefix_step(2, 1)
    computed, scheduled, _, _, kv, q = step
    expect = _expected(computed, scheduled, kv, q)
    for plan, out in _emulate_dcp_step(2, 1, "keys", step, use_flags=False):
        assert plan.ctx_gather.req.tolist() == [0, 1]
        assert (out[scheduled[0]:] - expect[scheduled[0]:]).abs().max() > 0.1


@pytest.mark.parametrize("exchange", ["keys", "auto"])
@pytest.mark.parametrize("world", [2, 3, 4])
def test_every_split_context_is_fetched_or_queried_never_both(exchange, world):
    """Random flags: on every rank each split request with context is in exactly one
    of the K/V gather and the query rows; a flagged one never fetches."""
    rng = np.random.default_rng(world)
    computed, scheduled = [300, 0, 45, 7, 2000], [64, 7, 30, 1, 48]
    for _ in range(8):
        flags = rng.random(len(computed)) < 0.5
        for rank in range(world):
            plan = build_dcp_plan(computed, scheduled, world, rank, 4, context_exchange=exchange,
                                  kv_to_q_heads=0.125, context_written_in_step=flags)
            fetched = set() if plan.ctx_gather is None else set(plan.ctx_gather.req.tolist())
            queried = set(plan.ctx_split.req.tolist())
            assert not fetched & queried and fetched | queried == {0, 2, 4}
            assert not fetched & set(np.flatnonzero(flags).tolist())


def test_auto_sizes_only_the_requests_that_may_fetch():
    """A long flagged context no longer pushes the step's other split chunk to queries."""
    computed, scheduled = [120_000, 16], [4096, 4096]  # 60,008 x 1/8 > 4,096 queries
    unflagged = build_dcp_plan(computed, scheduled, 2, 0, 1, context_exchange="auto",
                               kv_to_q_heads=2 / 16)
    assert unflagged.ctx_gather is None
    flagged = build_dcp_plan(computed, scheduled, 2, 0, 1, context_exchange="auto",
                             kv_to_q_heads=2 / 16,
                             context_written_in_step=np.array([True, False]))
    assert flagged.ctx_gather.req.tolist() == [1] and flagged.ctx_gather.num_padded == 8
    assert set(flagged.ctx_split.req.tolist()) == {0}


SPAN = 16  # PAGE * 2 ranks: positions of one block-table entry


def _flags(computed, scheduled, table, world=2, interleave=1, block_size=PAGE):
    return context_written_in_step(computed, scheduled, np.array(table, np.int32),
                                   block_size, world, interleave).tolist()


def test_a_prefix_hit_on_blocks_the_step_writes():
    # B's two context blocks are A's first two, which A computes now
    assert _flags([0, 2 * SPAN], [2 * SPAN + 3, 5], [[1, 2, 3], [1, 2, 4]]) == [False, True]
    # n > 1: three samples of one prompt, the first computes it
    table = [[1, 2, 3], [1, 2, 4], [1, 2, 5]]
    assert _flags([0, 2 * SPAN, 2 * SPAN], [2 * SPAN + 1] + [1, 1], table) == [False, True, True]


def test_blocks_written_in_earlier_steps_are_no_hit():
    # A decodes past the shared blocks; B's context in them was written before
    assert _flags([3 * SPAN, 2 * SPAN], [1, 20], [[1, 2, 3, 0], [1, 2, 4, 5]]) == [False, False]
    # the same block ids elsewhere in the table rows: no sharing, no hit
    assert _flags([SPAN, SPAN], [SPAN, SPAN], [[1, 2, 0], [3, 4, 0]]) == [False, False]


def test_a_requests_own_boundary_block_is_no_hit():
    # context 5 and 10 new tokens in block 1: read and written by the request itself
    assert _flags([5], [10], [[1, 0]]) == [False]
    assert _flags([5, 0], [10, 4], [[1, 0], [2, 0]]) == [False, False]


def test_only_the_tested_requests_are_reported():
    table, computed, scheduled = [[1, 2, 3], [1, 2, 4], [1, 2, 5]], [0, SPAN, SPAN], [40, 9, 9]
    assert _flags(computed, scheduled, table) == [False, True, True]
    tested = np.array([True, False, True])
    assert context_written_in_step(computed, scheduled, np.array(table), PAGE, 2, 1,
                                   tested).tolist() == [False, False, True]


def test_an_empty_step_and_one_request():
    assert _flags([], [], np.zeros((0, 4))) == []
    assert _flags([40], [8], [[1, 2, 3, 4]]) == [False]


@pytest.mark.parametrize("world,interleave,block_size", [(1, 1, 16), (2, 1, 8), (2, 8, 8),
                                                         (4, 4, 8), (3, 2, 4), (2, 8, 4)])
def test_the_block_test_equals_a_per_token_one(world, interleave, block_size):
    """Random steps with shared blocks: a hit iff a context token of the request
    lies, on the rank that stores it, in a block where another request writes a
    token this step (token by token)."""
    rng = np.random.default_rng(world * 100 + interleave * 10 + block_size)
    span = block_size * world
    for _ in range(40):
        num_reqs = int(rng.integers(2, 5))
        computed = rng.integers(0, 4 * span, num_reqs)
        scheduled = rng.integers(1, 3 * span, num_reqs)
        blocks = -(-(computed + scheduled) // span) + 1
        table = np.zeros((num_reqs, int(blocks.max())), np.int32)
        for r in range(num_reqs):
            table[r, :blocks[r]] = 100 * (r + 1) + np.arange(blocks[r])
            donor = int(rng.integers(0, num_reqs))
            shared = min(int(rng.integers(0, 4)), blocks[r], blocks[donor])
            table[r, :shared] = table[donor, :shared]
        got = context_written_in_step(computed, scheduled, table, block_size, world,
                                      interleave)
        assert got.tolist() == _per_token_hits(computed, scheduled, table, block_size,
                                               world, interleave)


def _per_token_hits(computed, scheduled, table, block_size, world, interleave):
    def blocks(r, first, end):
        pos = torch.arange(int(first), int(end))
        entry = dcp_local_offset(pos, world, interleave) // block_size
        return {int(table[r, e]) for e in entry}

    written = [blocks(r, c, c + s) for r, (c, s) in enumerate(zip(computed, scheduled))]
    return [any(blocks(i, 0, computed[i]) & written[j] for j in range(len(computed)) if j != i)
            for i in range(len(computed))]


def _dcp_runner(monkeypatch, exchange, tables, computed, scheduled):
    """Rank 0 of -pcp 2 -dcp 2 (interleave 8, kernel block 16): a step of two
    requests with these block tables, one per KV cache group."""
    runner = _make_runner(ThreadGroup(2), 0)
    runner.pcp_dcp, runner.cp_kv_cache_interleave_size = True, 8
    runner.pcp_dcp_context_exchange = exchange
    runner.input_batch = SimpleNamespace(
        num_reqs=2, num_computed_tokens_cpu=np.array(computed, np.int32),
        num_prompt_tokens=np.array(computed, np.int32) + np.array(scheduled, np.int32),
        block_table=[SimpleNamespace(get_numpy_array=lambda t=t: np.array(t, np.int32),
                                     block_size=16) for t in tables])
    runner.kv_cache_config = SimpleNamespace(kv_cache_groups=[object()] * len(tables))
    monkeypatch.setattr(GPUModelRunner, "_prepare_inputs", lambda self, so, n: ("idx", None))
    runner._prepare_inputs(None, np.array(scheduled, np.int32))
    return runner._step.plan


# A (32 tokens of context in block 1) computes blocks 2 and 3; B hits blocks 1 and 2.
STEP = dict(computed=[32, 64], scheduled=[48, 20])
SHARED, UNSHARED = [[1, 2, 3, 0], [1, 2, 4, 0]], [[1, 2, 3, 0], [5, 6, 4, 0]]


@pytest.mark.parametrize("exchange", ["keys", "auto", "queries"])
def test_the_flags_reach_the_plan(monkeypatch, exchange):
    """B's split rows send their queries; A still fetches its context unless the
    knob says queries ("auto" fetches at 2 kv heads per 16 query heads)."""
    plan = _dcp_runner(monkeypatch, exchange, [SHARED], **STEP)
    fetched = [] if plan.ctx_gather is None else plan.ctx_gather.req.tolist()
    assert fetched == ([] if exchange == "queries" else [0])
    assert set(plan.ctx_split.req.tolist()) == ({0, 1} if exchange == "queries" else {1})
    control = _dcp_runner(monkeypatch, exchange, [UNSHARED], **STEP)
    if exchange != "queries":
        assert control.ctx_gather.req.tolist() == [0, 1]
        assert not len(control.ctx_split.query_index)


def test_steps_without_a_split_context_read_no_block_table(monkeypatch):
    """Decode steps (and splits without context) skip the test: no host time."""
    def unread():
        raise AssertionError("block table read")

    runner = _make_runner(ThreadGroup(2), 0)
    runner.pcp_dcp, runner.cp_kv_cache_interleave_size = True, 8
    runner.pcp_dcp_context_exchange = "keys"
    runner.input_batch.block_table = [SimpleNamespace(get_numpy_array=unread, block_size=16)]
    assert runner._context_written_in_step(np.array([30, 9]), np.array([1, 1]),
                                           np.array([30, 9])) is None
    assert runner._context_written_in_step(np.array([0, 9]), np.array([40, 1]),
                                           np.array([40, 9])) is None


def test_a_hit_in_any_kv_cache_group_counts(monkeypatch):
    plan = _dcp_runner(monkeypatch, "keys", [UNSHARED, SHARED], **STEP)
    assert plan.ctx_gather.req.tolist() == [0] and set(plan.ctx_split.req.tolist()) == {1}
