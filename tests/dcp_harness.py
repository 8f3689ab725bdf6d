"""Run DCPAttention for every rank of a thread group over paged KV shards.

Shared by the CPU test (FlashInfer replaced by the reference kernels) and the GPU test
(real FlashInfer). Each rank plans the step as vLLM's PCP manager splits it with ``-pcp N
-dcp N`` (:func:`helpers.pcp_step`: every split chunk has at least 2N tokens, so every
request has a row on every rank), runs it as the plugin's layer does (the K/V exchange,
then the attention) and restores its output as vLLM does; the result is compared with
the single-process reference.
"""
from __future__ import annotations

import contextlib
import math

import torch

from helpers import ThreadGroup, pcp_step, restore
from reference import causal_attention
from vllm_pcp.dcp.attention import DCPAttention
from vllm_pcp.dcp.layout import dcp_local_offset, dcp_local_seq_len, dcp_owner
from vllm_pcp.dcp.plan import build_dcp_plan
from vllm_pcp.pcp.exchange import gather_kv

COMPUTED = [0, 37, 0, 5, 0, 60, 21, 300]
SCHEDULED = [2, 90, 1, 200, 13, 1, 3, 64]


def short_split_step(world):
    """A step of chunks at the split boundary of ``-dcp``, 2N tokens: a fresh ``2N``-token
    chunk (split into one-token rows, one head and one tail on every rank), a ``2N - 1``
    token chunk over context (computed whole on every rank), a decode and a long chunk.
    ``(computed, scheduled)``."""
    return [0, 300, 12, 9], [2 * world, 2 * world - 1, 1, 517]


def dcp_step(computed, scheduled, world, rank, min_split=2, **kw):
    """The manager's step of ``-pcp world -dcp world`` on ``rank`` (:func:`helpers.pcp_step`)."""
    return pcp_step(computed, scheduled, world, rank, dcp=world, min_split_tokens=min_split,
                    **kw)


def dcp_plan(computed, scheduled, world, rank, interleave, min_split=2, **kw):
    """:func:`build_dcp_plan` of :func:`dcp_step`; ``kw``: its keyword arguments."""
    return build_dcp_plan(dcp_step(computed, scheduled, world, rank, min_split), interleave,
                          **kw)


def make_batch(hq: int, hkv: int, dim: int, seed: int = 0, computed=COMPUTED,
               scheduled=SCHEDULED):
    g = torch.Generator().manual_seed(seed)
    full = [(torch.randn(c + s, hkv, dim, generator=g), torch.randn(c + s, hkv, dim, generator=g))
            for c, s in zip(computed, scheduled)]
    q = torch.randn(sum(scheduled), hq, dim, generator=g)
    return full, q


def expected_output(full, q, computed=COMPUTED, scheduled=SCHEDULED):
    outs, start = [], 0
    for (k, v), c, s in zip(full, computed, scheduled):
        outs.append(causal_attention(q[start:start + s], k, v)[0])
        start += s
    return torch.cat(outs)


def _paged_shard(full, rank, world, interleave, page_size, device, dtype):
    """This rank's owned tokens of every request in a paged cache, and its block table."""
    caps = [int(dcp_local_seq_len(torch.tensor(len(k)), rank, world, interleave))
            for k, _ in full]
    pages = [(c + page_size - 1) // page_size for c in caps]
    hkv, dim = full[0][0].shape[1:]
    k_cache = torch.zeros(sum(pages) + 1, page_size, hkv, dim)
    v_cache = torch.zeros_like(k_cache)
    table = torch.zeros(len(full), max(pages), dtype=torch.int32)
    nxt = 1  # page 0 stays unused, as vLLM's null block
    for req, (k, v) in enumerate(full):
        table[req, : pages[req]] = torch.arange(nxt, nxt + pages[req])
        nxt += pages[req]
        pos = torch.arange(len(k))
        mine = dcp_owner(pos, world, interleave) == rank
        off = dcp_local_offset(pos[mine], world, interleave)
        page, slot = table[req, off // page_size].long(), off % page_size
        k_cache[page, slot], v_cache[page, slot] = k[mine], v[mine]
    return (k_cache.to(device, dtype), v_cache.to(device, dtype)), table.to(device)


def run_dcp_step(world, interleave, min_split, device, dtype, hq=8, hkv=2, dim=64,
                 page_size=16, computed=COMPUTED, scheduled=SCHEDULED, kv_layout="NHD",
                 context_exchange="queries", around_attention=None, earlier_layers=0):
    """Each rank's restored output (in the attention's output dtype, step order) and the
    float32 reference computed from the same ``dtype``-rounded inputs.

    ``context_exchange``: how split rows reach their context (``build_dcp_plan``).
    ``around_attention(rank)``: a context manager the rank's exchange and attention run
    in (default none). ``earlier_layers``: the planned step first runs in that many layers
    of other queries and K/V (their outputs dropped), as a model's layers share one step.
    """
    full, q = make_batch(hq, hkv, dim, world * 100 + interleave, computed, scheduled)
    full = [(k.to(dtype).float(), v.to(dtype).float()) for k, v in full]
    q = q.to(dtype).float()
    k_step = torch.cat([k[c:] for (k, _), c in zip(full, computed)]).to(device, dtype)
    v_step = torch.cat([v[c:] for (_, v), c in zip(full, computed)]).to(device, dtype)
    q_step = q.to(device, dtype)
    group = ThreadGroup(world)
    around = around_attention or (lambda rank: contextlib.nullcontext())

    def rank_fn(rank):
        step = dcp_step(computed, scheduled, world, rank, min_split)
        plan = build_dcp_plan(step, interleave, context_exchange=context_exchange,
                              kv_to_q_heads=hkv / hq)
        cache, table = _paged_shard(full, rank, world, interleave, page_size, device, dtype)
        if kv_layout == "HND":  # [pages, Hkv, page_size, D]
            cache = tuple(c.transpose(1, 2).contiguous() for c in cache)
        workspace = torch.empty(64 * 1024 * 1024, dtype=torch.uint8, device=device)
        attn = DCPAttention(workspace, hq, hkv, dim, page_size, dtype, 1 / math.sqrt(dim),
                            kv_layout)
        planned = attn.plan(plan, table, kv_gathered=step.gathered)
        rank_group = group.rank(rank)
        with around(rank):
            if plan.decode is not None:  # the step's tokens, in step order; K/V unread
                return attn.run(planned, rank_group, q_step, None, None, cache).cpu()
            local = plan.pcp.local_token_indices.to(device)
            if step.gathered:  # the layer's exchange: new K/V, and context split rows fetch
                context_rows = 0 if plan.ctx_gather is None else plan.ctx_gather.num_padded
                k_in, v_in = gather_kv(rank_group, k_step[local], v_step[local],
                                       plan.pcp.num_padded_tokens_per_rank,
                                       planned.read_context(cache), context_rows)
            else:  # every rank holds every token of the step, in step order
                k_in, v_in = k_step, v_step
            q_local = q_step[local]
            for _ in range(earlier_layers):
                attn.run(planned, rank_group, torch.randn_like(q_local),
                         torch.randn_like(k_in), torch.randn_like(v_in), cache)
            out = attn.run(planned, rank_group, q_local, k_in, v_in, cache)
            return restore(rank_group, out, step).cpu()

    return group.run(rank_fn), expected_output(full, q, computed, scheduled)
