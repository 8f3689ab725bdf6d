"""Property tests of the DualChunkSwap partition against brute-force checks."""
import numpy as np
import pytest
import torch

from vllm_pcp.pcp.partition import (build_pcp_metadata, build_pcp_metadata_all_ranks,
                                    decode_owners, min_chunk_tokens, split_requests)


def _random_batch(rng, max_len=5000, max_reqs=6):
    num_reqs = int(rng.integers(1, max_reqs + 1))
    computed, scheduled = [], []
    for _ in range(num_reqs):
        kind = rng.integers(0, 4)
        if kind == 0:  # decode
            computed.append(int(rng.integers(1, max_len)))
            scheduled.append(1)
        elif kind == 1:  # chunked-prefill continuation / prefix-cache hit
            computed.append(int(rng.integers(1, max_len)))
            scheduled.append(int(rng.integers(1, max_len)))
        else:  # fresh prompt
            computed.append(0)
            scheduled.append(int(rng.integers(1, max_len)))
    return computed, scheduled


def _all_ranks(computed, scheduled, world, **kw):
    return [build_pcp_metadata(computed, scheduled, world, r, **kw) for r in range(world)]


def _global_positions(computed, scheduled):
    return np.concatenate([c + np.arange(s) for c, s in zip(computed, scheduled)])


BATCHES = [(seed, world) for seed in range(40) for world in (2, 3, 4, 8)]


def _is_prefilling(computed, scheduled):
    """vLLM's is_prefilling of ``_random_batch``: its one-token steps over context decode."""
    return ~((np.asarray(scheduled) == 1) & (np.asarray(computed) > 0))


@pytest.mark.parametrize("seed,world", BATCHES)
@pytest.mark.parametrize("variant", ["step", "by_prompt", "shard", "padded"])
def test_every_token_owned_once_and_restored(seed, world, variant):
    """Whatever is split, replicated or sharded, and however far every rank is padded,
    each token is kept in exactly one gathered row and restored from it."""
    rng = np.random.default_rng(seed)
    computed, scheduled = _random_batch(rng)
    kw = {}
    if variant == "by_prompt":  # prompts longer than this step's part: some split
        kw = dict(min_split_tokens=3000, prefill_lens=np.add(computed, scheduled)
                  + rng.integers(0, 3000, len(scheduled)))
    elif variant == "shard":  # decodes on one rank each, chunks below 4N on every rank
        kw = dict(shard_decodes=True, is_prefilling=_is_prefilling(computed, scheduled),
                  min_chunk_tokens=4 * world)
    metas = _all_ranks(computed, scheduled, world, **kw)
    if variant == "padded":  # a CUDA graph's size: more rows per rank than any needs
        padded = metas[0].num_padded_tokens_per_rank + int(rng.integers(1, 50))
        metas = build_pcp_metadata_all_ranks(computed, scheduled, world,
                                             num_padded_tokens_per_rank=padded)
    num_tokens = sum(scheduled)
    padded = metas[0].num_padded_tokens_per_rank
    for m in metas:  # every collective size is the same on every rank
        assert m.num_padded_tokens_per_rank == padded >= max(m.num_tokens_per_rank)
        assert (padded == max(m.num_tokens_per_rank)) == (variant != "padded")
        assert len(m.gathered_token_indices) == world * padded
        assert len(m.model_input_indices) == padded
        assert m.num_tokens_per_rank == metas[0].num_tokens_per_rank
        assert torch.equal(m.restore_indices, metas[0].restore_indices)
        assert torch.equal(m.gathered_token_indices, metas[0].gathered_token_indices)
        assert m.num_local_tokens == len(m.local_token_indices)
    # Owned exactly once: each token is kept in exactly one gathered row.
    kept = metas[0].gathered_token_indices
    kept = kept[kept >= 0]
    assert torch.equal(torch.sort(kept).values, torch.arange(num_tokens))
    # Gather then restore is the identity on token values.
    values = torch.arange(num_tokens) * 10 + 7
    gathered = torch.full((world * padded,), -1, dtype=torch.long)
    for r, m in enumerate(metas):
        gathered[r * padded: r * padded + m.num_local_tokens] = values[m.local_token_indices]
    assert torch.equal(gathered[metas[0].restore_indices], values)
    keep = metas[0].gathered_token_indices >= 0
    assert torch.equal(gathered[keep], values[metas[0].gathered_token_indices[keep]])


@pytest.mark.parametrize("seed,world", BATCHES)
def test_rows_have_absolute_positions_and_causal_lengths(seed, world):
    rng = np.random.default_rng(1000 + seed)
    computed, scheduled = _random_batch(rng)
    positions = _global_positions(computed, scheduled)
    req_of_token = np.repeat(np.arange(len(scheduled)), scheduled)
    for m in _all_ranks(computed, scheduled, world):
        qsl = m.query_start_loc.numpy()
        local = m.local_token_indices.numpy()
        q_lens = np.diff(qsl)
        assert (q_lens > 0).all()
        assert (np.diff((q_lens > 1).astype(int)) >= 0).all()  # short rows first
        assert m.num_decode_rows == int((q_lens <= 1).sum())
        for row in range(m.num_rows):
            toks = local[qsl[row]: qsl[row + 1]]
            req = int(m.row_req_indices[row])
            assert (req_of_token[toks] == req).all()
            # The row's query tokens are the last q_len tokens of its KV span.
            expect = int(m.seq_lens[row]) - q_lens[row] + np.arange(q_lens[row])
            assert np.array_equal(positions[toks], expect)


@pytest.mark.parametrize("world", [2, 3, 4, 8])
@pytest.mark.parametrize("seed", range(10))
def test_attention_work_is_balanced(world, seed):
    rng = np.random.default_rng(2000 + seed)
    num_reqs = int(rng.integers(1, 4))
    scheduled = [int(rng.integers(64 * world, 5000 + 64 * world)) for _ in range(num_reqs)]
    computed = [int(rng.choice([0, rng.integers(1, 3000)])) for _ in range(num_reqs)]
    work = []
    for m in _all_ranks(computed, scheduled, world):
        q_lens = (m.query_start_loc[1:] - m.query_start_loc[:-1]).long()
        kv_end = m.seq_lens.long()
        # sum over query tokens of their causal KV length
        work.append(int((q_lens * kv_end - q_lens * (q_lens - 1) // 2).sum()))
    work = np.array(work, dtype=float)
    assert (work.max() - work.min()) / work.mean() <= 0.10, work


def test_dual_chunk_swap_layout():
    # 16 tokens, N = 2: chunks of 4; rank 0 owns c0 and c3, rank 1 owns c1 and c2.
    m0, m1 = _all_ranks([0], [16], 2)
    assert m0.local_token_indices.tolist() == [0, 1, 2, 3, 12, 13, 14, 15]
    assert m1.local_token_indices.tolist() == [4, 5, 6, 7, 8, 9, 10, 11]
    assert m0.seq_lens.tolist() == [4, 16] and m1.seq_lens.tolist() == [8, 12]
    assert m0.num_padded_tokens_per_rank == 8
    assert m0.restore_indices.tolist() == [0, 1, 2, 3, 8, 9, 10, 11,
                                           12, 13, 14, 15, 4, 5, 6, 7]


def test_short_prompt_gives_one_token_chunks_and_empty_ranks():
    # 3 tokens over N = 4 -> 8 chunks, most of them empty.
    metas = _all_ranks([0], [3], 4)
    counts = [m.num_local_tokens for m in metas]
    # chunk bounds floor(k * 3 / 8): tokens sit in chunks 2, 5 and 7.
    assert counts == [1, 0, 2, 0]
    assert metas[0].num_padded_tokens_per_rank == 2
    empty = metas[counts.index(0)]
    assert empty.num_rows == 0 and empty.query_start_loc.tolist() == [0]
    assert empty.max_query_len == 0


def test_decodes_and_short_prefills_are_replicated():
    computed, scheduled = [40, 7, 0], [1, 1, 5]
    metas = _all_ranks(computed, scheduled, 2, min_split_tokens=6)
    for m in metas:
        assert not m.is_split
        assert m.local_token_indices.tolist() == list(range(7))
        assert m.num_decode_rows == 2 and m.num_decode_tokens == 2
    # Rank 0's copy is the kept one.
    assert metas[0].restore_indices.tolist() == list(range(7))
    assert (metas[0].gathered_token_indices[7:] == -1).all()


def test_the_prompt_length_decides_what_is_split():
    # decode of a long prompt, a 40-token chunk of one, a short prompt, a 1-token chunk
    scheduled, prompts = [1, 40, 4000, 1], [20000, 20000, 4000, 9000]
    assert split_requests(scheduled, 8192, prompts).tolist() == [False, True, False, False]
    # without prompt lengths the step's tokens decide; below 2 acts as 2
    assert split_requests(scheduled, 8192).tolist() == [False, False, False, False]
    assert split_requests([1, 2, 3], 0).tolist() == [False, True, True]
    metas = _all_ranks([0, 8000], [4000, 40], 2, min_split_tokens=8192,
                       prefill_lens=[4000, 20000])
    assert [m.num_split_requests for m in metas] == [1, 1]
    assert metas[0].num_local_tokens == metas[1].num_local_tokens == 4000 + 20


def test_chunked_continuation_keeps_kv_offsets():
    m0, m1 = _all_ranks([100], [8], 2)
    assert m0.seq_lens.tolist() == [102, 108]
    assert m1.seq_lens.tolist() == [104, 106]


def test_mixed_batch_puts_short_rows_first():
    # A decode, then a 5-token prompt over N = 2 (chunks 1, 1, 1, 2).
    m0 = build_pcp_metadata([9, 0], [1, 5], 2, 0)
    q_lens = (m0.query_start_loc[1:] - m0.query_start_loc[:-1]).tolist()
    assert q_lens == [1, 1, 2]
    assert m0.row_req_indices.tolist() == [0, 1, 1]
    assert m0.num_decode_rows == 2


def test_rejects_bad_input():
    with pytest.raises(ValueError):
        build_pcp_metadata([0], [4], 2, 2)
    with pytest.raises(ValueError):
        build_pcp_metadata([0, 1], [4], 2, 0)
    with pytest.raises(ValueError):
        build_pcp_metadata([0], [-1], 2, 0)


@pytest.mark.parametrize("seed,world", BATCHES[::4])
def test_shard_decodes_puts_each_decode_on_one_rank(seed, world):
    """``shard_decodes``: the i-th decode of the step (a request past its prefill that is
    not split) is computed by rank ``i % N`` alone, and restored from it; unsplit prefills
    stay on every rank, restored from rank 0; split requests are split as without it."""
    rng = np.random.default_rng(3000 + seed)
    computed, scheduled = _random_batch(rng)
    prefilling = _is_prefilling(computed, scheduled)
    kw = dict(min_chunk_tokens=4 * world, is_prefilling=prefilling)
    metas = _all_ranks(computed, scheduled, world, shard_decodes=True, **kw)
    replicated = _all_ranks(computed, scheduled, world, **kw)
    split = metas[0].split.numpy()
    decodes = np.flatnonzero(~split & ~prefilling)
    token_start = np.cumsum(scheduled) - scheduled
    padded = metas[0].num_padded_tokens_per_rank
    for req in range(len(scheduled)):
        ranks = [r for r, m in enumerate(metas) if req in m.row_req_indices.tolist()]
        token = int(token_start[req])
        if split[req]:
            assert ranks == [r for r, m in enumerate(replicated)
                             if req in m.row_req_indices.tolist()]
        elif req in decodes:
            owner = int(np.flatnonzero(decodes == req)[0]) % world
            assert ranks == [owner]
            assert int(metas[0].restore_indices[token]) // padded == owner
        else:
            assert ranks == list(range(world))
            assert int(metas[0].restore_indices[token]) // padded == 0
    assert decode_owners(split, prefilling, world, True)[decodes].tolist() == [
        i % world for i in range(len(decodes))]


def test_decode_owners():
    split = np.array([False, True, False, False, False])
    prefilling = np.array([False, True, True, False, False])
    assert decode_owners(split, prefilling, 2, True).tolist() == [0, -1, -1, 1, 0]
    assert decode_owners(split, prefilling, 3, True).tolist() == [0, -1, -1, 1, 2]
    assert decode_owners(split, prefilling, 2, False).tolist() == [-1] * 5
    assert decode_owners(split, None, 2, True).tolist() == [-1] * 5  # no state: everywhere


def test_a_decode_step_sharded_over_more_ranks_than_decodes():
    """Two decodes over 4 ranks: ranks 2 and 3 get no token; every rank runs one row."""
    metas = _all_ranks([10, 20], [1, 1], 4, shard_decodes=True, is_prefilling=[False, False])
    assert [m.num_local_tokens for m in metas] == [1, 1, 0, 0]
    assert metas[0].num_padded_tokens_per_rank == 1
    assert [m.model_input_indices.tolist() for m in metas] == [[0], [1], [0], [0]]
    assert metas[0].restore_indices.tolist() == [0, 1]
    assert metas[0].gathered_token_indices.tolist() == [0, 1, -1, -1]


def test_the_split_field_names_the_split_requests():
    computed, scheduled, prompts = [0, 40, 8000, 0], [5000, 1, 40, 3], [5000, 40, 20000, 3]
    for m in _all_ranks(computed, scheduled, 2, min_split_tokens=4096, prefill_lens=prompts):
        assert m.split.dtype == torch.bool
        assert m.split.tolist() == [True, False, True, False] == split_requests(
            scheduled, 4096, prompts).tolist()
        assert m.num_split_requests == 2 and m.is_split
    assert not _all_ranks([40], [1], 2)[0].split.any()


def test_padding_below_the_largest_rank_is_refused():
    with pytest.raises(ValueError, match="fewer than the 8 tokens"):
        build_pcp_metadata_all_ranks([0], [16], 2, num_padded_tokens_per_rank=7)
    metas = build_pcp_metadata_all_ranks([0], [16], 2, num_padded_tokens_per_rank=8)
    assert metas[0].num_padded_tokens_per_rank == 8


@pytest.mark.parametrize("world", [2, 3, 4, 8])
def test_split_rows_keep_the_kernel_one_gpu_attends_them_with(world):
    """vLLM's FlashInfer attends a row of at most ``decode_threshold`` (1) query tokens
    with its decode kernel, a longer one with its prefill kernel. With the shortest
    split chunk of DCP = 1 (:func:`min_chunk_tokens`, 4N) every row of a split chunk is
    longer than that, a shorter chunk stays whole, decodes stay decodes."""
    assert min_chunk_tokens(world, 1) == 4 * world
    computed, prompts = [30, 6000, 6000, 8000], [30, 6003, 6000 + 4 * world - 1, 20000]
    scheduled = np.array([1, 3, 4 * world - 1, 4 * world])
    for meta in _all_ranks(computed, scheduled, world, min_split_tokens=2 * world,
                           prefill_lens=prompts, min_chunk_tokens=min_chunk_tokens(world, 1)):
        assert meta.split.tolist() == [False, False, False, True]
        q_lens = np.diff(meta.query_start_loc.numpy())
        one_gpu_decode = scheduled[meta.row_req_indices.numpy()] <= 1
        assert ((q_lens <= 1) == one_gpu_decode).all()
        assert meta.num_decode_rows == int(one_gpu_decode.sum())
