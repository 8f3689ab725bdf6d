"""Attention settings of vLLM's FlashInferImpl that vllm-pcp's attention paths do not
apply, refused at start-up (vllm_pcp.config) and again per layer (PCPFlashInferImpl,
PCPFlashInferMetadataBuilder); and settings the split path's stock plan does apply.

- ALiBi: vLLM's FlashInferImpl keeps ``alibi_slopes`` and never reads them, so under
  every layout the plugin takes over (``-pcp``, ``-pcp -dcp``) each layer would run
  plain causal attention.
- cross-layer KV sharing (Gemma 3n, Gemma 4): not verified.
- under DCP: windows, soft caps, sinks and a quantized KV cache per layer, and layers of
  one KV cache group with different softmax scales (the DCP attention plans one).
- at PCP = 1 (DCP inside TP included) every layer is vLLM's own, settings kept.
"""
import json
from types import SimpleNamespace

import pytest
import torch

from helpers import plan_split_rows
from test_config import _config, _refusal
from vllm_pcp.config import PCPConfigError, prepare_pcp_config

BLOOM = dict(architectures=["BloomForCausalLM"], model_type="bloom", hidden_size=64,
             n_head=8, n_layer=2, vocab_size=256, layer_norm_epsilon=1e-5)
FALCON = dict(architectures=["FalconForCausalLM"], model_type="falcon", hidden_size=64,
              num_attention_heads=8, num_hidden_layers=2, vocab_size=256,
              new_decoder_architecture=False, multi_query=True, parallel_attn=True,
              bias=False, max_position_embeddings=2048)


@pytest.fixture
def config_of(tmp_path, monkeypatch):
    """``make(hf, pcp, dcp, tp)``: vLLM's own VllmConfig of the model whose
    config.json is ``hf``, written to ``tmp_path``."""
    from vllm.config import AttentionConfig

    from helpers import vllm_config_of

    def make(hf, pcp=2, dcp=1, tp=1):
        (tmp_path / "config.json").write_text(json.dumps(hf))
        kwargs = {} if pcp > 1 else dict(attention_config=AttentionConfig(backend="FLASHINFER"))
        return vllm_config_of(tmp_path, monkeypatch, dict(
            prefill_context_parallel_size=pcp, decode_context_parallel_size=dcp,
            tensor_parallel_size=tp), **kwargs)

    return make


def _alibi_refusal(arch: str, drop: str) -> str:
    return (f"ALiBi attention ({arch}: vLLM's ModelConfig.uses_alibi): vllm-pcp's attention "
            "adds no ALiBi bias (vLLM's FlashInferImpl keeps the slopes and never reads "
            f"them); {drop}: vLLM's default attention backend applies ALiBi on one GPU and "
            "with -tp alone")


@pytest.mark.parametrize("layout,drop", [
    (dict(pcp=2), "drop -pcp"), (dict(pcp=2, dcp=2), "drop -pcp and -dcp")])
def test_bloom_is_refused_under_pcp_and_dcp(config_of, layout, drop):
    """A 2-layer BLOOM, whose every layer vLLM builds with ALiBi slopes. (BLOOM cannot
    run DCP inside TP: vLLM needs more TP ranks than KV heads, and BLOOM has one KV head
    per query head.)"""
    assert _alibi_refusal("BloomForCausalLM", drop) in _refusal(
        lambda: config_of(BLOOM, **layout))


def test_dcp_inside_tp_is_left_to_vllm(config_of):
    """-tp 2 -dcp 2 --attention-backend FLASHINFER on a multi-query Falcon with ALiBi: PCP
    = 1, so vLLM's own FlashInfer DCP runs it, and the plugin neither refuses nor takes
    the config."""
    cfg = config_of({**FALCON, "alibi": True}, pcp=1, dcp=2, tp=2)
    assert cfg.model_config.uses_alibi
    assert not prepare_pcp_config(cfg)


@pytest.mark.parametrize("hf,alibi", [
    ({**FALCON, "alibi": True}, True), ({**FALCON, "alibi": False}, False)])
def test_falcon_is_refused_when_its_config_turns_alibi_on(config_of, hf, alibi):
    cfg = config_of(hf)
    assert cfg.model_config.uses_alibi is alibi  # vLLM's own test, which the check reads
    if alibi:
        assert "ALiBi attention (" in _refusal(lambda: cfg)
    else:
        assert prepare_pcp_config(cfg)


def test_step1_is_refused_by_architecture():
    """step1.py always passes ALiBi slopes (square-root variant), which
    ModelConfig.uses_alibi does not name."""
    with pytest.raises(PCPConfigError, match=r"ALiBi attention \(architecture "
                       r"Step1ForCausalLM\)"):
        prepare_pcp_config(_config(architectures=["Step1ForCausalLM"]))


@pytest.mark.parametrize("over,drop", [(dict(), "drop -pcp"),
                                       (dict(decode_context_parallel_size=2),
                                        "drop -pcp and -dcp")])
def test_kv_sharing_models_are_refused(over, drop):
    with pytest.raises(PCPConfigError) as err:
        prepare_pcp_config(_config(hf=dict(num_kv_shared_layers=20), **over))
    assert ("cross-layer KV sharing (the model's num_kv_shared_layers = 20): not verified "
            f"with vllm-pcp; {drop}") in str(err.value)
    assert prepare_pcp_config(_config(hf=dict(num_kv_shared_layers=0), **over))


# -- per layer ----------------------------------------------------------------------------

@pytest.fixture
def make_impl(monkeypatch):
    """``make(dcp, pcp, **impl_kwargs)``: a real PCPFlashInferImpl (8 query heads, 2 KV
    heads, head size 64) of rank 0, built on the CPU, its group sizes given."""
    from layer_harness import make_impl as impl_of_rank_0
    from vllm_pcp.backend import PCPFlashInferImpl

    def make(dcp, pcp=1, kv_cache_dtype="auto", scale=0.125, **kwargs):
        impl_of_rank_0(monkeypatch, pcp, 0, 8, 2, 64, dcp)  # the group sizes, given
        return PCPFlashInferImpl(8, 64, scale, 2, **{
            "alibi_slopes": None, "sliding_window": None, **kwargs,
            "kv_cache_dtype": kv_cache_dtype})

    return make


SLOPES = [2.0 ** -(i + 1) for i in range(8)]


@pytest.mark.parametrize("pcp,dcp,message", [
    (2, 1, "vllm-pcp cannot run -pcp 2 with an attention layer with ALiBi slopes: "
     "vllm-pcp's attention does not apply it; drop -pcp (vLLM's default attention "
     "backend runs the layer on one GPU or with -tp alone)"),
    (2, 2, "vllm-pcp cannot run -pcp 2 -dcp 2 with an attention layer with ALiBi slopes: "
     "vllm-pcp's attention does not apply it; drop -pcp and -dcp"),
    (4, 1, "vllm-pcp cannot run -pcp 4 with an attention layer with ALiBi slopes")])
def test_alibi_layers_are_refused_under_every_layout(make_impl, pcp, dcp, message):
    with pytest.raises(PCPConfigError) as err:
        make_impl(dcp=dcp, pcp=pcp, alibi_slopes=SLOPES)
    assert str(err.value).startswith(message)


def test_kv_sharing_layers_are_refused(make_impl):
    with pytest.raises(PCPConfigError, match=r"^vllm-pcp cannot run -pcp 2 with an "
                       r"attention layer with its KV cache shared with layers\.0\.attn: "):
        make_impl(dcp=1, pcp=2, kv_sharing_target_layer_name="layers.0.attn")
    with pytest.raises(PCPConfigError, match=r"with ALiBi slopes and a sliding window of 64 "
                       r"tokens \(\-\-disable\-sliding\-window turns it off\) and its KV "
                       r"cache shared with layers\.0\.attn: vllm-pcp's attention does not "
                       r"apply them; drop \-pcp and \-dcp"):
        make_impl(dcp=2, pcp=2, alibi_slopes=SLOPES, sliding_window=64,
                  kv_sharing_target_layer_name="layers.0.attn")


@pytest.mark.parametrize("dcp", [1, 2])
def test_stock_layers_keep_their_settings(make_impl, dcp):
    """At PCP = 1 (DCP inside TP included) the plugin's impl stands behind FLASHINFER for
    every model and must be vLLM's: ALiBi slopes, KV sharing, windows, soft caps, sinks
    and fp8 caches are kept as vLLM keeps them."""
    impl = make_impl(dcp=dcp, pcp=1, alibi_slopes=SLOPES, kv_cache_dtype="fp8",
                     kv_sharing_target_layer_name="layers.0.attn", sliding_window=128,
                     logits_soft_cap=30.0, sinks=torch.zeros(8))
    assert impl.alibi_slopes.tolist() == SLOPES and impl.dcp_world_size == dcp
    assert (impl.kv_cache_dtype, impl.kv_sharing_target_layer_name) == ("fp8",
                                                                        "layers.0.attn")
    assert (impl.window_left, impl.logits_soft_cap, impl.sinks.shape) == (127, 30.0, (8,))


@pytest.mark.parametrize("layer,settings", [
    (dict(logits_soft_cap=30.0), "logits_soft_cap 30.0"),
    (dict(sinks=True), "attention sinks"),
    (dict(logits_soft_cap=30.0, sinks=True), "logits_soft_cap 30.0 and attention sinks"),
])
def test_dcp_layer_refuses_what_its_attention_does_not_plan(make_impl, layer, settings):
    """Settings vLLM's FlashInfer plan carries at DCP = 1 and the DCP attention does not
    (sliding windows are refused under every layout: tests/test_sliding_window.py)."""
    if layer.pop("sinks", False):
        layer["sinks"] = torch.zeros(8)
    with pytest.raises(PCPConfigError) as err:
        make_impl(dcp=2, pcp=2, **layer)
    assert str(err.value) == (
        f"vllm-pcp cannot run --decode-context-parallel-size 2 (-pcp 2 -dcp 2) with an "
        f"attention layer with {settings}: vllm-pcp's DCP attention plans FlashInfer "
        "without window_left, logits_soft_cap, sinks or a quantized KV cache; drop "
        "--decode-context-parallel-size (run -pcp 2 alone)")


def test_pcp_layers_keep_the_settings_vllms_plan_carries(make_impl):
    """-pcp alone: soft caps and sinks reach vLLM's FlashInfer plan of the local rows."""
    impl = make_impl(dcp=1, pcp=2, logits_soft_cap=30.0, sinks=torch.zeros(8))
    assert (impl.logits_soft_cap, impl.sinks.shape) == (30.0, (8,))
    impl = make_impl(dcp=2, pcp=2)  # a plain layer under DCP
    assert (impl.dcp_world_size, impl.sliding_window, impl.logits_soft_cap,
            impl.sinks) == (2, (-1, -1), None, None)


def test_pcp_layers_take_fp8_and_refuse_an_unverified_kv_cache_dtype(make_impl):
    """-pcp alone: a checkpoint's scheme can give a layer a cache dtype past the start-up
    check; fp8 runs (shown exact on one H200, tests/gpu/results/exactness-features.json,
    pcp2-fp8 and pcp4-fp8), a dtype no GPU run has shown exact is refused."""
    with pytest.raises(PCPConfigError, match=r"with a fp8_e5m2 KV cache: \-\-kv\-cache\-dtype "
                       r"fp8_e5m2: not verified with \-pcp 2 on a GPU \(fp8 is\)"):
        make_impl(dcp=1, pcp=2, kv_cache_dtype="fp8_e5m2")
    assert make_impl(dcp=1, pcp=2, kv_cache_dtype="fp8").kv_cache_dtype == "fp8"
    assert make_impl(dcp=1, pcp=2, kv_cache_dtype="auto").kv_cache_dtype == "auto"


def test_dcp_layers_refuse_a_quantized_kv_cache(make_impl):
    """A checkpoint's KV cache scheme can make a layer fp8 past the start-up check
    (vLLM's Attention turns ``auto`` into ``fp8``)."""
    with pytest.raises(PCPConfigError, match=r"\(\-pcp 2 \-dcp 2\) with an attention layer "
                       "with a fp8 KV cache: vllm-pcp's DCP attention plans FlashInfer "
                       "without window_left, logits_soft_cap, sinks or a quantized KV "
                       r"cache; drop \-\-decode\-context\-parallel\-size \(run \-pcp 2 "
                       r"alone\)"):
        make_impl(dcp=2, pcp=2, kv_cache_dtype="fp8")


def test_non_decoder_layers_are_refused_by_vllm(make_impl):
    """vLLM's FlashInferImpl refuses encoder, encoder-only and cross attention; the
    plugin's subclass runs that check first (the models with such layers, pooling and
    encoder-decoder ones, are refused at start-up by vllm_pcp.config)."""
    from vllm.v1.attention.backend import AttentionType

    for attn_type in (AttentionType.ENCODER, AttentionType.ENCODER_ONLY,
                      AttentionType.ENCODER_DECODER):
        with pytest.raises(NotImplementedError, match="not implemented for FlashInferImpl"):
            make_impl(dcp=2, pcp=2, attn_type=attn_type)


# -- per KV cache group: the builder --------------------------------------------------------

@pytest.fixture
def make_builder(tmp_path, monkeypatch, make_impl):
    """``make(layers, dcp=1)``: the plugin's FlashInfer builder of a real ``-pcp 2``
    (``-dcp``) config over one KV cache group of layers, the i-th built with the impl
    keywords ``layers[i]``; on the CPU, off SM90."""
    import vllm.v1.attention.backends.flashinfer as flashinfer
    from vllm.config import AttentionConfig, set_current_vllm_config
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    from helpers import attention_layer, flashinfer_on_cpu, real_vllm_config
    from vllm_pcp.backend import PCPFlashInferMetadataBuilder

    flashinfer_on_cpu(monkeypatch)

    def make(layers, dcp=1):
        monkeypatch.setattr(flashinfer, "get_dcp_group", lambda: SimpleNamespace(
            world_size=dcp, rank_in_group=0))
        config = real_vllm_config(tmp_path, monkeypatch, dict(
            prefill_context_parallel_size=2, decode_context_parallel_size=dcp),
            hf=dict(hidden_size=512), attention_config=AttentionConfig(backend="FLASHINFER"))
        config.cache_config.kv_cache_layout = "LBNHC"  # as vLLM's engine core resolves it
        spec = FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=64,
                                 dtype=torch.bfloat16)
        names = [f"layers.{i}.attn" for i in range(len(layers))]
        for name, kwargs in zip(names, layers):
            impl = make_impl(dcp=dcp, pcp=2, **kwargs)
            config.compilation_config.static_forward_context[name] = attention_layer(impl)
        with set_current_vllm_config(config):
            return PCPFlashInferMetadataBuilder(spec, names, config, torch.device("cpu"))

    return make


def test_dcp_refuses_layers_of_different_scales_in_one_group(make_builder):
    """The DCP attention plans the group's one ``sm_scale`` (vLLM's first layer's); vLLM's
    own plan asserts the layers agree, the DCP path never reaches that assert."""
    with pytest.raises(PCPConfigError) as err:
        make_builder([dict(scale=0.125), dict(scale=0.25)], dcp=2)
    assert str(err.value) == (
        "vllm-pcp cannot run -pcp 2 -dcp 2 with attention layers of softmax scales 0.125, "
        "0.25 in one KV cache group: vllm-pcp's DCP attention plans one scale for all of "
        "them; drop -dcp (run -pcp 2 alone)")
    builder = make_builder([dict(scale=0.25), dict(scale=0.25)], dcp=2)
    assert builder.global_hyperparameters.sm_scale == 0.25  # what build_dcp plans with
    make_builder([dict(scale=0.125), dict(scale=0.25)])  # -pcp alone: vLLM's to check


def test_split_rows_plan_the_layers_soft_cap_and_scale(make_builder, monkeypatch):
    """At DCP = 1 a split step's local rows are planned by vLLM's builder, which carries
    the layers' ``logits_soft_cap`` and softmax scale into FlashInfer's plan."""
    builder = make_builder([dict(scale=0.3, logits_soft_cap=30.0)] * 2)
    _, _, planned = plan_split_rows(builder, monkeypatch, rank=0)
    assert (planned["logits_soft_cap"], planned["sm_scale"], planned["window_left"],
            planned["causal"]) == (30.0, 0.3, -1, True)
