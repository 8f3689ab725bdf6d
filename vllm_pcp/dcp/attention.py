"""FlashInfer execution of a :class:`vllm_pcp.dcp.plan.DCPAttentionPlan` (GPU): planned
once per step, run per layer, as ``pcp_dcp_rank_attention`` of ``tests/reference.py``.

The new part is a causal ragged prefill over the step's gathered K/V (with
``plan.ctx_gather``, a split row's context first: no merge); split context a non-causal
paged prefill of all ranks' split queries over this rank's shard, then an all-to-all;
replicated context the same kernel (one-query rows: the split-KV decode kernel), then an
all-gather; the merges are ``flashinfer.merge_state(s)`` on base-2 LSEs. A pure decode step
is one decode-kernel call, one all-gather and one merge. Partial states are in the model
dtype (FlashInfer has no float32-output attention kernel and merges 16-bit values), each
rounded once before the merge. The shard is a plain paged sequence: local token o at
``block_table[o // page_size]``, slot ``o % page_size``.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from vllm_pcp.dcp.index import (context_slots, kept_rows, owned_split_tokens, paged_kv_layout,
                                positions_in, rows_index)
from vllm_pcp.dcp.plan import AttentionRows, DCPAttentionPlan
from vllm_pcp.pcp.exchange import all_gather_padded, all_to_all
from vllm_pcp.pcp.fence import PlanFence


@dataclass
class PlannedDCPStep:
    """One step's device indexes and planned kernels (:meth:`DCPAttention.plan`), run by
    every layer; valid until the next plan (FlashInfer keeps the plan in the wrapper).
    "Rows" are query tokens of the rank's local input ``[L]``."""

    plan: DCPAttentionPlan
    decode_wrapper: object | None = None  # a pure decode step's planned decode wrapper
    new_kv_index: torch.Tensor | None = None  # [sum new keys] rows of the K/V buffer
    has_local_rows: bool = False
    context_slots: tuple[torch.Tensor, torch.Tensor] | None = None  # (page, slot) sent
    kv_layout: str = "NHD"
    split_query: torch.Tensor | None = None  # rows of the gathered queries on this shard
    split_owner_row: tuple[torch.Tensor, torch.Tensor] | None = None  # (rank, row) of each
    owned_split: torch.Tensor | slice | None = None  # own split rows with context
    replicated_rows: torch.Tensor | slice | None = None  # replicated rows with context
    num_replicated: int = 0
    # (wrapper, its query rows, their positions among replicated_rows)
    replicated_calls: list = field(default_factory=list)
    replicated_covered: bool = True  # every replicated row sees keys on this rank
    # partial-state buffers, made in the step's first layer and reused by the others
    buffers: dict = field(default_factory=dict)

    def read_context(self, kv_cache) -> torch.Tensor | None:
        """``[Lc, 2, Hkv, D]``: the context K/V this rank sends for the split chunks
        (:class:`vllm_pcp.dcp.plan.ContextGather` order), or None."""
        if self.context_slots is None:
            return None
        page, slot = self.context_slots
        k_cache, v_cache = kv_cache
        packed = _packed(k_cache, v_cache)
        if packed is not None:  # one gather of both: [Lc, Hkv, 2, D]
            rows = packed[page, :, slot] if self.kv_layout == "HND" else packed[page, slot]
            return rows.transpose(1, 2)
        if self.kv_layout == "HND":  # [pages, Hkv, page_size, D]
            k, v = k_cache[page, :, slot], v_cache[page, :, slot]
        else:  # [pages, page_size, Hkv, D]
            k, v = k_cache[page, slot], v_cache[page, slot]
        return torch.stack((k, v), dim=1)


def _packed(k_cache: torch.Tensor, v_cache: torch.Tensor) -> torch.Tensor | None:
    """K and V as one view ``[..., 2, D]`` where V lies ``D`` elements after K with K's
    strides (vLLM's FlashInfer cache packing); else None."""
    dim = k_cache.shape[-1]
    if (k_cache.stride(-1) != 1 or v_cache.shape != k_cache.shape
            or v_cache.stride() != k_cache.stride()
            or v_cache.data_ptr() != k_cache.data_ptr() + dim * k_cache.element_size()):
        return None
    return k_cache.as_strided((*k_cache.shape[:-1], 2, dim), (*k_cache.stride()[:-1], dim, 1))


class DCPAttention:
    """FlashInfer wrappers of one rank: :meth:`plan` a step once, :meth:`run` it per layer."""

    def __init__(self, workspace: torch.Tensor, num_qo_heads: int, num_kv_heads: int,
                 head_dim: int, page_size: int, dtype: torch.dtype, sm_scale: float,
                 kv_layout: str = "NHD"):
        import flashinfer
        from vllm.v1.attention.backends.flashinfer import fast_plan_decode

        self._fast_plan_decode = fast_plan_decode
        self.heads = (num_qo_heads, num_kv_heads, head_dim)
        self.page_size, self.dtype, self.sm_scale = page_size, dtype, sm_scale
        self._merge_state, self._merge_states = flashinfer.merge_state, flashinfer.merge_states
        self._merge_state_in_place = flashinfer.merge_state_in_place
        self._new = flashinfer.BatchPrefillWithRaggedKVCacheWrapper(workspace, "NHD",
                                                                    backend="auto")
        self._split = flashinfer.BatchPrefillWithPagedKVCacheWrapper(workspace, kv_layout,
                                                                     backend="auto")
        self._replicated = flashinfer.BatchPrefillWithPagedKVCacheWrapper(
            workspace, kv_layout, backend="auto")
        # decode rows: the decode kernel splits a row's KV over the SMs (the prefill
        # kernel "auto" picks on Hopper runs one row's 16K keys on one CTA)
        self._decode = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
            workspace, kv_layout, use_tensor_cores=True)
        self._kv_layout = kv_layout
        self._fence = PlanFence()  # the wrappers' host buffers, between two steps' plans

    def plan(self, plan: DCPAttentionPlan, block_table: torch.Tensor,
             kv_gathered: bool = True) -> PlannedDCPStep:
        """Plan the step's kernels (on the host) and move the layers' indexes to the device.
        ``block_table``: ``[num_reqs, max_pages]`` int32 on the GPU. ``kv_gathered``:
        :meth:`run` gets the K/V exchange's buffer
        (:func:`vllm_pcp.pcp.exchange.gather_kv`), else the step's K/V in step order."""
        self._fence.wait()
        try:
            return self._plan_step(plan, block_table, kv_gathered)
        finally:
            self._fence.record(block_table.device)

    def _plan_step(self, plan: DCPAttentionPlan, block_table: torch.Tensor,
                   kv_gathered: bool) -> PlannedDCPStep:
        dev = block_table.device
        step = PlannedDCPStep(plan, kv_layout=self._kv_layout)
        if plan.decode is not None:
            step.decode_wrapper = self._plan_decode(plan.decode, block_table)
            return step

        def to_dev(x: torch.Tensor | None) -> torch.Tensor | None:
            return None if x is None else x.to(dev, non_blocking=True)

        step.new_kv_index = to_dev(plan.new_kv_gathered_index if kv_gathered
                                   else plan.new_kv_token_index)
        step.context_slots = (None if plan.ctx_gather is None else
                              context_slots(plan.ctx_gather, block_table, self.page_size))
        step.has_local_rows = plan.pcp.num_rows > 0
        if step.has_local_rows:
            hq, hkv, dim = self.heads
            self._new.plan(plan.pcp.query_start_loc, plan.new_kv_indptr, hq, hkv, dim,
                           causal=True, sm_scale=self.sm_scale, q_data_type=self.dtype,
                           kv_data_type=self.dtype, o_data_type=self.dtype)
        split_query = self._plan_paged(self._split, plan.ctx_split, block_table)
        step.split_query = to_dev(split_query)
        if split_query is not None:  # (owner rank, row in its block) of each query
            padded = plan.pcp.num_padded_tokens_per_rank
            step.split_owner_row = (to_dev(split_query // padded), to_dev(split_query % padded))
        owned = owned_split_tokens(plan)
        step.owned_split = None if owned is None else rows_index(owned, dev)
        self._plan_replicated(step, plan.ctx_replicated, block_table)
        return step

    def _plan_replicated(self, step: PlannedDCPStep, rows: AttentionRows,
                         block_table: torch.Tensor) -> None:
        """Plan the replicated rows' calls into ``step``: one-query rows on the split-KV
        decode kernel, the others on the paged prefill kernel."""
        dev, query_index = block_table.device, rows.query_index
        single = (rows.qo_indptr[1:] - rows.qo_indptr[:-1]) == 1
        step.num_replicated = len(query_index)
        step.replicated_rows = rows_index(query_index, dev)
        covered = 0
        for wrapper, query in ((self._replicated,
                                self._plan_paged(self._replicated, rows, block_table, ~single)),
                               (self._decode, self._plan_paged(self._decode, rows, block_table,
                                                               single))):
            if query is not None:
                step.replicated_calls.append(
                    (wrapper, rows_index(query, dev),
                     rows_index(positions_in(query_index, query), dev)))
                covered += len(query)
        step.replicated_covered = covered == len(query_index)

    def _plan_decode(self, rows: AttentionRows, block_table: torch.Tensor):
        """Plan the decode wrapper: row i (request i) over ``rows.kv_len[i]`` shard tokens."""
        self._fast_plan(*paged_kv_layout(rows.kv_len, block_table, self.page_size),
                        rows.kv_len)
        return self._decode

    def _fast_plan(self, indptr, indices, last, kv_len) -> None:
        hq, hkv, dim = self.heads
        self._fast_plan_decode(self._decode, indptr, indices, last, kv_len, hq, hkv,
                               dim, self.page_size, sm_scale=self.sm_scale,
                               q_data_type=self.dtype, kv_data_type=self.dtype,
                               o_data_type=self.dtype)

    def _paged_rows(self, rows: AttentionRows, block_table: torch.Tensor,
                    keep: torch.Tensor | None):
        """``(kept, indptr, indices, last_page_len)`` of the rows with context (of those
        ``keep`` marks), or None."""
        kept = kept_rows(rows, keep)
        if len(kept.req) == 0:
            return None
        table = block_table.index_select(
            0, kept.req.to(block_table.device, dtype=torch.int64, non_blocking=True))
        return (kept, *paged_kv_layout(kept.kv_len, table, self.page_size))

    def _plan_paged(self, wrapper, rows: AttentionRows, block_table: torch.Tensor,
                    keep: torch.Tensor | None = None) -> torch.Tensor | None:
        """Plan ``wrapper`` (the decode one through vLLM's ``fast_plan_decode``) for the rows
        with context (of those ``keep`` marks); their query rows (CPU), or None."""
        paged = self._paged_rows(rows, block_table, keep)
        if paged is None:
            return None
        kept, indptr, indices, last = paged
        if wrapper is self._decode:
            self._fast_plan(indptr, indices, last, kept.kv_len)
        else:
            hq, hkv, dim = self.heads
            wrapper.plan(kept.qo_indptr, indptr, indices, last, hq, hkv, dim,
                         self.page_size, causal=False, sm_scale=self.sm_scale,
                         q_data_type=self.dtype, kv_data_type=self.dtype,
                         o_data_type=self.dtype)
        return kept.query_index

    def run(self, step: PlannedDCPStep, group, q_local: torch.Tensor, k_step: torch.Tensor,
            v_step: torch.Tensor, kv_cache: tuple[torch.Tensor, torch.Tensor],
            out: torch.Tensor | None = None) -> torch.Tensor:
        """Run a planned step in one layer: ``q_local [L, Hq, D]``; ``k_step/v_step`` the
        K/V exchange's ``[N * (P + Pc), Hkv, D]`` or ``[T, Hkv, D]`` in step order (unread
        on a decode step); ``kv_cache`` this rank's paged (K, V). Returns ``[L, Hq, D]``,
        ``out`` where given."""
        if step.plan.decode is not None:
            merged = self._run_decode(step, group, q_local, kv_cache)
            if out is None:
                return merged
            out.copy_(merged)
            return out
        out = self._out_like(q_local) if out is None else out
        if not step.has_local_rows:  # still serves the other ranks' split context below
            lse = torch.empty(q_local.shape[:2], dtype=torch.float32, device=q_local.device)
        else:
            out, lse = self._new.run(q_local, k_step.index_select(0, step.new_kv_index),
                                     v_step.index_select(0, step.new_kv_index),
                                     out=out, return_lse=True)
        if len(step.plan.ctx_split.query_index):  # the same row set on every rank
            self._add_split_context(step, group, q_local, kv_cache, out, lse)
        if step.num_replicated:
            self._add_replicated_context(step, group, q_local, kv_cache, out, lse)
        return out

    def _add_replicated_context(self, step: PlannedDCPStep, group, q_local, kv_cache,
                                out, lse) -> None:
        """Replicated rows: each rank attends its shard; partials all-gathered, merged
        into ``out``/``lse`` in place."""
        send, part_out, part_lse = self._step_partials(  # rows that see no keys here
            step, "replicated", step.num_replicated, q_local, empty=not step.replicated_covered)
        part_out, part_lse = part_out[0], part_lse[0]
        for wrapper, query, slot in step.replicated_calls:
            q_rows = q_local[query]
            if isinstance(slot, slice):  # the kernel writes the partials in place
                wrapper.run(q_rows, kv_cache, out=part_out[slot], lse=part_lse[slot],
                            return_lse=True)
            else:
                part_out[slot], part_lse[slot] = wrapper.run(
                    q_rows, kv_cache, out=self._out_like(q_rows), return_lse=True)
        ctx_o, ctx_s = self._gather_merged(group, send, part_out.shape)
        self._merge_into(out, lse, step.replicated_rows, ctx_o, ctx_s)

    def _merge_into(self, out: torch.Tensor, lse: torch.Tensor, rows, ctx_o: torch.Tensor,
                    ctx_s: torch.Tensor) -> None:
        """Merge ``ctx_o``/``ctx_s`` into ``rows`` of ``out``/``lse`` (in place for a slice)."""
        if isinstance(rows, slice):
            self._merge_state_in_place(out[rows], lse[rows], ctx_o, ctx_s)
        else:
            out[rows], lse[rows] = self._merge_state(ctx_o, ctx_s, out[rows], lse[rows])

    def _run_decode(self, step: PlannedDCPStep, group, q: torch.Tensor,
                    kv_cache) -> torch.Tensor:
        """Every rank's shard partial of ``q [B, Hq, D]``, gathered and merged."""
        send, out, lse = self._partials(q.shape[0], q)
        step.decode_wrapper.run(q, kv_cache, out=out[0], lse=lse[0], return_lse=True)
        return self._gather_merged(group, send, q.shape)[0]

    def _partials(self, rows: int, q: torch.Tensor, blocks: int = 1):
        """``(send, out [blocks, rows, Hq, D], lse [blocks, rows, Hq] float32)``, views of
        one buffer so that one collective moves both; blocks 128-byte aligned (the merge
        kernels' vector loads need it)."""
        send = torch.empty(blocks * self._block_numel(rows, q.shape), dtype=self.dtype,
                           device=q.device)
        return (send, *self._unpack(send, blocks, rows, q.shape))

    def _step_partials(self, step: PlannedDCPStep, name: str, rows: int, q: torch.Tensor,
                       blocks: int = 1, empty: bool = False):
        """:meth:`_partials` made in the step's first layer and reused by the rest (one
        stream: a layer's collective reads them before the next layer writes). ``empty``:
        made as output 0, LSE -inf; every layer writes the same rows, the rest stay so."""
        key = (name, rows, blocks, *q.shape[1:])
        made = step.buffers.get(key)
        if made is None:
            made = step.buffers[key] = self._partials(rows, q, blocks)
            if empty:
                made[1].zero_(), made[2].fill_(float("-inf"))
        return made

    def _block_numel(self, rows: int, shape) -> int:
        """Elements of one block: ``rows`` outputs and LSEs, rounded up to 128 bytes."""
        size = rows * shape[1] * (shape[2] + 4 // self.dtype.itemsize)
        return -(-size * self.dtype.itemsize // 128) * 128 // self.dtype.itemsize

    def _unpack(self, buf: torch.Tensor, blocks: int, rows: int, shape):
        """The views ``(out, lse)`` of a :meth:`_partials` buffer."""
        hq, dim = shape[1], shape[2]
        size = rows * hq * dim
        buf = buf.view(blocks, self._block_numel(rows, shape))
        lse = buf[:, size:size + rows * hq * 4 // self.dtype.itemsize].view(torch.float32)
        return buf[:, :size].view(blocks, rows, hq, dim), lse.view(blocks, rows, hq)

    def _gather_merged(self, group, send: torch.Tensor, shape):
        """All-gather every rank's one-block :meth:`_partials` buffer and merge by LSE:
        ``(out [rows, Hq, D], lse [rows, Hq])``."""
        outs, lses = self._unpack(group.all_gather(send, dim=0), group.world_size,
                                  shape[0], shape)
        return self._merge_ranks(outs, lses)

    def _merge_ranks(self, outs: torch.Tensor, lses: torch.Tensor):
        """Merge ``outs [N, rows, Hq, D]`` / ``lses [N, rows, Hq]`` by LSE."""
        if len(outs) == 2:
            return self._merge_state(outs[0], lses[0], outs[1], lses[1])
        return self._merge_states(outs.transpose(0, 1).contiguous(),
                                  lses.transpose(0, 1).contiguous())

    def _out_like(self, q: torch.Tensor) -> torch.Tensor:
        return torch.empty(q.shape, dtype=self.dtype, device=q.device)

    def _add_split_context(self, step: PlannedDCPStep, group, q_local, kv_cache, out,
                           lse) -> None:
        """Split rows: every rank's queries over this rank's shard, partials back to their
        owners by all-to-all, merged into ``out``/``lse`` in place."""
        n, padded = group.world_size, step.plan.pcp.num_padded_tokens_per_rank
        q_all = all_gather_padded(group, q_local, padded)
        # block q of the buffer: partials of rank q's queries, outputs and LSEs together
        send, part_out, part_lse = self._step_partials(  # queries that see no keys here
            step, "split", padded, q_local, n, empty=True)
        if step.split_query is not None:
            q_split = q_all.index_select(0, step.split_query)
            o, s = self._split.run(q_split, kv_cache, out=self._out_like(q_split),
                                   return_lse=True)
            owner, row = step.split_owner_row
            part_out[owner, row], part_lse[owner, row] = o, s
        recv_out, recv_lse = self._unpack(all_to_all(group, send), n, padded, q_local.shape)
        mine = step.owned_split
        if mine is not None:
            ctx_o, ctx_s = self._merge_ranks(recv_out[:, mine], recv_lse[:, mine])
            self._merge_into(out, lse, mine, ctx_o, ctx_s)
