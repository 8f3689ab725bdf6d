"""Start-up refusals and knobs of vllm_pcp.config."""
from types import SimpleNamespace

import pytest

from vllm_pcp.config import WORKER_CLS, PCPConfigError, prepare_pcp_config
from vllm_pcp.knobs import PCPKnobs


def _config(pcp=2, **over):
    parallel = dict(prefill_context_parallel_size=pcp, data_parallel_size=1,
                    pipeline_parallel_size=1, decode_context_parallel_size=1,
                    worker_cls="vllm.v1.worker.gpu_worker.Worker", dcp_comm_backend="ag_rs",
                    enable_expert_parallel=False)
    model = dict(use_mla=False, is_multimodal_model=False, enable_prompt_embeds=False,
                 model="m", runner_type="generate", is_hybrid=False, is_attention_free=False,
                 attention_chunk_size=None, architectures=["Qwen2ForCausalLM"],
                 is_moe=False)
    for key in list(over):
        if key in parallel:
            parallel[key] = over.pop(key)
        elif key in model:
            model[key] = over.pop(key)
    model["hf_text_config"] = SimpleNamespace(**over.pop("hf", {}))
    return SimpleNamespace(
        parallel_config=SimpleNamespace(**parallel), model_config=SimpleNamespace(**model),
        speculative_config=over.pop("speculative_config", None),
        lora_config=over.pop("lora_config", None),
        kv_transfer_config=over.pop("kv_transfer_config", None),
        attention_config=SimpleNamespace(backend=over.pop("backend", None)),
        cache_config=SimpleNamespace(
            cache_dtype=over.pop("cache_dtype", "auto"),
            kv_sharing_fast_prefill=over.pop("kv_sharing_fast_prefill", False),
            calculate_kv_scales=over.pop("calculate_kv_scales", False)),
        compilation_config=SimpleNamespace(
            cudagraph_mode=over.pop("cudagraph_mode", None),
            pass_config=SimpleNamespace(enable_sp=over.pop("enable_sp", False))),
        additional_config=over.pop("additional_config", {}))


def test_pcp_config_selects_the_plugin_worker():
    cfg = _config()
    assert prepare_pcp_config(cfg)
    assert cfg.parallel_config.worker_cls == WORKER_CLS
    assert prepare_pcp_config(cfg)  # idempotent: vLLM may finalise twice


@pytest.mark.parametrize("cfg", [_config(pcp=1), _config(use_mla=True)])
def test_pcp1_and_mla_are_left_to_vllm(cfg):
    assert not prepare_pcp_config(cfg)
    assert cfg.parallel_config.worker_cls == "vllm.v1.worker.gpu_worker.Worker"


@pytest.mark.parametrize("over,flag", [
    (dict(data_parallel_size=2), "--data-parallel-size"),
    (dict(pipeline_parallel_size=2), "--pipeline-parallel-size"),
    (dict(decode_context_parallel_size=4), "it must be 1 or 2"),
    (dict(decode_context_parallel_size=2, dcp_comm_backend="a2a"), "--dcp-comm-backend a2a"),
    (dict(additional_config={"pcp_unverified_dcp": True}), "pcp_unverified_dcp: not"),
    (dict(additional_config={"pcp_dcp_fp32_partials": True}), "not a vllm-pcp knob"),
    (dict(additional_config={"pcp_min_split_token": 8}), "pcp_min_split_token: not"),
    (dict(speculative_config=object()), "--speculative-config"),
    (dict(lora_config=object()), "--enable-lora"),
    (dict(is_multimodal_model=True), "multimodal"),
    (dict(enable_prompt_embeds=True), "--enable-prompt-embeds"),
    (dict(backend=SimpleNamespace(name="FLASH_ATTN")), "--attention-backend FLASH_ATTN"),
    (dict(worker_cls="my.Worker"), "--worker-cls"),
    (dict(additional_config={"pcp_min_split_tokens": -1}), "pcp_min_split_tokens"),
    (dict(pcp=4, is_moe=True), "mixture-of-experts model at -pcp 4: vLLM sums"),
    (dict(pcp=3, is_moe=True, decode_context_parallel_size=1), "-pcp 3"),
])
def test_refusals_name_the_flag(over, flag):
    cfg = _config(**over)
    with pytest.raises(PCPConfigError, match=flag.replace("-", r"\-")):
        prepare_pcp_config(cfg)
    assert cfg.parallel_config.worker_cls != WORKER_CLS


@pytest.mark.parametrize("cfg", [_config(pcp=2, is_moe=True), _config(pcp=4)])
def test_moe_models_run_at_pcp_2_and_dense_ones_at_any_pcp(cfg):
    """Two ranks' parts of an expert layer add the same on both; more do not (the refusal)."""
    assert prepare_pcp_config(cfg)


def test_every_refusal_is_listed_at_once():
    cfg = _config(pipeline_parallel_size=2, lora_config=object())
    with pytest.raises(PCPConfigError) as err:
        prepare_pcp_config(cfg)
    assert "--pipeline-parallel-size" in str(err.value) and "--enable-lora" in str(err.value)


def test_flashinfer_may_be_requested_explicitly():
    assert prepare_pcp_config(_config(backend=SimpleNamespace(name="FLASHINFER")))


def test_knobs():
    assert PCPKnobs.from_additional_config({}).min_split_tokens is None  # the default
    assert PCPKnobs.from_additional_config({"other_plugin_key": 1}).min_split_tokens is None
    assert PCPKnobs.from_additional_config({"pcp_min_split_tokens": 4096}).min_split_tokens == 4096
    for bad in ("8", 1.5, True, -3):
        with pytest.raises(PCPConfigError):
            PCPKnobs.from_additional_config({"pcp_min_split_tokens": bad})


def test_context_exchange_knob():
    assert PCPKnobs.from_additional_config({}).dcp_context_exchange == "auto"
    for value in ("auto", "queries", "keys"):
        knobs = PCPKnobs.from_additional_config({"pcp_dcp_context_exchange": value})
        assert knobs.dcp_context_exchange == value
    for bad in ("kv", None, 1):
        with pytest.raises(PCPConfigError, match="pcp_dcp_context_exchange"):
            PCPKnobs.from_additional_config({"pcp_dcp_context_exchange": bad})


def test_the_default_split_threshold():
    from vllm_pcp.knobs import DEFAULT_MIN_SPLIT_TOKENS, min_split_tokens

    assert min_split_tokens(PCPKnobs(), 2) == DEFAULT_MIN_SPLIT_TOKENS == 8192
    # a knob is taken as given, but never below 2N (every rank gets tokens)
    assert min_split_tokens(PCPKnobs(min_split_tokens=16384), 2) == 16384
    assert min_split_tokens(PCPKnobs(min_split_tokens=0), 4) == 8


@pytest.mark.parametrize("asked,taken", [
    ("FULL_AND_PIECEWISE", "FULL_DECODE_ONLY"), ("PIECEWISE", "FULL_DECODE_ONLY"),
    ("FULL", "FULL_DECODE_ONLY"), ("FULL_DECODE_ONLY", "FULL_DECODE_ONLY"),
    ("NONE", "NONE")])
def test_dcp_equal_to_pcp_keeps_full_graphs_of_decode_steps_only(asked, taken):
    from vllm.config import CUDAGraphMode

    cfg = _config(decode_context_parallel_size=2, cudagraph_mode=CUDAGraphMode[asked])
    assert prepare_pcp_config(cfg)
    assert cfg.compilation_config.cudagraph_mode == CUDAGraphMode[taken]


def test_pcp_without_dcp_keeps_the_cuda_graph_mode():
    from vllm.config import CUDAGraphMode

    cfg = _config(cudagraph_mode=CUDAGraphMode.FULL_AND_PIECEWISE)
    assert prepare_pcp_config(cfg)
    assert cfg.compilation_config.cudagraph_mode == CUDAGraphMode.FULL_AND_PIECEWISE


def test_dcp_refuses_quantized_kv_cache_and_names_the_ways_out():
    """-pcp 2 -dcp 2 with fp8: an unquantized cache, or -pcp 2 alone, which takes fp8; with
    e5m2, which -pcp alone refuses too, only the cache; DCP inside TP: vLLM's -tp alone."""
    cases = [(_config(decode_context_parallel_size=2, cache_dtype="fp8"),
              "--kv-cache-dtype fp8: vllm-pcp's DCP runs unquantized KV caches; pass "
              "--kv-cache-dtype auto, or drop -dcp (-pcp 2 alone runs it)"),
             (_config(decode_context_parallel_size=2, cache_dtype="fp8_e5m2"),
              "unquantized KV caches; pass --kv-cache-dtype auto\n"),
             (_config(pcp=1, decode_context_parallel_size=2, cache_dtype="fp8", backend=FI),
              "unquantized KV caches; pass --kv-cache-dtype auto, or drop -dcp (vLLM runs "
              "it with -tp alone)")]
    for cfg, message in cases:
        with pytest.raises(PCPConfigError) as err:
            prepare_pcp_config(cfg)
        assert message in str(err.value) + "\n", str(err.value)


FI = SimpleNamespace(name="FLASHINFER")


@pytest.mark.parametrize("over,taken", [
    (dict(pcp=1, decode_context_parallel_size=2, backend=FI), True),
    (dict(pcp=1, decode_context_parallel_size=2), False),  # auto: the builder decides
    (dict(pcp=1, decode_context_parallel_size=2, backend=SimpleNamespace(name="FLASH_ATTN")),
     False),
    (dict(pcp=1, decode_context_parallel_size=2, backend=FI, use_mla=True), False),
    (dict(pcp=1, backend=FI), False)])
def test_dcp_inside_tp_on_named_flashinfer_is_the_plugins(over, taken):
    """vLLM 0.26.0's own FlashInfer DCP gives wrong tokens: with FLASHINFER named,
    -tp N -dcp N runs on the plugin's worker and DCP attention instead."""
    from vllm.config import CUDAGraphMode

    cfg = _config(cudagraph_mode=CUDAGraphMode.FULL_AND_PIECEWISE, **over)
    assert prepare_pcp_config(cfg) is taken
    if taken:
        assert cfg.parallel_config.worker_cls == WORKER_CLS
        assert cfg.compilation_config.cudagraph_mode == CUDAGraphMode.FULL_DECODE_ONLY
    else:
        assert cfg.parallel_config.worker_cls != WORKER_CLS


def test_dcp_inside_tp_refusals_name_the_dcp_layout():
    cfg = _config(pcp=1, decode_context_parallel_size=2, backend=FI, dcp_comm_backend="a2a",
                  cache_dtype="fp8", lora_config=object())
    with pytest.raises(PCPConfigError) as err:
        prepare_pcp_config(cfg)
    msg = str(err.value)
    assert "--decode-context-parallel-size 2 (DCP inside TP)" in msg
    assert "--dcp-comm-backend a2a" in msg and "--kv-cache-dtype fp8" in msg
    assert "drop it or drop -dcp" in msg


def test_the_builder_refuses_an_automatic_flashinfer_dcp_at_pcp1(monkeypatch):
    from vllm.v1.attention.backends.flashinfer import FlashInferMetadataBuilder

    from vllm_pcp.backend import PCPFlashInferMetadataBuilder

    cfg = _config(pcp=1, decode_context_parallel_size=2)
    with pytest.raises(PCPConfigError, match="--attention-backend FLASHINFER"):
        PCPFlashInferMetadataBuilder(None, [], cfg, "cpu")
    # with the plugin's worker in place (FLASHINFER named) the builder is made
    monkeypatch.setattr(FlashInferMetadataBuilder, "__init__",
                        lambda self, *a: setattr(self, "dcp_world_size", 1))
    cfg.parallel_config.worker_cls = WORKER_CLS
    PCPFlashInferMetadataBuilder(None, [], cfg, "cpu")


CONNECTOR = SimpleNamespace(kv_connector="NixlConnector")
DCP2 = dict(decode_context_parallel_size=2)


@pytest.mark.parametrize("over,message", [
    (dict(kv_transfer_config=CONNECTOR),
     "--kv-transfer-config (kv_connector NixlConnector): KV connectors key workers by "
     "(pp rank, tp rank) and every PCP rank is tp rank 0; drop it (and "
     "--kv-offloading-size, which sets it) or drop -pcp"),
    (dict(kv_transfer_config=CONNECTOR, **DCP2), "every PCP rank is tp rank 0"),
    (dict(pcp=1, backend=FI, kv_transfer_config=CONNECTOR, **DCP2),
     "--kv-transfer-config (kv_connector NixlConnector): KV connectors are not verified "
     "with vllm-pcp's DCP cache layout; drop it (and --kv-offloading-size, which sets "
     "it) or drop -dcp"),
    (dict(runner_type="pooling"),
     "pooling model 'm' (--runner pooling): not yet verified with vllm-pcp; drop -pcp"),
    (dict(pcp=1, backend=FI, runner_type="pooling", **DCP2), "drop -dcp"),
    (dict(is_hybrid=True), "model 'm' has layers other than attention"),
    (dict(is_attention_free=True), "vllm-pcp runs attention-only models; drop -pcp"),
    (dict(attention_chunk_size=8192),
     "chunked local attention (the model's attention_chunk_size = 8192): its virtual "
     "batches bypass vllm-pcp's K/V exchange; drop -pcp"),
    (dict(kv_sharing_fast_prefill=True), "--kv-sharing-fast-prefill: not handled by "
     "vllm-pcp; drop it or drop -pcp"),
    (dict(enable_sp=True), "--compilation-config pass_config.enable_sp (sequence "
     "parallelism; fuse_gemm_comms turns it on)"),
    (dict(calculate_kv_scales=True), "--calculate-kv-scales: each PCP rank would take the "
     "KV scales from its own chunks' keys; drop it or drop -pcp"),
    (dict(enable_expert_parallel=True), "--enable-expert-parallel: vLLM's expert-parallel "
     "dispatch over the PCP ranks is not verified with vllm-pcp; drop it"),
])
def test_unhandled_features_are_refused(over, message):
    cfg = _config(**over)
    with pytest.raises(PCPConfigError) as err:
        prepare_pcp_config(cfg)
    assert message in str(err.value)
    assert cfg.parallel_config.worker_cls != WORKER_CLS


def test_dcp_inside_tp_keeps_what_needs_every_token_on_every_rank():
    """At PCP = 1 no prefill is split: every rank runs every token, as sequence
    parallelism and --calculate-kv-scales expect."""
    assert prepare_pcp_config(_config(pcp=1, backend=FI, enable_sp=True, **DCP2))
    assert prepare_pcp_config(_config(pcp=1, backend=FI, calculate_kv_scales=True, **DCP2))
    assert prepare_pcp_config(_config(pcp=1, backend=FI, enable_expert_parallel=True, **DCP2))


UNPLANNED = [  # model settings vllm-pcp's DCP attention does not plan, and the refusal
    (dict(hf=dict(sliding_window=4096)),
     "sliding-window attention (the model's sliding_window = 4096): vllm-pcp's DCP "
     "attention has no window; drop -dcp"),
    (dict(hf=dict(attn_logit_softcapping=50.0)),
     "logit soft-capping (the model's attn_logit_softcapping = 50.0): vllm-pcp's DCP "
     "attention does not cap logits; drop -dcp"),
    (dict(architectures=["GptOssForCausalLM"]),
     "attention sinks (architecture GptOssForCausalLM): vllm-pcp's DCP attention has no "
     "sinks; drop -dcp"),
    (dict(hf=dict(add_swa_attention_sink_bias=True)),
     "attention sinks (the model's add_swa_attention_sink_bias = True): vllm-pcp's DCP "
     "attention has no sinks; drop -dcp"),
    (dict(hf=dict(swa_attention_sink_enabled=True)),
     "attention sinks (the model's swa_attention_sink_enabled = True): vllm-pcp's DCP "
     "attention has no sinks; drop -dcp"),
]


@pytest.mark.parametrize("model,message", UNPLANNED)
def test_dcp_refuses_attention_it_does_not_plan(model, message):
    with pytest.raises(PCPConfigError) as err:
        prepare_pcp_config(_config(**model, **DCP2))
    assert message + " (run -pcp 2 alone)" in str(err.value)
    with pytest.raises(PCPConfigError) as err:  # DCP inside TP: the same attention
        prepare_pcp_config(_config(pcp=1, backend=FI, **model, **DCP2))
    assert message in str(err.value) and "(DCP inside TP)" in str(err.value)


@pytest.mark.parametrize("model,message", UNPLANNED)
def test_pcp_alone_keeps_stock_attention_settings(model, message):
    """At DCP = 1 every layer runs vLLM's FlashInfer plan, which carries window_left,
    logits_soft_cap and sinks (tests/test_sliding_window.py)."""
    assert prepare_pcp_config(_config(**model))


def test_sliding_window_refusal_offers_disable_sliding_window():
    with pytest.raises(PCPConfigError, match=r"or pass \-\-disable\-sliding\-window "
                       r"\(caps \-\-max\-model\-len at the window\)"):
        prepare_pcp_config(_config(hf=dict(sliding_window=4096), **DCP2))
    assert prepare_pcp_config(_config(hf=dict(sliding_window=None), **DCP2))
    assert prepare_pcp_config(_config(hf=dict(sliding_window=0), **DCP2))  # Qwen2-MoE: none


@pytest.fixture
def real_config(tmp_path, monkeypatch):
    """vLLM's own VllmConfig of a small Qwen2 model (Triton shown as present)."""
    from helpers import real_vllm_config

    def make(pcp=2, dcp=1, runner="auto", hf=None, **vllm_kwargs):
        return real_vllm_config(tmp_path, monkeypatch,
                                dict(prefill_context_parallel_size=pcp,
                                     decode_context_parallel_size=dcp),
                                hf, runner, **vllm_kwargs)

    return make


WINDOW = dict(use_sliding_window=True, sliding_window=64, max_window_layers=2)


def _refusal(build) -> str:
    """The plugin's refusal of the config ``build`` makes: from prepare_pcp_config, or,
    on a CUDA machine, from vLLM building it (the platform hook runs the same check)."""
    try:
        cfg = build()
    except ValueError as err:  # pydantic's ValidationError around the PCPConfigError
        return str(err)
    with pytest.raises(PCPConfigError) as err:
        prepare_pcp_config(cfg)
    return str(err.value)


def test_real_config_refusals(real_config):
    from vllm.config import KVTransferConfig

    cases = [
        (lambda: real_config(dcp=2, hf=WINDOW), "(the model's sliding_window = 64)"),
        (lambda: real_config(runner="pooling"), "(--runner pooling)"),
        (lambda: real_config(kv_transfer_config=KVTransferConfig(kv_connector="NixlConnector",
                                                                 kv_role="kv_both")),
         "--kv-transfer-config (kv_connector NixlConnector)"),
    ]
    for build, message in cases:
        assert message in _refusal(build)
    window = real_config(hf=WINDOW)  # -pcp 2 alone: stock window
    assert window.model_config.get_sliding_window() == 64  # what the check reads
    assert prepare_pcp_config(window)


@pytest.fixture
def make_impl(monkeypatch):
    """A real PCPFlashInferImpl built on CPU, its DCP and PCP group sizes (which
    AttentionImplBase.__new__ reads from vLLM's parallel state) given."""
    import torch
    import vllm.distributed.parallel_state as parallel_state
    import vllm.v1.attention.backends.flashinfer as flashinfer
    from vllm.config import DeviceConfig, VllmConfig, set_current_vllm_config

    from vllm_pcp.backend import PCPFlashInferImpl

    monkeypatch.setattr(flashinfer, "can_use_trtllm_attention", lambda *a, **k: False)
    config = VllmConfig(device_config=DeviceConfig(device="cuda"))

    def make(dcp, pcp=1, sliding_window=None, logits_soft_cap=None, sinks=False):
        for name, size in (("get_dcp_group", dcp), ("get_pcp_group", pcp)):
            monkeypatch.setattr(parallel_state, name, lambda size=size: SimpleNamespace(
                world_size=size, rank_in_group=0))
        with set_current_vllm_config(config):
            return PCPFlashInferImpl(8, 64, 0.125, 2, None, sliding_window, "auto",
                                     logits_soft_cap=logits_soft_cap,
                                     sinks=torch.zeros(8) if sinks else None)

    return make


@pytest.mark.parametrize("layer,settings", [
    (dict(sliding_window=128), "a sliding window of 128 tokens"),
    (dict(logits_soft_cap=30.0), "logits_soft_cap 30.0"),
    (dict(sinks=True), "attention sinks"),
    (dict(sliding_window=128, logits_soft_cap=30.0, sinks=True),
     "a sliding window of 128 tokens and logits_soft_cap 30.0 and attention sinks"),
])
def test_dcp_layer_refuses_what_its_attention_does_not_plan(make_impl, layer, settings):
    with pytest.raises(PCPConfigError) as err:
        make_impl(dcp=2, pcp=2, **layer)
    assert str(err.value) == (
        f"vllm-pcp cannot run --decode-context-parallel-size 2 (-pcp 2 -dcp 2) with an "
        f"attention layer with {settings}: vllm-pcp's DCP attention plans FlashInfer "
        "without window_left, logits_soft_cap, sinks or a quantized KV cache; drop "
        "--decode-context-parallel-size (run -pcp 2 alone)")
    with pytest.raises(PCPConfigError, match=r"\(\-dcp 2\) with an attention layer with "
                       r".*\(run without it\)"):
        make_impl(dcp=2, pcp=1, **layer)  # DCP inside TP


def test_layers_without_dcp_keep_their_settings(make_impl):
    impl = make_impl(dcp=1, pcp=2, sliding_window=128, logits_soft_cap=30.0, sinks=True)
    assert (impl.window_left, impl.logits_soft_cap, impl.sinks.shape) == (127, 30.0, (8,))
    impl = make_impl(dcp=2, pcp=2)  # a plain layer under DCP
    assert (impl.dcp_world_size, impl.sliding_window, impl.logits_soft_cap,
            impl.sinks) == (2, (-1, -1), None, None)


def test_sliding_window_on_sm90_is_refused_at_start_up_at_pcp_alone(monkeypatch):
    """vLLM 0.26.0's FlashInfer metadata builder raises on any sliding-window layer on
    SM90, after the weights are loaded, and its message points at the default backend,
    which PCP does not run: the plugin refuses it where the config is made."""
    from vllm.platforms import current_platform

    model = dict(hf=dict(sliding_window=4096))
    assert prepare_pcp_config(_config(**model))  # not SM90: vLLM's plan carries the window
    monkeypatch.setattr(current_platform, "is_device_capability",
                        lambda capability: capability == 90, raising=False)
    with pytest.raises(PCPConfigError) as err:
        prepare_pcp_config(_config(**model))
    assert ("sliding-window attention (the model's sliding_window = 4096) on SM90"
            in str(err.value))
    assert "drop -pcp" in str(err.value) and "--disable-sliding-window" in str(err.value)
    assert prepare_pcp_config(_config(hf=dict(sliding_window=None)))
    with pytest.raises(PCPConfigError) as err:  # -dcp: the DCP refusal names it once
        prepare_pcp_config(_config(**model, **DCP2))
    assert str(err.value).count("sliding-window attention") == 1


def test_pcp_alone_takes_fp8_and_refuses_kv_cache_dtypes_no_gpu_run_verified():
    """Measured on one H200 (exactness-features.json): -pcp 2 and -pcp 4 with an fp8 cache
    pass the feature cases against one GPU with fp8 (the burst token for token); e5m2 and
    the other quantized caches have not run, and -dcp keeps its own refusal."""
    assert prepare_pcp_config(_config(cache_dtype="fp8"))
    assert prepare_pcp_config(_config(cache_dtype="auto"))
    for cache_dtype in ("fp8_e5m2", "fp8_e4m3", "nvfp4"):
        with pytest.raises(PCPConfigError) as err:
            prepare_pcp_config(_config(cache_dtype=cache_dtype))
        assert (f"--kv-cache-dtype {cache_dtype}: not verified with -pcp 2 on a GPU (fp8 is)"
                in str(err.value)
                and "pass --kv-cache-dtype fp8 (e4m3) or auto, or drop -pcp" in str(err.value))
    with pytest.raises(PCPConfigError) as err:  # with -dcp the DCP refusal names it once
        prepare_pcp_config(_config(cache_dtype="fp8", **DCP2))
    assert str(err.value).count("--kv-cache-dtype fp8") == 1
