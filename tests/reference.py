"""Plain-torch reference math for PCP prefill and DCP decode.

Used by the CPU tests and by the GPU checks as ground truth. Everything here
computes in float32 and returns log-sum-exp values in base 2, as FlashInfer
does (``lse = log2(sum_j exp(score_j))`` with ``score = q . k * scale``).
"""
from __future__ import annotations

import math

import torch

from vllm_pcp.dcp.layout import dcp_owner


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                     scale: float | None = None,
                     causal: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """Bottom-right causal GQA attention of ``Tq`` queries over ``Tk`` keys.

    Query i sees keys ``j <= i + Tk - Tq``: the queries are the last ``Tq``
    tokens of a sequence of ``Tk`` (FlashInfer's ``causal=True`` convention).
    With ``causal=False`` every query sees every key.

    Parameters
    ----------
    q : torch.Tensor
        ``[Tq, Hq, D]``.
    k, v : torch.Tensor
        ``[Tk, Hkv, D]``, ``Hq`` a multiple of ``Hkv``.

    Returns
    -------
    out : torch.Tensor
        ``[Tq, Hq, D]`` float32; zero for a query that sees no key.
    lse : torch.Tensor
        ``[Tq, Hq]`` float32, base 2; ``-inf`` for a query that sees no key.
    """
    tq, hq, dim = q.shape
    tk, hkv, _ = k.shape
    scale = 1.0 / math.sqrt(dim) if scale is None else scale
    group = hq // hkv
    kf = k.float().repeat_interleave(group, dim=1)
    vf = v.float().repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q.float(), kf) * scale
    visible = torch.ones(tq, tk, dtype=torch.bool)
    if causal:
        visible = visible.tril(diagonal=tk - tq)
    scores = scores.masked_fill(~visible, float("-inf"))
    lse_e = torch.logsumexp(scores, dim=-1)  # [Hq, Tq]
    probs = torch.exp(scores - lse_e.unsqueeze(-1)).nan_to_num(0.0)
    out = torch.einsum("hqk,khd->qhd", probs, vf)
    return out, (lse_e / math.log(2.0)).transpose(0, 1).contiguous()


def merge_state(v_a: torch.Tensor, s_a: torch.Tensor, v_b: torch.Tensor,
                s_b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge two partial attention states, base-2 LSE (FlashInfer's ``merge_state``).

    ``v_*`` are ``[T, H, D]``, ``s_*`` are ``[T, H]``. A side with ``-inf``
    LSE (no keys) contributes nothing.
    """
    s_max = torch.maximum(s_a, s_b)
    s_max = torch.where(torch.isinf(s_max), torch.zeros_like(s_max), s_max)
    w_a, w_b = torch.exp2(s_a - s_max), torch.exp2(s_b - s_max)
    total = w_a + w_b
    v = (v_a.float() * w_a.unsqueeze(-1) + v_b.float() * w_b.unsqueeze(-1))
    v = v / total.clamp(min=torch.finfo(torch.float32).tiny).unsqueeze(-1)
    return v, torch.log2(total) + s_max


def merge_states(v: torch.Tensor, s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge ``S`` states: ``v`` ``[T, S, H, D]``, ``s`` ``[T, S, H]`` (``merge_states``)."""
    out, lse = v[:, 0].float(), s[:, 0].float()
    for i in range(1, v.shape[1]):
        out, lse = merge_state(out, lse, v[:, i], s[:, i])
    return out, lse


def rank_prefill_attention(
    q_local: torch.Tensor,
    kv_per_request: list[tuple[torch.Tensor, torch.Tensor]],
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    row_req_indices: torch.Tensor,
) -> torch.Tensor:
    """What one PCP rank computes: each local row over its request's KV prefix.

    Parameters
    ----------
    q_local : torch.Tensor
        ``[L, Hq, D]``, the rank's query tokens in local row order.
    kv_per_request : list of (k, v)
        Per batch request, the full gathered KV ``[>= seq_len, Hkv, D]``.
    query_start_loc, seq_lens, row_req_indices : torch.Tensor
        As in :class:`vllm_pcp.pcp.partition.PrefillContextParallelMetadata`.

    Returns
    -------
    torch.Tensor
        ``[L, Hq, D]`` float32.
    """
    out = torch.zeros(q_local.shape, dtype=torch.float32)
    for row in range(len(seq_lens)):
        lo, hi = int(query_start_loc[row]), int(query_start_loc[row + 1])
        k, v = kv_per_request[int(row_req_indices[row])]
        kv_len = int(seq_lens[row])
        out[lo:hi] = causal_attention(q_local[lo:hi], k[:kv_len], v[:kv_len])[0]
    return out


def dcp_partial_decode(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                       dcp_rank: int, dcp_world_size: int,
                       interleave: int) -> tuple[torch.Tensor, torch.Tensor]:
    """One DCP rank's decode attention over the KV tokens it stores.

    ``q`` is ``[1, Hq, D]`` (the newest token), ``k``/``v`` the request's whole
    KV ``[Tk, Hkv, D]``. The query is last in the sequence, so it sees every
    key and no mask is needed. Returns the partial ``(out, lse)``.
    """
    mine = dcp_owner(torch.arange(k.shape[0]), dcp_world_size, interleave) == dcp_rank
    k_local, v_local = k[mine], v[mine]
    if k_local.shape[0] == 0:
        return (torch.zeros(q.shape, dtype=torch.float32),
                torch.full(q.shape[:2], float("-inf")))
    return causal_attention(q, k_local, v_local)


def _empty_state(rows: int, q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return (torch.zeros((rows, *q.shape[1:]), dtype=torch.float32),
            torch.full((rows, q.shape[1]), float("-inf")))


def _attend_rows(rows, queries, kv_per_request, out, lse, causal) -> None:
    """Run each row of an ``AttentionRows`` (or new-part) plan, writing into out/lse."""
    for r in range(len(rows.kv_len)):
        kv_len = int(rows.kv_len[r])
        if kv_len == 0:
            continue
        idx = rows.query_index[int(rows.qo_indptr[r]):int(rows.qo_indptr[r + 1])]
        k, v = kv_per_request[int(rows.req[r])]
        out[idx], lse[idx] = causal_attention(queries[idx], k[:kv_len], v[:kv_len],
                                              causal=causal)


def _decode_rank_attention(rows, group, q: torch.Tensor, shard: list) -> torch.Tensor:
    """A pure decode step: each rank's partial over its shard, merged across ranks."""
    out, lse = _empty_state(q.shape[0], q)
    _attend_rows(rows, q, shard, out, lse, causal=False)
    return merge_states(group.all_gather(out.unsqueeze(1), dim=1),
                        group.all_gather(lse.unsqueeze(1), dim=1))[0]


def pcp_dcp_rank_attention(plan, group, q_local: torch.Tensor, k_step: torch.Tensor,
                           v_step: torch.Tensor, shard: list) -> torch.Tensor:
    """One rank's attention under PCP x DCP, following a ``DCPAttentionPlan``.

    Parameters
    ----------
    plan : vllm_pcp.dcp.plan.DCPAttentionPlan
    group : object with ``world_size``, ``all_gather`` and ``device_group``
    q_local : torch.Tensor
        ``[L, Hq, D]`` this rank's queries, local order.
    k_step, v_step : torch.Tensor
        ``[T, Hkv, D]`` this step's new K/V of every rank, step order.
    shard : list of (k, v)
        Per request, this rank's stored KV in local-offset order, this step's
        tokens included (the cache write comes first).

    Returns
    -------
    torch.Tensor
        ``[L, Hq, D]`` float32.
    """
    from vllm_pcp.pcp.exchange import all_gather_padded, all_to_all

    if plan.decode is not None:  # q_local: the step's tokens; shard: the new ones included
        return _decode_rank_attention(plan.decode, group, q_local, shard)
    n, pcp = group.world_size, plan.pcp
    qsl, padded = pcp.query_start_loc, pcp.num_padded_tokens_per_rank
    num_local = q_local.shape[0]
    new_out, new_lse = _empty_state(num_local, q_local)
    for j in range(pcp.num_rows):
        lo, hi = int(qsl[j]), int(qsl[j + 1])
        kv = plan.new_kv_token_index[int(plan.new_kv_indptr[j]):int(plan.new_kv_indptr[j + 1])]
        new_out[lo:hi], new_lse[lo:hi] = causal_attention(q_local[lo:hi], k_step[kv], v_step[kv])

    q_all = all_gather_padded(group, q_local, padded)
    out, lse = _empty_state(n * padded, q_local)
    _attend_rows(plan.ctx_split, q_all, shard, out, lse, causal=False)
    out, lse = all_to_all(group, out), all_to_all(group, lse)
    ctx_out, ctx_lse = merge_states(out.view(n, padded, *out.shape[1:]).transpose(0, 1),
                                    lse.view(n, padded, -1).transpose(0, 1))
    ctx_out, ctx_lse = ctx_out[:num_local], ctx_lse[:num_local]

    rep = plan.ctx_replicated
    rep_out, rep_lse = _empty_state(num_local, q_local)
    _attend_rows(rep, q_local, shard, rep_out, rep_lse, causal=False)
    idx = rep.query_index
    parts_out = group.all_gather(rep_out[idx].unsqueeze(1), dim=1)
    parts_lse = group.all_gather(rep_lse[idx].unsqueeze(1), dim=1)
    ctx_out[idx], ctx_lse[idx] = merge_states(parts_out, parts_lse)
    return merge_state(ctx_out, ctx_lse, new_out, new_lse)[0]
