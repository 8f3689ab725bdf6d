"""The plugin's FlashInfer layer on a PCP x DCP step, against one process (GPU only).

``PCPFlashInferImpl`` on every rank of a thread group on one GPU, as vLLM's Model Runner
V2 drives it (``tests/layer_harness.py``: vLLM's PCP manager splits the step and lays out
its slot mapping, the plugin's builder plans it, vLLM's manager restores the output):
the layer reads the context rows it sends, all-gathers the step's K/V, writes its share
into a KV cache in vLLM's per-layer layout with vLLM's cache kernel, and runs the planned
DCP attention. Each rank's restored output must equal causal attention of the whole
batch, and its cache must hold exactly the tokens it owns.

    python -m pytest -q tests/gpu            # on a CUDA machine with vLLM installed
"""
import pytest
import torch

from layer_harness import run_dcp_layer_step

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

TOL = dict(atol=3e-2, rtol=3e-2)  # bf16 inputs
STEPS = {"split": {}, "decode": dict(computed=[40, 17, 77, 300], scheduled=[1, 1, 1, 1])}


@pytest.mark.parametrize("world,interleave,exchange,kv_layout", [
    (2, 1, "queries", "NHD"), (2, 8, "keys", "HND"), (2, 16, "auto", "HND"),
    (3, 8, "keys", "NHD"), (4, 8, "queries", "HND")])
@pytest.mark.parametrize("step", sorted(STEPS))
def test_dcp_layer_gathers_writes_and_attends(monkeypatch, world, interleave, exchange,
                                              kv_layout, step):
    results, expect = run_dcp_layer_step(monkeypatch, world, interleave, exchange, "cuda",
                                         torch.bfloat16, kv_layout=kv_layout, **STEPS[step])
    for out, cache, expect_cache, _ in results:
        torch.testing.assert_close(out, expect, **TOL)
        assert torch.equal(cache, expect_cache)  # every owned token written, once, exactly
