"""DCPAttention's data movement on the CPU, with FlashInfer's kernels replaced by
the reference ones: every rank's output must equal one process's attention."""
import sys
from types import SimpleNamespace

import pytest
import torch

from dcp_harness import run_dcp_step
from vllm_pcp import reference


class _Ragged:
    def __init__(self, workspace, layout):
        pass

    def plan(self, qo_indptr, kv_indptr, hq, hkv, dim, causal=False, **kw):
        self.qo, self.kv, self.causal = qo_indptr.cpu(), kv_indptr.cpu(), causal

    def run(self, q, k, v, return_lse=False):
        out = _rows(q, self.qo, lambda r: (k[self.kv[r]:self.kv[r + 1]],
                                           v[self.kv[r]:self.kv[r + 1]]), self.causal)
        return out if return_lse else out[0]


class _Paged:
    def __init__(self, workspace, layout):
        assert layout == "NHD"

    def plan(self, qo_indptr, indptr, indices, last, hq, hkv, dim, page_size,
             causal=False, **kw):
        self.qo, self.indptr, self.indices = qo_indptr.cpu(), indptr.cpu(), indices.cpu()
        self.last, self.causal = last.cpu(), causal

    def run(self, q, kv_cache, return_lse=False):
        k_cache, v_cache = kv_cache

        def kv(r):
            pages = self.indices[self.indptr[r]:self.indptr[r + 1]].long()
            n = (len(pages) - 1) * k_cache.shape[1] + int(self.last[r])
            return (k_cache[pages].flatten(0, 1)[:n], v_cache[pages].flatten(0, 1)[:n])
        out = _rows(q, self.qo, kv, self.causal)
        return out if return_lse else out[0]


def _rows(q, qo, kv_of_row, causal):
    out = torch.zeros(q.shape, dtype=q.dtype)
    lse = torch.zeros(q.shape[:2])
    for r in range(len(qo) - 1):
        k, v = kv_of_row(r)
        o, s = reference.causal_attention(q[qo[r]:qo[r + 1]], k, v, causal=causal)
        out[qo[r]:qo[r + 1]], lse[qo[r]:qo[r + 1]] = o.to(q.dtype), s
    return out, lse


@pytest.fixture
def reference_flashinfer(monkeypatch):
    fake = SimpleNamespace(BatchPrefillWithRaggedKVCacheWrapper=_Ragged,
                           BatchPrefillWithPagedKVCacheWrapper=_Paged,
                           merge_state=reference.merge_state,
                           merge_states=reference.merge_states)
    monkeypatch.setitem(sys.modules, "flashinfer", fake)


@pytest.mark.parametrize("world,interleave", [(2, 1), (2, 16), (4, 8)])
@pytest.mark.parametrize("min_split", [2, 16])
def test_dcp_attention_matches_one_process(reference_flashinfer, world, interleave, min_split):
    outs, expect = run_dcp_step(world, interleave, min_split, "cpu", torch.float32)
    for out in outs:
        torch.testing.assert_close(out, expect, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("computed,scheduled", [
    ([40, 1, 77], [1, 1, 1]),      # decode only: no split rows, no Q all-gather
    ([0, 0], [64, 9]),             # fresh prefills: no context anywhere
    ([3, 0], [1, 50])])            # a rank with no context tokens of request 0
def test_dcp_attention_steps_without_split_context(reference_flashinfer, computed, scheduled):
    outs, expect = run_dcp_step(2, 8, 2, "cpu", torch.float32, computed=computed,
                                scheduled=scheduled)
    for out in outs:
        torch.testing.assert_close(out, expect, atol=1e-5, rtol=1e-5)
