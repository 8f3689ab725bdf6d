"""Without CP vs with CP, on gloo: the whole PCP data path in plain torch.

Each rank partitions a random batch, computes K/V for its own tokens only,
exchanges them with :func:`vllm_pcp.pcp.exchange.gather_kv`, writes the kept rows
into a per-request KV store (as the cache write does), attends with the
reference kernel, and restores the outputs as vLLM's PCP manager does (every
rank's ``P`` rows all-gathered, read in scheduler order). The result must equal
full causal attention on one process. Under ``-dcp`` the step is split as the
manager splits it (``tests/dcp_harness.py``); DCP-sharded decode plus the LSE
combine must equal full decode attention.
"""
import os
import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from dcp_harness import dcp_step
from helpers import restore
from reference import (causal_attention, dcp_partial_decode, merge_states,
                       pcp_dcp_rank_attention, rank_prefill_attention)
from vllm_pcp.dcp.layout import dcp_local_offset, dcp_owner
from vllm_pcp.dcp.plan import build_dcp_plan
from vllm_pcp.pcp.exchange import all_gather_padded, gather_kv
from vllm_pcp.pcp.partition import build_pcp_metadata

HEAD_LAYOUTS = [(16, 2), (8, 1)]
HEAD_DIM = 16


class GlooGroup:
    """The slice of vLLM's GroupCoordinator that the exchanges use."""

    def __init__(self):
        self.world_size = dist.get_world_size()
        self.device_group = None  # the default (gloo) group

    def all_gather(self, x, dim=0):
        parts = [torch.empty_like(x) for _ in range(self.world_size)]
        dist.all_gather(parts, x.contiguous())
        return torch.cat(parts, dim=dim)


def _batch(seed, hq, hkv, computed=(0, 37, 0, 5, 0, 60, 21), scheduled=None):
    """Same tensors on every rank: prior KV of each request plus the new tokens."""
    g = torch.Generator().manual_seed(seed)
    computed = list(computed)
    if scheduled is None:
        scheduled = [1 + seed % 3, 90, 1, 200, 13, 1, 3]  # short, long, decode, ...
    total = sum(scheduled)
    new = {n: torch.randn(total, h, HEAD_DIM, generator=g)
           for n, h in (("q", hq), ("k", hkv), ("v", hkv))}
    prior = [(torch.randn(c, hkv, HEAD_DIM, generator=g),
              torch.randn(c, hkv, HEAD_DIM, generator=g)) for c in computed]
    return computed, scheduled, new, prior


def _full_attention(computed, scheduled, new, prior):
    outs, start = [], 0
    for (pk, pv), s in zip(prior, scheduled):
        sl = slice(start, start + s)
        k = torch.cat([pk, new["k"][sl]])
        v = torch.cat([pv, new["v"][sl]])
        outs.append(causal_attention(new["q"][sl], k, v)[0])
        start += s
    return torch.cat(outs)


def _pcp_attention(rank, world, computed, scheduled, new, prior, min_split):
    group = GlooGroup()
    meta = build_pcp_metadata(computed, scheduled, world, rank, min_split_tokens=min_split)
    local = meta.local_token_indices
    k_all, v_all = gather_kv(group, new["k"][local], new["v"][local],
                             meta.num_padded_tokens_per_rank)
    # The cache write: kept gathered rows land at their request's positions.
    kv = []
    for (pk, pv), c, s in zip(prior, computed, scheduled):
        kv.append((torch.cat([pk, torch.full((s, *pk.shape[1:]), float("nan"))]),
                   torch.cat([pv, torch.full((s, *pv.shape[1:]), float("nan"))])))
    req_start = torch.tensor([0, *scheduled]).cumsum(0)
    for row, tok in enumerate(meta.gathered_token_indices.tolist()):
        if tok < 0:
            continue
        req = int(torch.searchsorted(req_start, tok, right=True)) - 1
        pos = computed[req] + tok - int(req_start[req])
        kv[req][0][pos] = k_all[row]
        kv[req][1][pos] = v_all[row]
    out = rank_prefill_attention(new["q"][local], kv, meta.query_start_loc,
                                 meta.seq_lens, meta.row_req_indices)
    flat = out.reshape(out.shape[0], -1)  # the restore of vLLM's manager
    restored = all_gather_padded(group, flat, meta.num_padded_tokens_per_rank)
    return restored[meta.restore_indices].reshape(-1, *out.shape[1:])


def _shard_write(shard, k_rows, v_rows, positions, req, rank, world, interleave):
    """The DCP cache write: keep the rows this rank owns, at their local offsets."""
    mine = dcp_owner(positions, world, interleave) == rank
    offsets = dcp_local_offset(positions[mine], world, interleave)
    shard[req][0][offsets] = k_rows[mine]
    shard[req][1][offsets] = v_rows[mine]


def _pcp_dcp_attention(rank, world, interleave, computed, scheduled, new, prior, min_split):
    group = GlooGroup()
    step = dcp_step(computed, scheduled, world, rank, min_split)
    plan = build_dcp_plan(step, interleave)
    meta = plan.pcp
    if plan.decode is not None:  # every rank runs every token: no exchange
        local = torch.arange(sum(scheduled))
        k_step, v_step = new["k"], new["v"]
    else:
        local = meta.local_token_indices
        k_all, v_all = gather_kv(group, new["k"][local], new["v"][local],
                                 meta.num_padded_tokens_per_rank)
        k_step, v_step = k_all[meta.restore_indices], v_all[meta.restore_indices]
    shard, start = [], 0
    for req, ((pk, pv), c, s) in enumerate(zip(prior, computed, scheduled)):
        cap = c + s
        shard.append((torch.full((cap, *pk.shape[1:]), float("nan")),
                      torch.full((cap, *pv.shape[1:]), float("nan"))))
        _shard_write(shard, pk, pv, torch.arange(c), req, rank, world, interleave)
        _shard_write(shard, k_step[start:start + s], v_step[start:start + s],
                     c + torch.arange(s), req, rank, world, interleave)
        full_k = torch.cat([pk, new["k"][start:start + s]])
        owned = dcp_owner(torch.arange(cap), world, interleave) == rank
        assert torch.equal(shard[req][0][: int(owned.sum())], full_k[owned])
        start += s
    out = pcp_dcp_rank_attention(plan, group, new["q"][local], k_step, v_step, shard)
    if plan.decode is not None:  # step order on every rank, nothing to restore
        return out
    return restore(group, out, step)


def _dcp_decode(rank, world, interleave, hq, hkv):
    g = torch.Generator().manual_seed(interleave)
    q = torch.randn(1, hq, HEAD_DIM, generator=g)
    k = torch.randn(301, hkv, HEAD_DIM, generator=g)
    v = torch.randn(301, hkv, HEAD_DIM, generator=g)
    out, lse = dcp_partial_decode(q, k, v, rank, world, interleave)
    group = GlooGroup()
    outs = group.all_gather(out.unsqueeze(1), dim=1)
    lses = group.all_gather(lse.unsqueeze(1), dim=1)
    merged, merged_lse = merge_states(outs, lses)
    full, full_lse = causal_attention(q, k, v)
    torch.testing.assert_close(merged, full, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(merged_lse, full_lse, atol=1e-5, rtol=1e-5)


def _worker(rank, world, port, results):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        for hq, hkv in HEAD_LAYOUTS:
            for seed in range(2):
                for min_split in (2, 16):
                    batch = _batch(seed, hq, hkv)
                    got = _pcp_attention(rank, world, *batch, min_split)
                    torch.testing.assert_close(got, _full_attention(*batch),
                                               atol=1e-5, rtol=1e-5)
            for interleave in (1, 16):
                _dcp_decode(rank, world, interleave, hq, hkv)
                for min_split in (2, 16):
                    batch = _batch(interleave, hq, hkv)
                    got = _pcp_dcp_attention(rank, world, interleave, *batch, min_split)
                    torch.testing.assert_close(got, _full_attention(*batch),
                                               atol=1e-5, rtol=1e-5)
                # a pure decode step: the new token sits in its owner's shard
                batch = _batch(interleave, hq, hkv, (48, 61, 300), [1, 1, 1])
                step = dcp_step(batch[0], batch[1], world, rank)
                assert build_dcp_plan(step, interleave).decode is not None
                got = _pcp_dcp_attention(rank, world, interleave, *batch, 2)
                torch.testing.assert_close(got, _full_attention(*batch), atol=1e-5, rtol=1e-5)
        results[rank] = "ok"
    except Exception as exc:  # reported to the parent, which fails the test
        results[rank] = f"{type(exc).__name__}: {exc}"
        raise
    finally:
        dist.destroy_process_group()


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("world", [2, 4])
def test_pcp_and_dcp_match_single_process(world):
    results = mp.Manager().dict()
    mp.spawn(_worker, args=(world, _free_port(), results), nprocs=world, join=True)
    assert dict(results) == {r: "ok" for r in range(world)}


def test_thread_group_raises_for_a_rank_that_does_not_finish(monkeypatch):
    import threading

    import helpers

    monkeypatch.setattr(helpers, "JOIN_TIMEOUT_S", 0.2)
    release = threading.Event()
    group = helpers.ThreadGroup(2)
    with pytest.raises(TimeoutError, match=r"ranks \[1\]"):
        group.run(lambda r: r if r == 0 else release.wait(5))
    release.set()
