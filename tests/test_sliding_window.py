"""Sliding-window attention under ``-pcp N`` at DCP = 1, on vLLM 0.26.0's FlashInfer.

At DCP = 1 every layer runs vLLM's own FlashInfer plan over the rank's local rows.
Each split chunk is a bottom-right-causal row whose KV length is the absolute end of
the chunk, so the window FlashInfer applies (``window_left`` keys before each query's
absolute position) is the one-GPU window. On SM90 vLLM's FlashInfer builder refuses
sliding-window layers at engine start, whatever the plugin does.
"""
import math

import pytest
import torch

from helpers import attention_layer, flashinfer_on_cpu, plan_split_rows
from vllm_pcp.pcp.partition import build_pcp_metadata_all_ranks

WINDOW = 16  # tokens: FlashInfer's window_left is WINDOW - 1


def windowed_attention(q, k, v, window_left):
    """FlashInfer's causal attention with ``window_left``: the ``Tq`` queries are the
    last of ``Tk`` tokens; query i (absolute position ``p = Tk - Tq + i``) sees keys
    ``p - window_left <= j <= p``."""
    tq, tk = q.shape[0], k.shape[0]
    pos = torch.arange(tk - tq, tk).unsqueeze(1)
    key = torch.arange(tk).unsqueeze(0)
    visible = (key <= pos) & (key >= pos - window_left)
    group = q.shape[1] // k.shape[1]
    scores = torch.einsum("qhd,khd->hqk", q, k.repeat_interleave(group, 1))
    scores = scores.masked_fill(~visible, float("-inf")) / math.sqrt(q.shape[-1])
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v.repeat_interleave(group, 1))


def _rank_output(plan, q, kv, window_left):
    """One rank's rows, each attending over its request's paged prefix (DCP = 1: the
    cache holds every token), padded to the gathered layout's ``P`` rows."""
    out = torch.zeros(plan.num_padded_tokens_per_rank, *q.shape[1:])
    local = plan.local_token_indices
    for row in range(plan.num_rows):
        lo, hi = int(plan.query_start_loc[row]), int(plan.query_start_loc[row + 1])
        k, v = kv[int(plan.row_req_indices[row])]
        kv_len = int(plan.seq_lens[row])
        out[lo:hi] = windowed_attention(q[local[lo:hi]], k[:kv_len], v[:kv_len],
                                        window_left)
    return out


@pytest.mark.parametrize("world", [2, 3, 4])
def test_split_rows_see_the_one_gpu_window(world):
    """A fresh prompt, a chunk over earlier context, a decode: every split row's
    window, applied at its absolute offset, equals one GPU's."""
    computed, scheduled = [0, 40, 30], [57, 50, 1]
    g = torch.Generator().manual_seed(world)
    kv = [(torch.randn(c + s, 2, 16, generator=g), torch.randn(c + s, 2, 16, generator=g))
          for c, s in zip(computed, scheduled)]
    q = torch.randn(sum(scheduled), 8, 16, generator=g)
    plans = build_pcp_metadata_all_ranks(computed, scheduled, world, min_split_tokens=2)
    assert plans[0].num_split_requests == 2
    gathered = torch.cat([_rank_output(p, q, kv, WINDOW - 1) for p in plans])
    restored = gathered[plans[0].restore_indices]
    starts = [0, scheduled[0], scheduled[0] + scheduled[1]]
    for req, (start, n) in enumerate(zip(starts, scheduled)):
        one_gpu = windowed_attention(q[start:start + n], *kv[req], WINDOW - 1)
        torch.testing.assert_close(restored[start:start + n], one_gpu, rtol=0, atol=1e-5)
    # the window matters here: without it the split rows see other keys
    full = windowed_attention(q[:scheduled[0]], *kv[0], window_left=10 ** 6)
    assert (restored[:scheduled[0]] - full).abs().max() > 1e-2


@pytest.fixture
def sliding_window_builder(tmp_path, monkeypatch):
    """``make(sm90)``: the plugin's FlashInfer builder of a real ``-pcp 2`` config
    whose one layer has a 16-token window, on a GPU shown as SM90 or not."""
    import vllm.config.vllm as vllm_config_module
    from transformers import Qwen2Config
    from vllm.config import (AttentionConfig, DeviceConfig, ModelConfig, ParallelConfig,
                             VllmConfig, set_current_vllm_config)
    from vllm.v1.kv_cache_interface import SlidingWindowSpec

    from vllm_pcp.backend import PCPFlashInferImpl, PCPFlashInferMetadataBuilder

    monkeypatch.setattr(vllm_config_module, "HAS_TRITON", True)
    Qwen2Config(hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                num_attention_heads=8, num_key_value_heads=2, vocab_size=256,
                max_position_embeddings=4096, use_sliding_window=True,
                sliding_window=WINDOW, max_window_layers=1).save_pretrained(tmp_path)
    config = VllmConfig(
        model_config=ModelConfig(model=str(tmp_path), skip_tokenizer_init=True,
                                 dtype="bfloat16"),
        device_config=DeviceConfig(device="cuda"),
        parallel_config=ParallelConfig(prefill_context_parallel_size=2),
        attention_config=AttentionConfig(backend="FLASHINFER"))
    spec = SlidingWindowSpec(block_size=16, num_kv_heads=2, head_size=8,
                             dtype=torch.bfloat16, sliding_window=WINDOW)
    def make(sm90: bool):
        flashinfer_on_cpu(monkeypatch, sm90)
        with set_current_vllm_config(config):
            impl = PCPFlashInferImpl(8, 8, 0.125, 2, None, WINDOW, "auto")
            config.compilation_config.static_forward_context["layers.0.attn"] = \
                attention_layer(impl)
            return PCPFlashInferMetadataBuilder(spec, ["layers.0.attn"], config,
                                                torch.device("cpu"))

    return make


def test_sm90_refuses_sliding_window_layers(sliding_window_builder):
    """vLLM 0.26.0's own check (FlashInferMetadataBuilder.__init__, flashinfer.py
    ~794-804) stops the engine at start-up, under -pcp as on one GPU."""
    with pytest.raises(NotImplementedError, match="FlashInfer backend on SM90 currently "
                       "crashes with sliding-window attention layers"):
        sliding_window_builder(sm90=True)


def test_split_rows_plan_the_window_elsewhere(sliding_window_builder, monkeypatch):
    """Off SM90 the split step's stock plan carries window_left = WINDOW - 1 over the
    local rows (causal), whose KV lengths are their chunks' absolute ends."""
    builder = sliding_window_builder(sm90=False)
    assert (builder.window_left, builder.global_hyperparameters.window_left) == (15, 15)
    plan, _, planned = plan_split_rows(builder, monkeypatch, rank=1)
    assert (planned["window_left"], planned["causal"]) == (WINDOW - 1, True)
    # rank 1 of 2 holds chunks 1 and 2 of 4: 16 queries each, ending at 32 and 48
    assert planned["qo_indptr"].tolist() == [0, 16, 32]
    assert plan.seq_lens.tolist() == [32, 48]
    assert planned["paged_kv_indptr"].tolist() == [0, 2, 5]  # 16-token pages
    assert planned["paged_kv_last_page_len"].tolist() == [16, 16]
