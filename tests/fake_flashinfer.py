"""FlashInfer's wrappers and merges as the plugin drives them, computed by the plain-torch
reference kernels (``tests/reference.py``), for the CPU tests.

:func:`fake_flashinfer` keeps FlashInfer's contract as the plugin uses it: ``out``, where
given, must have the planned ``o_data_type`` (by default the query dtype) and results
are written into it, the merges take 16-bit values, and no wrapper plans a batch of no
rows (no rank of a step the manager splits has a kernel without rows). ``dtypes`` names
the output dtypes FlashInfer builds kernels for: 16-bit ones (it builds no float32-output
kernel), or with float32 added, so that float32 inputs check the index logic to 1e-5.
"""
from __future__ import annotations

from types import SimpleNamespace

import torch

import reference

SIXTEEN_BIT = (torch.float16, torch.bfloat16)


class _Wrapper:
    dtypes = SIXTEEN_BIT

    def __init__(self, workspace, layout, backend="auto"):
        assert layout in ("NHD", "HND") and backend == "auto"
        self.layout = layout

    @staticmethod
    def _check_batch(qo_indptr):
        assert len(qo_indptr) > 1, "a plan of no rows"

    def _plan_common(self, q_data_type, o_data_type=None, **kw):
        self.o_dtype = o_data_type or q_data_type
        assert self.o_dtype in self.dtypes, "FlashInfer JIT: no such output dtype"

    def _finish(self, out, lse, into, return_lse, lse_into=None):
        if into is None:  # FlashInfer allocates the output
            into = torch.empty(out.shape, dtype=self.o_dtype, device=out.device)
        assert into.dtype == self.o_dtype, "out must be o_data_type"
        into.copy_(out)
        if lse_into is not None:  # FlashInfer checks shape, dtype and device only
            assert lse_into.shape == lse.shape and lse_into.dtype == torch.float32
            lse = lse_into.copy_(lse)
        return (into, lse) if return_lse else into


class _Ragged(_Wrapper):
    def plan(self, qo_indptr, kv_indptr, hq, hkv, dim, causal=False, **kw):
        self._check_batch(qo_indptr)
        self.qo, self.kv, self.causal = qo_indptr.cpu(), kv_indptr.cpu(), causal
        self._plan_common(**kw)

    def run(self, q, k, v, out=None, return_lse=False):
        o, lse = _rows(q, self.qo, lambda r: (k[self.kv[r]:self.kv[r + 1]],
                                              v[self.kv[r]:self.kv[r + 1]]), self.causal)
        return self._finish(o, lse, out, return_lse)


class _Paged(_Wrapper):
    def plan(self, qo_indptr, indptr, indices, last, hq, hkv, dim, page_size,
             causal=False, **kw):
        self._check_batch(qo_indptr)
        self.qo, self.indptr, self.indices = qo_indptr.cpu(), indptr.cpu(), indices.cpu()
        self.last, self.causal = last.cpu(), causal
        self._plan_common(**kw)

    def run(self, q, kv_cache, out=None, lse=None, return_lse=False):
        k_cache, v_cache = kv_cache
        if self.layout == "HND":  # [pages, Hkv, page_size, D] -> [pages, page_size, Hkv, D]
            k_cache, v_cache = k_cache.transpose(1, 2), v_cache.transpose(1, 2)

        def kv(r):
            pages = self.indices[self.indptr[r]:self.indptr[r + 1]].long()
            n = (len(pages) - 1) * k_cache.shape[1] + int(self.last[r])
            return (k_cache[pages].flatten(0, 1)[:n], v_cache[pages].flatten(0, 1)[:n])
        o, s = _rows(q, self.qo, kv, self.causal)
        return self._finish(o, s, out, return_lse, lse)


class _Decode(_Paged):
    """The decode wrapper: one query per row, no qo_indptr; planned by vLLM's
    ``fast_plan_decode``, which calls ``plan`` with the whole batch's host arrays."""

    def __init__(self, workspace, layout, use_tensor_cores=False):
        assert layout in ("NHD", "HND") and use_tensor_cores
        self.layout = layout
        self.is_cuda_graph_enabled = False

    def plan(self, indptr, indices, last_page_len, num_qo_heads, num_kv_heads, head_dim,
             page_size, **kw):
        assert len(kw.pop("seq_lens")) == len(last_page_len)
        super().plan(torch.arange(len(indptr), dtype=torch.int32), indptr, indices,
                     last_page_len, num_qo_heads, num_kv_heads, head_dim, page_size,
                     causal=False, **kw)


def _rows(q, qo, kv_of_row, causal):
    out = torch.zeros(q.shape)
    lse = torch.zeros(q.shape[:2])
    for r in range(len(qo) - 1):
        k, v = kv_of_row(r)
        o, s = reference.causal_attention(q[qo[r]:qo[r + 1]].float(), k.float(), v.float(),
                                          causal=causal)
        out[qo[r]:qo[r + 1]], lse[qo[r]:qo[r + 1]] = o, s
    return out, lse


def _merge(merge, dtypes):
    """FlashInfer's merge kernels: values of ``dtypes`` in, the same dtype out."""
    def run(v, *rest):
        assert v.dtype in dtypes, "merge kernels take 16-bit values"
        o, s = merge(v, *rest)
        return o.to(v.dtype), s
    return run


def _merge_in_place(merge, dtypes):
    """FlashInfer's ``merge_state_in_place(v, s, v_other, s_other)``: ``(v, s)`` updated."""
    def run(v, s, v_other, s_other):
        assert v.dtype in dtypes and s.dtype == torch.float32
        o, t = merge(v, s, v_other, s_other)
        v.copy_(o.to(v.dtype)), s.copy_(t)
    return run


def fake_flashinfer(dtypes=SIXTEEN_BIT) -> SimpleNamespace:
    """A ``flashinfer`` module of the reference kernels whose outputs and merges take
    ``dtypes``."""
    contract = {"dtypes": dtypes}
    return SimpleNamespace(
        BatchPrefillWithRaggedKVCacheWrapper=type("Ragged", (_Ragged,), contract),
        BatchPrefillWithPagedKVCacheWrapper=type("Paged", (_Paged,), contract),
        BatchDecodeWithPagedKVCacheWrapper=type("Decode", (_Decode,), contract),
        merge_state=_merge(reference.merge_state, dtypes),
        merge_states=_merge(reference.merge_states, dtypes),
        merge_state_in_place=_merge_in_place(reference.merge_state, dtypes))


def install(monkeypatch, float32: bool) -> None:
    """Put :func:`fake_flashinfer` in ``sys.modules`` for the test (vLLM's FlashInfer
    backend imported first, so that it keeps its own import)."""
    import sys

    import vllm.v1.attention.backends.flashinfer  # noqa: F401

    dtypes = (*SIXTEEN_BIT, torch.float32) if float32 else SIXTEEN_BIT
    monkeypatch.setitem(sys.modules, "flashinfer", fake_flashinfer(dtypes))


def torch_cache_write(self, layer, key, value, kv_cache, slot_mapping):
    """vLLM's FlashInfer cache write (``reshape_and_cache_flash``) in plain torch: row i
    of key/value to slot ``slot_mapping[i]``, -1 skipped; the slot mapping's length is
    the row count, as for vLLM's kernel."""
    k_cache, v_cache = kv_cache.transpose(1, 2).split(self.head_size, dim=-1)
    keep = slot_mapping >= 0
    slots = slot_mapping[keep]
    page = k_cache.shape[1]
    k_cache[slots // page, slots % page] = key[:len(slot_mapping)][keep]
    v_cache[slots // page, slots % page] = value[:len(slot_mapping)][keep]
