"""Start-up refusals and knobs of vllm_pcp.config."""
from types import SimpleNamespace

import pytest

from vllm_pcp.config import WORKER_CLS, PCPConfigError, PCPKnobs, prepare_pcp_config


def _config(pcp=2, **over):
    parallel = dict(prefill_context_parallel_size=pcp, data_parallel_size=1,
                    pipeline_parallel_size=1, decode_context_parallel_size=1,
                    worker_cls="vllm.v1.worker.gpu_worker.Worker", dcp_comm_backend="ag_rs")
    model = dict(use_mla=False, is_multimodal_model=False, enable_prompt_embeds=False,
                 model="m")
    for key in list(over):
        if key in parallel:
            parallel[key] = over.pop(key)
        elif key in model:
            model[key] = over.pop(key)
    return SimpleNamespace(
        parallel_config=SimpleNamespace(**parallel), model_config=SimpleNamespace(**model),
        speculative_config=over.pop("speculative_config", None),
        lora_config=over.pop("lora_config", None),
        attention_config=SimpleNamespace(backend=over.pop("backend", None)),
        cache_config=SimpleNamespace(cache_dtype=over.pop("cache_dtype", "auto")),
        compilation_config=SimpleNamespace(cudagraph_mode=over.pop("cudagraph_mode", None)),
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
])
def test_refusals_name_the_flag(over, flag):
    cfg = _config(**over)
    with pytest.raises(PCPConfigError, match=flag.replace("-", r"\-")):
        prepare_pcp_config(cfg)
    assert cfg.parallel_config.worker_cls != WORKER_CLS


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
    from vllm_pcp.config import DEFAULT_MIN_SPLIT_TOKENS, min_split_tokens

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


def test_dcp_refuses_quantized_kv_cache():
    cfg = _config(decode_context_parallel_size=2, cache_dtype="fp8")
    with pytest.raises(PCPConfigError, match="--kv-cache-dtype fp8"):
        prepare_pcp_config(cfg)


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
    monkeypatch.setattr(FlashInferMetadataBuilder, "__init__", lambda *a: None)
    cfg.parallel_config.worker_cls = WORKER_CLS
    PCPFlashInferMetadataBuilder(None, [], cfg, "cpu")
