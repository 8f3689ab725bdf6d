"""The ragged kernel of fresh split steps (``vllm_pcp.pcp.ragged``) on real FlashInfer,
against the paged kernel the other split steps use, and against one process (GPU only).

``PCPFlashInferImpl`` on a fresh step for every rank of a thread group on one GPU, as
vLLM's runner drives it (``tests/split_harness.py``): the layer all-gathers the step's
K/V, writes it with vLLM's cache kernel and attends its rows over the gathered K/V. Each
rank's rows must equal FlashInfer's paged prefill over the cache it wrote, within the
tolerance of ``benchmarks/kernel_choice.py``, and the restored output causal attention of
each prompt. Prompts shorter than 4N tokens are computed whole on every rank.

    python -m pytest -q tests/gpu            # on a CUDA machine with vLLM installed
"""
import math

import pytest
import torch

from split_harness import PAGE, run_ragged_split_step

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

TOL = dict(atol=3e-2, rtol=3e-2)  # bf16; benchmarks/kernel_choice.py's tolerance
STEPS = {2: [1000, 37, 2, 300], 3: [999, 5, 64], 4: [2048, 1, 9], 8: [4096, 33]}


def _paged(result, hq, hkv, dim):
    """FlashInfer's paged prefill (causal, vLLM's kernel for split rows) of the rank's
    rows over the cache the layer wrote."""
    import flashinfer

    from vllm_pcp.dcp.index import paged_kv_layout

    plan, q = result.plan, result.q_local
    if not plan.num_rows:
        return q.new_zeros(q.shape)
    table = result.table.index_select(0, plan.row_req_indices.to(q.device, torch.int64))
    indptr, indices, last = paged_kv_layout(plan.seq_lens, table, PAGE)
    workspace = torch.empty(128 << 20, dtype=torch.uint8, device=q.device)
    wrapper = flashinfer.BatchPrefillWithPagedKVCacheWrapper(workspace, result.kv_layout)
    wrapper.plan(plan.query_start_loc, indptr, indices, last, hq, hkv, dim, PAGE,
                 causal=True, sm_scale=1 / math.sqrt(dim), q_data_type=q.dtype,
                 kv_data_type=q.dtype)
    return wrapper.run(q, result.kv)


@pytest.mark.parametrize("world", [2, 3, 4, 8])
@pytest.mark.parametrize("dim", [64, 128, 256])
@pytest.mark.parametrize("hkv", [1, 2, 8])
def test_ragged_rows_equal_the_paged_kernel(monkeypatch, world, dim, hkv):
    from vllm_pcp.backend import PCPRaggedMetadata

    hq = 16
    results, expect = run_ragged_split_step(monkeypatch, world, STEPS[world], "cuda",
                                            torch.bfloat16, hq=hq, hkv=hkv, dim=dim,
                                            seed=world + dim + hkv,
                                            kv_layout=("NHD", "HND")[dim // 128 % 2])
    for rank, result in enumerate(results):
        assert isinstance(result.metadata, PCPRaggedMetadata)
        assert result.cache_written, rank
        torch.testing.assert_close(result.out_local, _paged(result, hq, hkv, dim), **TOL)
        torch.testing.assert_close(result.restored, expect, **TOL)
