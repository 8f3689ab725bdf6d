"""Run DCPAttention for every rank of a thread group over paged KV shards.

Shared by the CPU test (FlashInfer replaced by the reference kernels) and the
GPU test (real FlashInfer). Returns each rank's restored output and the
single-process reference.
"""
from __future__ import annotations

import math
import sys

import torch

from helpers import ThreadGroup
from vllm_pcp.dcp.attention import DCPAttention
from vllm_pcp.dcp.plan import build_dcp_plan
from vllm_pcp.pcp.exchange import gather_kv, restore_hidden_states
from vllm_pcp.dcp.layout import dcp_local_offset, dcp_local_seq_len, dcp_owner
from vllm_pcp.pcp.partition import build_pcp_metadata_all_ranks
from reference import causal_attention

COMPUTED = [0, 37, 0, 5, 0, 60, 21, 300]
SCHEDULED = [2, 90, 1, 200, 13, 1, 3, 64]

# (computed, scheduled) of steps whose split requests are too short for every rank of
# N to get a token (fewer tokens than the 2N chunks), by N: the last 2 tokens of a
# long prompt alone, three 2-token chunks, and 2 to 5 token chunks.
ZERO_TOKEN_STEPS = {3: [([1000], [2]), ([40, 0, 17], [2, 2, 2])],
                    4: [([1000], [2]), ([40, 0, 17], [2, 2, 2]), ([0, 33], [2, 3])],
                    8: [([1000], [2]), ([0, 33], [2, 3]), ([5, 64], [3, 5])]}


def short_split_step(world):
    """A step where every rank of N = ``world`` has tokens, some a single one: a
    2-token fresh chunk, a ``2N - 1``-token chunk over context (its first of 2N chunks
    empty), a decode and a long chunk. ``(computed, scheduled)``."""
    return [0, 300, 12, 9], [2, 2 * world - 1, 1, 517]


def ranks_without_tokens(computed, scheduled, world, min_split=2):
    """Ranks of N = ``world`` that get no local token of the step."""
    counts = build_pcp_metadata_all_ranks(computed, scheduled, world,
                                          min_split_tokens=min_split)[0].num_tokens_per_rank
    return [rank for rank, count in enumerate(counts) if count == 0]


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


def _capture_like_vllm(attn, world, rank, interleave, graph_rows, table):
    """Plan vLLM's dummy decode batch of a graph capture (context ``world *
    interleave`` per row, every page the first one) on ``attn``."""
    plan = build_dcp_plan([world * interleave] * graph_rows, [1] * graph_rows, world, rank,
                          interleave)
    return attn.plan(plan, torch.zeros(graph_rows, table.shape[1], dtype=table.dtype,
                                       device=table.device), graph_rows).decode_wrapper


def run_dcp_step(world, interleave, min_split, device, dtype, hq=8, hkv=2, dim=64,
                 page_size=16, computed=COMPUTED, scheduled=SCHEDULED, kv_layout="NHD",
                 graph_rows=None, heads_gathered=False, context_exchange="queries",
                 context_written_in_step=None, around_attention=None, earlier_layers=0):
    """Each rank's restored output (in the attention's output dtype) and the float32
    reference computed from the same ``dtype``-rounded inputs.

    ``graph_rows`` (decode steps): plan a graph capture of that many rows first, then
    the step on the same graph wrapper, with the queries padded to ``graph_rows``
    rows; the output keeps the padding rows.

    ``heads_gathered``: DCP inside TP (PCP = 1). Rank r holds query heads
    ``[r * hq / N, (r + 1) * hq / N)`` of every token and the same K/V heads; nothing
    is split (``min_split`` is ignored); each rank's output is its own heads, step order.

    ``context_exchange``: how split rows reach their context (``build_dcp_plan``);
    ``context_written_in_step`` (``[R]`` bool): requests whose split rows send their
    queries whatever the knob, beside others that fetch their context.

    ``around_attention(rank)``: a context manager DCP inside TP's attention runs in.

    ``earlier_layers``: the planned step first runs in that many layers of other queries
    and K/V (their outputs dropped), as a model's layers share one step."""
    import contextlib

    full, q = make_batch(hq, hkv, dim, world * 100 + interleave, computed, scheduled)
    full = [(k.to(dtype).float(), v.to(dtype).float()) for k, v in full]
    q = q.to(dtype).float()
    token_start = torch.tensor([0, *scheduled]).cumsum(0)
    k_step = torch.cat([k[c:] for (k, _), c in zip(full, computed)]).to(device, dtype)
    v_step = torch.cat([v[c:] for (_, v), c in zip(full, computed)]).to(device, dtype)
    assert k_step.shape[0] == int(token_start[-1])
    group = ThreadGroup(world)

    def rank_fn(rank):
        plan = build_dcp_plan(computed, scheduled, world, rank, interleave,
                              min_split_tokens=sys.maxsize if heads_gathered else min_split,
                              context_exchange=context_exchange, kv_to_q_heads=hkv / hq,
                              context_written_in_step=context_written_in_step)
        cache, table = _paged_shard(full, rank, world, interleave, page_size, device, dtype)
        if kv_layout == "HND":  # [pages, Hkv, page_size, D]
            cache = tuple(c.transpose(1, 2).contiguous() for c in cache)
        workspace = torch.empty(64 * 1024 * 1024, dtype=torch.uint8, device=device)
        attn = DCPAttention(workspace, hq, hkv, dim, page_size, dtype, 1 / math.sqrt(dim),
                            kv_layout, max_graph_rows=graph_rows or 0)
        q_step = q.to(device, dtype)
        if graph_rows is not None:
            captured = _capture_like_vllm(attn, world, rank, interleave, graph_rows, table)
            pad = torch.randn(max(0, graph_rows - len(q)), hq, dim).to(q_step)
            q_step = torch.cat([q_step, pad])
        step = attn.plan(plan, table, graph_rows, kv_gathered=not heads_gathered)
        if graph_rows is not None:
            assert step.decode_wrapper is captured  # a replay runs the captured wrapper
        if heads_gathered:
            heads = hq // world
            mine = q_step[:, rank * heads:(rank + 1) * heads]
            with (around_attention or (lambda r: contextlib.nullcontext()))(rank):
                out = attn.run_heads_gathered(step, group.rank(rank), mine, k_step, v_step,
                                              cache)
            return out.cpu()
        if plan.decode is not None:  # the runner's decode step: step order, no restore
            return attn.run(step, group.rank(rank), q_step, None, None, cache).cpu()
        local = plan.pcp.local_token_indices.to(device)
        # the cache write's exchange: local new K/V, plus the context split chunks fetch
        context_rows = 0 if plan.ctx_gather is None else plan.ctx_gather.num_padded
        k_buf, v_buf = gather_kv(group.rank(rank), k_step[local], v_step[local],
                                 plan.pcp.num_padded_tokens_per_rank,
                                 step.read_context(cache), context_rows)
        q_local = q.to(device, dtype)[local]
        for _ in range(earlier_layers):
            attn.run(step, group.rank(rank), torch.randn_like(q_local), torch.randn_like(k_buf),
                     torch.randn_like(v_buf), cache)
        out = attn.run(step, group.rank(rank), q_local, k_buf, v_buf, cache)
        restored = restore_hidden_states(group.rank(rank), out.reshape(out.shape[0], hq * dim),
                                         plan.pcp.num_padded_tokens_per_rank,
                                         plan.pcp.restore_indices.to(device))
        return restored.reshape(-1, hq, dim).cpu()

    return group.run(rank_fn), expected_output(full, q, computed, scheduled)
