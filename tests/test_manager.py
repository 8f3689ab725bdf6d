"""GQAPCPManager on vLLM's own partition of a batch (CPU): what every rank runs, writes
and restores, against the global batch of one GPU."""
import numpy as np
import pytest
import torch

from tests.manager_harness import (SLOT_BASE, descriptor, global_batch, managers, settings,
                                   slot_mappings)
from vllm_pcp.pcp.partition import split_requests


def _random_step(rng):
    """Decodes first (vLLM's batch order), then prefills: fresh, continued, short."""
    num_reqs = int(rng.integers(1, 7))
    decodes = int(rng.integers(0, num_reqs + 1))
    computed = [int(rng.integers(1, 300)) for _ in range(decodes)]
    scheduled = [1] * decodes
    for _ in range(num_reqs - decodes):
        computed.append(int(rng.integers(0, 2)) * int(rng.integers(1, 300)))
        scheduled.append(int(rng.integers(1, 200)))
    return np.array(computed), np.array(scheduled)


def _run(pcp, s, computed, scheduled, prefill_lens=None, padded=None):
    batch = global_batch(computed, scheduled, prefill_lens)
    ranks = managers(pcp, s)
    locals_ = [m.partition_batch(batch, descriptor(padded)) for m in ranks]
    return batch, ranks, locals_


CASES = [(seed, pcp, policy) for seed in range(25) for pcp in (2, 3, 4)
         for policy in ("replicate", "shard")]


@pytest.mark.parametrize("seed,pcp,policy", CASES)
def test_every_rank_runs_its_rows_and_the_restore_gives_the_global_batch(seed, pcp, policy):
    rng = np.random.default_rng(seed)
    computed, scheduled = _random_step(rng)
    s = settings(pcp, min_split_tokens=int(rng.integers(2, 120)), policy=policy)
    batch, ranks, locals_ = _run(pcp, s, computed, scheduled)
    padded = locals_[0].num_tokens_after_padding
    hidden = []
    for local in locals_:  # every rank runs the same number of rows
        assert local.num_tokens_after_padding == padded
        n = local.num_tokens
        assert not local.is_padding[:n].any() and local.is_padding[n:].all()
        ids = local.input_ids.clone()
        hidden.append(ids)
        # each row's tokens are consecutive positions of its request, ending at seq_len
        qsl = local.query_start_loc_np
        for row in range(local.num_reqs):
            pos = local.positions[qsl[row]:qsl[row + 1]]
            if len(pos):
                assert int(local.seq_lens[row]) == int(pos[-1]) + 1
                assert torch.equal(pos, torch.arange(int(pos[0]), int(pos[-1]) + 1))
    step = locals_[0].pcp.step
    if ranks[0]._hidden_restore_idx is None:  # every rank computed the whole batch
        assert not step.gathered
        for ids in hidden:
            assert torch.equal(ids[:batch.num_tokens], batch.input_ids)
    else:
        gathered = torch.cat(hidden)
        for m in ranks:
            assert torch.equal(gathered[m._hidden_restore_idx], batch.input_ids)


@pytest.mark.parametrize("seed,pcp,policy", CASES[::3])
def test_each_token_is_written_once_from_the_rows_gathered(seed, pcp, policy):
    rng = np.random.default_rng(100 + seed)
    computed, scheduled = _random_step(rng)
    s = settings(pcp, min_split_tokens=int(rng.integers(2, 120)), policy=policy)
    batch, ranks, locals_ = _run(pcp, s, computed, scheduled)
    slots = [slot_mappings(m, batch) for m in ranks]
    if not locals_[0].pcp.step.gathered:  # each rank writes its own copy of every token
        for m, local, slot in zip(ranks, locals_, slots):
            assert len(slot) == local.num_tokens_after_padding
            assert torch.equal(slot[:batch.num_tokens], SLOT_BASE + torch.arange(batch.num_tokens))
            assert (slot[batch.num_tokens:] == -1).all()
        return
    ids = torch.cat([local.input_ids for local in locals_])  # the K/V all-gather
    for slot in slots:
        assert torch.equal(slot, slots[0])  # every rank writes the same slots
        written = slot >= 0
        tokens = slot[written] - SLOT_BASE
        assert torch.equal(torch.sort(tokens).values, torch.arange(batch.num_tokens))
        assert torch.equal(ids[written], batch.input_ids[tokens])


def test_a_long_prompt_is_split_in_every_chunk_and_a_short_one_is_not():
    s = settings(2, min_split_tokens=1000)
    # a 3000-token prompt whose second 512-token chunk is scheduled, beside a 600-token
    # prompt and a decode
    computed, scheduled, prompts = [40, 512, 0], [1, 512, 600], [30, 3000, 600]
    batch, ranks, locals_ = _run(2, s, computed, scheduled, prompts)
    step = locals_[0].pcp.step
    assert step.plan.split.tolist() == [False, True, False]
    assert step.gathered
    # rank r: the decode, chunks r and 3 - r of the long prompt, the short prompt
    assert locals_[0].num_scheduled_tokens.tolist() == [1, 128, 128, 600]
    assert locals_[1].num_scheduled_tokens.tolist() == [1, 128, 128, 600]
    assert locals_[0].num_computed_tokens_np.tolist() == [40, 512, 512 + 384, 0]
    assert locals_[1].num_computed_tokens_np.tolist() == [40, 512 + 128, 512 + 256, 0]


def test_a_chunk_whose_rows_would_be_decodes_is_not_split():
    s = settings(2)  # at DCP = 1 every row of a split chunk keeps two tokens or more
    assert not split_requests([7], s.min_split_tokens, [4000], s.min_chunk_tokens)[0]
    assert split_requests([8], s.min_split_tokens, [4000], s.min_chunk_tokens)[0]


def test_shard_gives_each_decode_one_rank_and_replicate_keeps_decode_steps_local():
    computed, scheduled = [10, 20, 30], [1, 1, 1]
    _, ranks, locals_ = _run(2, settings(2, policy="shard"), computed, scheduled)
    assert [local.num_tokens for local in locals_] == [2, 1]
    assert locals_[0].pcp.step.gathered
    _, ranks, locals_ = _run(2, settings(2), computed, scheduled)
    assert [local.num_tokens for local in locals_] == [3, 3]
    assert not locals_[0].pcp.step.gathered and ranks[0]._hidden_restore_idx is None


def test_a_rank_without_decodes_runs_one_empty_row():
    _, _, locals_ = _run(2, settings(2, policy="shard"), [10], [1])
    assert locals_[1].num_tokens == 0 and locals_[1].num_reqs == 1
    assert locals_[1].num_tokens_after_padding == 1


@pytest.mark.parametrize("policy", ["replicate", "shard"])
def test_dispatch_bounds_every_rank_of_the_step(policy):
    rng = np.random.default_rng(7)
    for _ in range(50):
        pcp = int(rng.integers(2, 5))
        s = settings(pcp, min_split_tokens=int(rng.integers(2, 400)), policy=policy)
        computed, scheduled = _random_step(rng)
        prompts = np.add(computed, scheduled) + rng.integers(0, 400, len(scheduled))
        batch = global_batch(computed, scheduled, prompts)
        bound = managers(pcp, s)[0].get_num_tokens_for_dispatch(
            batch.num_scheduled_tokens, batch.is_prefilling_np)
        _, _, locals_ = _run(pcp, s, computed, scheduled, prompts)
        assert bound >= max(local.num_tokens for local in locals_)


def test_a_cuda_graph_size_pads_every_rank():
    _, ranks, locals_ = _run(2, settings(2), [0], [64], padded=48)
    assert [local.num_tokens_after_padding for local in locals_] == [48, 48]
    assert ranks[0]._padded_gather_idx.shape[0] == 96
