"""The plugin's FlashInfer layer on a PCP x DCP step, against one process (GPU only).

``PCPFlashInferImpl.forward`` with the step's ``PCPDCPMetadata``, as the runner
builds it, for every rank of a thread group on one GPU (``tests/layer_harness.py``):
the layer reads the context rows it sends, all-gathers the step's K/V, writes
its share into a vLLM-layout KV cache with vLLM's cache kernel, and runs the
planned DCP attention. Each rank's restored output must equal causal attention
of the whole batch, and its cache must hold exactly the tokens it owns.

    python -m pytest -q tests/gpu            # on a CUDA machine with vLLM installed
"""
import pytest
import torch

from layer_harness import run_dcp_layer_step

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

TOL = dict(atol=3e-2, rtol=3e-2)  # bf16 inputs


@pytest.mark.parametrize("world,interleave,exchange", [
    (2, 1, "queries"), (2, 8, "keys"), (2, 16, "auto"), (3, 8, "keys"), (4, 8, "queries")])
def test_dcp_layer_gathers_writes_and_attends(monkeypatch, world, interleave, exchange):
    results, expect = run_dcp_layer_step(monkeypatch, world, interleave, exchange, "cuda",
                                         torch.bfloat16)
    for out, cache, expect_cache in results:
        torch.testing.assert_close(out, expect, **TOL)
        assert torch.equal(cache, expect_cache)  # every owned token written, once, exactly
