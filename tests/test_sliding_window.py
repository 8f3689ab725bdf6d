"""Sliding-window attention under every ``-pcp`` layout: refused, with the way out.

vLLM's PCP manager gathers each rank's block tables without the sliding-window masking
of freed blocks, and vllm-pcp's DCP attention plans no window, so vllm-pcp refuses a
model with a sliding window under ``-pcp N`` and ``-pcp N -dcp N`` alike. The refusal
names ``--disable-sliding-window`` (full attention, ``--max-model-len`` capped at the
window), which vLLM applies by clearing the window from the model's config. Checked on
vLLM's own configs of a small Qwen2, and per layer (``PCPFlashInferImpl``), which stops a
window that reaches a layer past the config's check.
"""
import pytest

from layer_harness import make_impl
from vllm_pcp.config import PCPConfigError, prepare_pcp_config

WINDOW = 64


@pytest.fixture
def qwen2(tmp_path, monkeypatch):
    """``make(pcp, dcp, window=True, **model)``: vLLM's VllmConfig of a 2-layer Qwen2 whose
    layers use a 64-token window (``window`` False: the config names one, unused);
    ``model``: ModelConfig's other arguments."""
    from transformers import Qwen2Config

    from helpers import vllm_config_of

    def make(pcp, dcp=1, window=True, **model):
        Qwen2Config(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                    num_attention_heads=8, num_key_value_heads=2, vocab_size=256,
                    max_position_embeddings=4096, use_sliding_window=window,
                    sliding_window=WINDOW, max_window_layers=0).save_pretrained(tmp_path)
        return vllm_config_of(tmp_path, monkeypatch, dict(
            prefill_context_parallel_size=pcp, decode_context_parallel_size=dcp),
            model=model)

    return make


@pytest.mark.parametrize("pcp,dcp,drop", [(2, 1, "drop -pcp"), (4, 1, "drop -pcp"),
                                          (2, 2, "drop -pcp and -dcp")])
def test_a_models_window_is_refused_under_every_layout(qwen2, pcp, dcp, drop):
    cfg = qwen2(pcp, dcp)
    assert cfg.model_config.get_sliding_window() == WINDOW  # vLLM runs the window
    with pytest.raises(PCPConfigError) as err:
        prepare_pcp_config(cfg)
    msg = str(err.value)
    assert f"sliding-window attention (the model's sliding_window = {WINDOW})" in msg
    assert ("pass --disable-sliding-window (caps --max-model-len at the window), or "
            f"{drop}") in msg


@pytest.mark.parametrize("pcp,dcp", [(2, 1), (2, 2)])
def test_disable_sliding_window_is_the_way_out(qwen2, pcp, dcp):
    """``--disable-sliding-window``: vLLM attends the whole context, caps the context at
    the window, and the plugin takes the config."""
    cfg = qwen2(pcp, dcp, disable_sliding_window=True)
    assert cfg.model_config.get_sliding_window() is None
    assert cfg.model_config.max_model_len == WINDOW
    assert prepare_pcp_config(cfg)


def test_a_window_the_model_does_not_use_is_no_refusal(qwen2):
    cfg = qwen2(2, window=False)
    assert cfg.model_config.get_sliding_window() is None
    assert prepare_pcp_config(cfg)


@pytest.mark.parametrize("pcp,dcp", [(2, 1), (4, 1), (2, 2)])
def test_a_sliding_window_layer_is_refused_under_every_layout(monkeypatch, pcp, dcp):
    """A layer built with a window (a model whose config names it elsewhere than
    ``sliding_window``) is refused where the model is built, under every layout, as the
    config's refusal says, naming the way out; without a window the layer is taken."""
    with pytest.raises(PCPConfigError, match=f"a sliding window of {WINDOW} tokens "
                       r"\(--disable-sliding-window turns it off\)"):
        _window_layer(monkeypatch, pcp, dcp, WINDOW)
    assert _window_layer(monkeypatch, pcp, dcp, None).sliding_window == (-1, -1)


def _window_layer(monkeypatch, pcp, dcp, window):
    """Rank 0's ``PCPFlashInferImpl`` of a layer with ``window`` at PCP ``pcp``, DCP ``dcp``."""
    from vllm_pcp.backend import PCPFlashInferImpl

    make_impl(monkeypatch, pcp, 0, 8, 2, 64, dcp)  # the group sizes the layer reads
    return PCPFlashInferImpl(8, 64, 0.125, 2, None, window, "auto")
