"""Pure properties of the PCP x DCP attention plan (numerics: test_dcp_attention_cpu.py,
test_distributed_cpu.py), on steps split as vLLM's PCP manager splits them under ``-pcp N
-dcp N`` (``tests/dcp_harness.py``: ``build_dcp_plan`` of the manager's step)."""
import numpy as np
import pytest
import torch

from dcp_harness import dcp_plan, dcp_step
from vllm_pcp.dcp.layout import dcp_local_seq_len

COMPUTED = [0, 37, 0, 5, 60, 21, 300]
SCHEDULED = [2, 90, 1, 200, 1, 3, 64]


@pytest.mark.parametrize("world,interleave", [(2, 1), (2, 16), (4, 8)])
def test_collective_sizes_match_on_every_rank(world, interleave):
    plans = [dcp_plan(COMPUTED, SCHEDULED, world, r, interleave, min_split=8)
             for r in range(world)]
    padded = plans[0].pcp.num_padded_tokens_per_rank
    rep_tokens = {len(p.ctx_replicated.query_index) for p in plans}
    assert len(rep_tokens) == 1  # the replicated all-gather has one size
    for p in plans:
        split = p.ctx_split
        # Every rank attends the same split queries (all ranks'), to its own shard.
        assert torch.equal(split.query_index, plans[0].ctx_split.query_index)
        assert (split.query_index < world * padded).all()
        expect = [int(dcp_local_seq_len(torch.tensor(COMPUTED[r]), p.dcp_rank, world,
                                        interleave)) for r in split.req.tolist()]
        assert split.kv_len.tolist() == expect


def test_context_rows_are_exactly_the_requests_with_context():
    plan = dcp_plan(COMPUTED, SCHEDULED, 2, 0, 1, min_split=8)
    with_context = {i for i, c in enumerate(COMPUTED) if c > 0}
    split = {i for i, s in enumerate(SCHEDULED) if s >= 8}
    assert set(np.flatnonzero(plan.pcp.split.numpy())) == split  # the manager's split
    assert set(plan.ctx_split.req.tolist()) == with_context & split
    assert set(plan.ctx_replicated.req.tolist()) == with_context - split
    # Split rows read the gathered buffer: one head and one tail chunk per request and rank.
    assert len(plan.ctx_split.req) == 2 * 2 * len(with_context & split)


@pytest.mark.parametrize("world", [2, 3, 4, 8])
def test_every_request_has_a_row_on_every_rank(world):
    """With ``-dcp`` the manager splits only chunks of at least 2N tokens and keeps
    decodes on every rank: every request of a step has a local row on every rank, which
    the builder reads its block table from (``PCPStep.first_local_row``)."""
    rng = np.random.default_rng(world)
    for _ in range(30):
        num_reqs = int(rng.integers(1, 6))
        computed = rng.integers(0, 400, num_reqs) * rng.integers(0, 2, num_reqs)
        scheduled = np.where(rng.random(num_reqs) < 0.3, 1, rng.integers(1, 6 * world,
                                                                         num_reqs))
        for rank in range(world):
            step = dcp_step(computed, scheduled, world, rank, int(rng.integers(2, 40)))
            first = step.first_local_row()
            assert (first >= 0).all(), (computed, scheduled, rank)
            assert (step.plan.row_req_indices.numpy()[first] == np.arange(num_reqs)).all()


def test_new_part_reads_the_steps_tokens_up_to_each_row_end():
    plan = dcp_plan(COMPUTED, SCHEDULED, 2, 1, 1, min_split=8)
    token_start = np.cumsum(SCHEDULED) - SCHEDULED
    indptr = plan.new_kv_indptr
    for j in range(plan.pcp.num_rows):
        req = int(plan.pcp.row_req_indices[j])
        kv = plan.new_kv_token_index[int(indptr[j]):int(indptr[j + 1])]
        new_len = int(plan.pcp.seq_lens[j]) - COMPUTED[req]
        assert kv.tolist() == list(range(token_start[req], token_start[req] + new_len))


def test_paged_kv_layout_lists_each_rows_pages():
    from vllm_pcp.dcp.index import kept_rows, paged_kv_layout, positions_in

    table = torch.tensor([[7, 8, 9], [3, 4, 5]], dtype=torch.int32)
    indptr, indices, last = paged_kv_layout(torch.tensor([17, 16]), table, 16)
    assert indptr.tolist() == [0, 2, 3]
    assert indices.tolist() == [7, 8, 3] and last.tolist() == [1, 16]
    plan = dcp_plan([5, 40], [1, 64], 4, 3, 8, min_split=8)
    # Rank 3 owns none of the 5 context tokens of request 0 (tokens 24..31 are its first).
    kept = kept_rows(plan.ctx_replicated)
    assert plan.ctx_replicated.kv_len.tolist() == [0] and len(kept.req) == 0
    assert positions_in(torch.tensor([4, 9, 2]), torch.tensor([2, 4])).tolist() == [2, 0]


@pytest.mark.parametrize("rows,expect", [
    ([4, 5, 6], slice(4, 7)), ([0], slice(0, 1)),  # one run of rows: a view
    ([0, 2, 3], None), ([3, 2, 1], None), ([1, 1, 2], None), ([], None),
    ([0, 2, 1, 3], None), ([5, 5, 7], None)])  # first and last as a run's, but not one
def test_rows_index_is_a_slice_only_for_one_run_of_rows(rows, expect):
    from vllm_pcp.dcp.index import rows_index

    got = rows_index(torch.tensor(rows, dtype=torch.int64), "cpu")
    if expect is not None:
        assert got == expect
    else:  # anything else stays an index, and reads the same rows
        assert isinstance(got, torch.Tensor) and got.tolist() == rows
    x = torch.arange(10) * 10
    assert x[got].tolist() == [10 * r for r in rows]


def test_a_mixed_step_reads_its_decode_rows_as_one_run():
    """Decodes first (vLLM's order), then a split chunk: the replicated rows, the
    decode call's queries and its partials are each one run of rows, so the layers
    read and write them as views (no gather or scatter kernels per layer)."""
    from vllm_pcp.dcp.index import positions_in, rows_index
    from vllm_pcp.dcp.plan import build_dcp_plan

    step = dcp_step([9000, 9001, 9002, 8192], [1, 1, 1, 8000], 2, 1, 8192,
                    prefill_lens=[9000, 9001, 9002, 16384],
                    is_prefilling=[False, False, False, True])
    assert step.plan.split.tolist() == [False, False, False, True]
    for context_exchange in ("keys", "queries"):
        plan = build_dcp_plan(step, 8, context_exchange=context_exchange, kv_to_q_heads=0.125)
        rep = plan.ctx_replicated.query_index
        assert rows_index(rep, "cpu") == slice(0, 3)
        assert rows_index(positions_in(rep, rep), "cpu") == slice(0, 3)


@pytest.mark.parametrize("world,interleave", [(2, 1), (2, 16), (4, 8)])
def test_decode_steps_fold_the_new_token_into_the_shard(world, interleave):
    # the first request's last rank owns exactly one token: the new one
    computed = [interleave * (world - 1), 40, 300]
    plans = [dcp_plan(computed, [1, 1, 1], world, r, interleave) for r in range(world)]
    for p in plans:
        d = p.decode
        assert d.query_index.tolist() == [0, 1, 2] and d.req.tolist() == [0, 1, 2]
        assert d.qo_indptr.tolist() == [0, 1, 2, 3] and (d.kv_len > 0).all()
        expect = dcp_local_seq_len(torch.tensor(computed) + 1, p.dcp_rank, world, interleave)
        assert d.kv_len.tolist() == expect.tolist()
        # a pure decode step attends the step's tokens, in order; no general plan
        assert p.num_local_tokens == 3 and p.pcp is None and p.ctx_split is None
    assert sum(p.decode.kv_len for p in plans).tolist() == [c + 1 for c in computed]


@pytest.mark.parametrize("computed,scheduled", [
    ([15, 40], [1, 1]),   # rank 1 owns none of request 0's 16 tokens
    ([40, 0], [1, 5]),    # a prefill in the step
    ([40], [2]),          # two tokens of one request (speculative decoding)
    ([], [])])            # nothing scheduled
def test_steps_that_cannot_fold_keep_the_general_plan(computed, scheduled):
    for rank in range(2):  # the same answer on every rank: the collectives differ
        assert dcp_plan(computed, scheduled, 2, rank, 16).decode is None


# a decode (its context longer than the others: it may be written in the step, but a
# decode is never split) and split chunks over equal contexts, which all may fetch
FETCHING = dict(computed=[37, 37, 60, 37, 37], scheduled=[90, 200, 1, 3, 64])


@pytest.mark.parametrize("world,interleave", [(2, 1), (2, 16), (4, 8)])
def test_fetched_context_rows_rebuild_each_context_in_order(world, interleave):
    """Each rank sends its shard's context tokens, request after request, padded to Pc;
    a split row's keys are then its whole context in order, then its new tokens."""
    from vllm_pcp.dcp.layout import dcp_local_offset, dcp_owner

    computed, scheduled = FETCHING["computed"], FETCHING["scheduled"]
    plans = [dcp_plan(computed, scheduled, world, r, interleave, context_exchange="keys")
             for r in range(world)]
    gathers = [p.ctx_gather for p in plans]
    split = np.flatnonzero(plans[0].pcp.split.numpy()).tolist()
    assert gathers[0].req.tolist() == split and 2 not in split
    assert len({g.num_padded for g in gathers}) == 1  # one all-gather size everywhere
    padded = gathers[0].num_padded
    blocks = []
    for rank, g in enumerate(gathers):  # what each rank sends: (request, position)
        sent = []
        for req, n in zip(g.req.tolist(), g.local_len.tolist()):
            pos = torch.arange(computed[req])
            mine = pos[dcp_owner(pos, world, interleave) == rank]
            assert torch.equal(dcp_local_offset(mine, world, interleave), torch.arange(n))
            sent += [(req, int(t)) for t in mine]
        blocks += sent + [None] * (padded - len(sent))
    step_tokens = sum(scheduled)
    starts = np.cumsum(scheduled) - scheduled
    for p in plans:
        assert len(p.ctx_split.query_index) == 0  # nothing left for the query exchange
        index, indptr = p.new_kv_token_index.numpy(), p.new_kv_indptr.numpy()
        for j, req in enumerate(p.pcp.row_req_indices.tolist()):
            keys = index[indptr[j]:indptr[j + 1]]
            fetched = [blocks[k - step_tokens] for k in keys if k >= step_tokens]
            if req in split:
                assert fetched == [(req, t) for t in range(computed[req])]
            else:
                assert fetched == []
            new = keys[len(fetched):]
            assert (new == starts[req] + np.arange(len(new))).all()


def test_auto_moves_keys_only_when_they_are_fewer_bytes():
    computed, scheduled = [4096], [4096]  # Pc = 2048 context rows, P = 2048 queries
    keys = dcp_plan(computed, scheduled, 2, 0, 1, context_exchange="auto",
                    kv_to_q_heads=2 / 16)
    assert keys.ctx_gather is not None and keys.ctx_gather.num_padded == 2048
    long_context = dcp_plan([120_000], [4096], 2, 0, 1, context_exchange="auto",
                            kv_to_q_heads=2 / 16)  # 60,000 x 1/8 > 2,048
    assert long_context.ctx_gather is None and len(long_context.ctx_split.query_index)
    mha = dcp_plan(computed, scheduled, 2, 1, 1, context_exchange="auto",
                   kv_to_q_heads=1.0)  # 2048 x 1 <= 2048: keys
    assert mha.ctx_gather is not None
    assert dcp_plan(computed, scheduled, 2, 0, 1, context_exchange="queries",
                    kv_to_q_heads=0.01).ctx_gather is None
    with pytest.raises(ValueError, match="context_exchange"):
        dcp_plan(computed, scheduled, 2, 0, 1, context_exchange="kv")


@pytest.mark.parametrize("world,interleave,exchange", [(2, 1, "keys"), (2, 8, "queries"),
                                                       (4, 16, "keys"), (3, 4, "keys")])
def test_gathered_index_reads_the_exchange_buffer_as_the_step_index_reads_step_order(
        world, interleave, exchange):
    """Every rank sends its local tokens' ids (and, fetching context, ids T + c of the
    context rows it stores) through the real K/V exchange; the buffer read at
    ``new_kv_gathered_index`` must give ``new_kv_token_index``."""
    from helpers import ThreadGroup
    from vllm_pcp.pcp.exchange import gather_kv

    computed, scheduled = [45, 45, 45, 45], [64, 7, 30, 1]
    num_tokens = sum(scheduled)
    group = ThreadGroup(world)

    def rank_fn(rank):
        plan = dcp_plan(computed, scheduled, world, rank, interleave,
                        context_exchange=exchange)
        ids = plan.pcp.local_token_indices.double().view(-1, 1, 1)
        context, rows = None, 0
        if plan.ctx_gather is not None:
            rows = plan.ctx_gather.num_padded
            n = int(plan.ctx_gather.local_len.sum())
            c = num_tokens + rank * rows + torch.arange(n, dtype=torch.float64)
            context = torch.stack((c, c), dim=1).view(n, 2, 1, 1)
        k_buf, _ = gather_kv(group.rank(rank), ids, ids, plan.pcp.num_padded_tokens_per_rank,
                             context, rows)
        return plan, k_buf.view(-1)

    for plan, buf in group.run(rank_fn):
        assert (exchange == "keys") == (plan.ctx_gather is not None)
        got = buf.index_select(0, plan.new_kv_gathered_index).long()
        assert torch.equal(got, plan.new_kv_token_index)


@pytest.mark.parametrize("world,dcp,policy", [(2, 2, "auto"), (3, 3, "auto"), (2, 1, "auto"),
                                              (3, 1, "shard"), (4, 1, "replicate")])
def test_the_harness_step_is_the_managers(world, dcp, policy):
    """The steps these tests plan (``helpers.pcp_step``) are the ones vLLM's partition
    with ``GQAPCPManager`` makes of the same batch: the same split on every rank, the
    same ``gathered``."""
    from helpers import pcp_settings, pcp_step
    from manager_harness import descriptor, global_batch, managers

    rng = np.random.default_rng(world * 10 + dcp)
    settings = pcp_settings(world, dcp, decode_policy=policy)
    for _ in range(10):
        num_reqs = int(rng.integers(1, 6))
        computed = rng.integers(0, 300, num_reqs) * rng.integers(0, 2, num_reqs)
        scheduled = np.where(computed > 0, rng.integers(1, 3, num_reqs),
                             rng.integers(1, 8 * world, num_reqs))
        ranks = managers(world, settings)
        for rank, manager in enumerate(ranks):
            step = manager.partition_batch(global_batch(computed, scheduled),
                                           descriptor()).pcp.step
            mine = pcp_step(computed, scheduled, world, rank, settings=settings)
            assert step.gathered == mine.gathered and step.pcp_rank == mine.pcp_rank
            for theirs, ours in zip(step.plans, mine.plans):
                for field in ("local_token_indices", "restore_indices", "seq_lens",
                              "row_req_indices", "split"):
                    assert torch.equal(getattr(theirs, field), getattr(ours, field))
