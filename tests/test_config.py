"""Start-up refusals and knobs of vllm_pcp.config and vllm_pcp.knobs: what ``-pcp`` configs
the plugin takes over, what it refuses (naming the flag and the way out), which worker and
CUDA graphs it selects, and what the ``pcp_*`` knobs resolve to."""
from types import SimpleNamespace

import pytest

from vllm_pcp.config import (VLLM_VERSION, WORKER_CLS, PCPConfigError, check_pcp_config,
                             prepare_pcp_config, takes_over, version_refusal)
from vllm_pcp.knobs import DEFAULT_MIN_SPLIT_TOKENS, PCPKnobs, PCPSettings

STOCK = "vllm.v1.worker.gpu_worker.Worker"


def _config(pcp=2, **over):
    """A stand-in of vLLM's VllmConfig with the fields the checks read; ``over`` sets
    parallel and model fields by name, ``hf`` the model's hf config."""
    parallel = dict(prefill_context_parallel_size=pcp, data_parallel_size=1,
                    pipeline_parallel_size=1, decode_context_parallel_size=1,
                    worker_cls=STOCK, dcp_comm_backend="ag_rs",
                    enable_expert_parallel=False, enable_hc_sp=False,
                    enable_batch_sharded_sampling=None)
    model = dict(use_mla=False, is_multimodal_model=False, enable_prompt_embeds=False,
                 model="m", runner_type="generate", is_hybrid=False, is_attention_free=False,
                 attention_chunk_size=None, architectures=["Qwen2ForCausalLM"],
                 is_moe=False, is_encoder_decoder=False)
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
        additional_config=over.pop("additional_config", {}), **_no_leftovers(over))


def _no_leftovers(over):
    assert not over, f"not a field of the stand-in: {sorted(over)}"
    return {}


DCP2 = dict(decode_context_parallel_size=2)
FI = SimpleNamespace(name="FLASHINFER")


def _refused(cfg) -> str:
    """The message of the refusal of ``cfg``; the worker is left as it was."""
    with pytest.raises(PCPConfigError) as err:
        prepare_pcp_config(cfg)
    assert cfg.parallel_config.worker_cls != WORKER_CLS
    return str(err.value)


def test_pcp_config_selects_the_plugin_worker():
    cfg = _config()
    assert takes_over(cfg) and prepare_pcp_config(cfg)
    assert cfg.parallel_config.worker_cls == WORKER_CLS
    assert prepare_pcp_config(cfg)  # idempotent: vLLM may finalise twice
    cfg = _config(worker_cls="auto")
    assert prepare_pcp_config(cfg) and cfg.parallel_config.worker_cls == WORKER_CLS


@pytest.mark.parametrize("cfg", [
    _config(pcp=1), _config(use_mla=True), _config(pcp=2, use_mla=True, **DCP2),
    _config(pcp=1, backend=FI, **DCP2),  # DCP inside TP: vLLM's own FlashInfer DCP
    _config(pcp=1, backend=FI, cache_dtype="fp8", lora_config=object(), **DCP2)])
def test_pcp1_and_mla_are_left_to_vllm(cfg):
    from vllm.config import CUDAGraphMode

    cfg.compilation_config.cudagraph_mode = CUDAGraphMode.FULL_AND_PIECEWISE
    assert not takes_over(cfg) and not prepare_pcp_config(cfg)
    check_pcp_config(cfg)  # nothing refused: not the plugin's
    assert cfg.parallel_config.worker_cls == STOCK
    assert cfg.compilation_config.cudagraph_mode == CUDAGraphMode.FULL_AND_PIECEWISE


def test_a_config_without_a_model_is_left_to_vllm():
    cfg = _config()
    cfg.model_config = None
    assert not takes_over(cfg) and not prepare_pcp_config(cfg)


@pytest.mark.parametrize("over,flag", [
    (dict(data_parallel_size=2), "--data-parallel-size"),
    (dict(pipeline_parallel_size=2), "--pipeline-parallel-size"),
    (dict(decode_context_parallel_size=4), "it must be 1 or 2"),
    (dict(decode_context_parallel_size=2, dcp_comm_backend="a2a"), "--dcp-comm-backend a2a"),
    (dict(additional_config={"pcp_unverified_dcp": True}), "pcp_unverified_dcp: not"),
    (dict(additional_config={"pcp_dcp_fp32_partials": True}), "not a vllm-pcp knob"),
    (dict(additional_config={"pcp_min_split_token": 8}), "pcp_min_split_token: not"),
    (dict(additional_config={"pcp_decode_policy": "owner"}),
     "pcp_decode_policy must be one of auto, replicate, shard, got 'owner'"),
    (dict(speculative_config=object()), "--speculative-config"),
    (dict(lora_config=object()), "--enable-lora"),
    (dict(is_multimodal_model=True), "multimodal"),
    (dict(is_encoder_decoder=True), "encoder-decoder model 'm'"),
    (dict(enable_prompt_embeds=True), "--enable-prompt-embeds"),
    (dict(backend=SimpleNamespace(name="FLASH_ATTN")), "--attention-backend FLASH_ATTN"),
    (dict(worker_cls="my.Worker"), "--worker-cls"),
    (dict(additional_config={"pcp_min_split_tokens": -1}), "pcp_min_split_tokens"),
])
def test_refusals_name_the_flag(over, flag):
    assert flag in _refused(_config(**over))


def test_every_refusal_is_listed_at_once():
    msg = _refused(_config(pipeline_parallel_size=2, lora_config=object()))
    assert msg.startswith("vllm-pcp cannot run --prefill-context-parallel-size 2 with:\n  - ")
    assert "--pipeline-parallel-size" in msg and "--enable-lora" in msg


def test_flashinfer_may_be_requested_explicitly():
    assert prepare_pcp_config(_config(backend=FI))


def test_the_manager_and_every_process_check_without_selecting_a_worker():
    """``check_pcp_config`` (what ``GQAPCPManager.validate_config`` runs in each worker)
    refuses the same configs, with multimodal inputs as vLLM's runner reports them, and
    leaves the worker as it is."""
    from vllm_pcp.manager import GQAPCPManager

    cfg = _config()
    check_pcp_config(cfg)
    GQAPCPManager.validate_config(cfg, supports_mm_inputs=False)
    assert cfg.parallel_config.worker_cls == STOCK
    with pytest.raises(PCPConfigError, match="multimodal model 'm'"):
        GQAPCPManager.validate_config(cfg, supports_mm_inputs=True)
    with pytest.raises(PCPConfigError, match="--enable-lora"):
        GQAPCPManager.validate_config(_config(lora_config=object()), False)


# -- mixture-of-experts models and the decode policy ----------------------------------------

MOE_REFUSAL = ("--additional-config pcp_decode_policy replicate on a mixture-of-experts "
               "model at -pcp {pcp}: vLLM sums each expert layer's parts with a "
               "reduce-scatter over the PCP ranks")


@pytest.mark.parametrize("pcp", [3, 4])
def test_moe_models_with_decodes_on_every_rank_are_refused_beyond_two_ranks(pcp):
    msg = _refused(_config(pcp=pcp, is_moe=True,
                           additional_config={"pcp_decode_policy": "replicate"}))
    assert MOE_REFUSAL.format(pcp=pcp) in msg
    assert "drop the knob (auto shards the decodes: one rank computes each), or use -pcp 2" \
        in msg


@pytest.mark.parametrize("cfg", [
    _config(pcp=2, is_moe=True, additional_config={"pcp_decode_policy": "replicate"}),
    _config(pcp=4, is_moe=True),  # auto: sharded decodes
    _config(pcp=4, is_moe=True, additional_config={"pcp_decode_policy": "shard"}),
    _config(pcp=4, additional_config={"pcp_decode_policy": "replicate"}),  # dense
    _config(pcp=4, is_moe=True, **{"decode_context_parallel_size": 4})])  # -dcp: shards KV
def test_moe_models_run_when_one_rank_computes_each_decode_or_at_two_ranks(cfg):
    """Two ranks' parts of an expert layer add the same on both; more do not, so a MoE
    model beyond two ranks needs its decodes sharded (one rank computes each)."""
    assert prepare_pcp_config(cfg)


def test_shard_is_refused_with_dcp():
    assert ("--additional-config pcp_decode_policy shard with -dcp 2: every rank attends "
            "its shard of each decode; drop the knob (auto) or drop -dcp") in _refused(
        _config(additional_config={"pcp_decode_policy": "shard"}, **DCP2))


# -- knobs and what they resolve to -----------------------------------------------------------

def test_knobs():
    assert PCPKnobs.from_additional_config({}) == PCPKnobs()  # every default
    assert PCPKnobs.from_additional_config(None) == PCPKnobs()
    assert PCPKnobs.from_additional_config({"other_plugin_key": 1}).min_split_tokens is None
    assert PCPKnobs.from_additional_config({"pcp_min_split_tokens": 4096}).min_split_tokens \
        == 4096
    for bad in ("8", 1.5, True, -3):
        with pytest.raises(PCPConfigError, match="pcp_min_split_tokens must be a non-negative"):
            PCPKnobs.from_additional_config({"pcp_min_split_tokens": bad})


@pytest.mark.parametrize("key,knob", [
    ("PCP_MIN_SPLIT_TOKENS", "pcp_min_split_tokens"),
    ("pcp-min-split-tokens", "pcp_min_split_tokens"),
    ("min_split_tokens", "pcp_min_split_tokens"),
    ("Split-Attention", "pcp_split_attention"),
    ("dcp_context_exchange", "pcp_dcp_context_exchange"),
    ("PCP-DECODE-POLICY", "pcp_decode_policy")])
def test_a_misspelled_knob_is_refused_by_the_knob_it_names(key, knob):
    """A key that is a knob in another case, with dashes or without the ``pcp_`` prefix is
    refused, naming the knob, instead of leaving the default silently."""
    with pytest.raises(PCPConfigError, match=f"{key}: did you mean {knob}"):
        PCPKnobs.from_additional_config({key: "x"})
    assert PCPKnobs.from_additional_config({"split": 1, "policy": 2}) == PCPKnobs()


@pytest.mark.parametrize("key,choices", [
    ("pcp_dcp_context_exchange", ("auto", "queries", "keys")),
    ("pcp_decode_policy", ("auto", "replicate", "shard")),
    ("pcp_split_attention", ("auto", "paged"))])
def test_choice_knobs(key, choices):
    field = key.removeprefix("pcp_")
    assert getattr(PCPKnobs.from_additional_config({}), field) == "auto"
    assert getattr(PCPKnobs.from_additional_config({key: None}), field) == "auto"  # null
    for value in choices:
        assert getattr(PCPKnobs.from_additional_config({key: value}), field) == value
    for bad in ("kv", 1, "AUTO"):
        with pytest.raises(PCPConfigError, match=f"{key} must be one of {', '.join(choices)}"):
            PCPKnobs.from_additional_config({key: bad})


def _settings(pcp=2, dcp=1, is_moe=False, **knobs):
    return PCPSettings.from_vllm_config(_config(
        pcp=pcp, decode_context_parallel_size=dcp, is_moe=is_moe,
        additional_config={f"pcp_{k}": v for k, v in knobs.items()}))


def test_the_split_thresholds():
    """The default threshold; a knob is taken as given, but never below 2N; the shortest
    split chunk is 4N at DCP = 1 (every row of it longer than the decode threshold) and
    2N with -dcp (a token for every row)."""
    assert _settings().min_split_tokens == DEFAULT_MIN_SPLIT_TOKENS == 8192
    assert _settings(min_split_tokens=16384).min_split_tokens == 16384
    assert _settings(pcp=4, min_split_tokens=0).min_split_tokens == 8
    assert _settings(pcp=3).min_chunk_tokens == 12 and _settings(pcp=3).decode_threshold == 1
    assert _settings(pcp=3, dcp=3).min_chunk_tokens == 6


@pytest.mark.parametrize("pcp,dcp,is_moe,knob,policy", [
    (2, 1, False, "auto", "replicate"), (4, 1, False, "auto", "replicate"),
    (2, 1, True, "auto", "replicate"), (3, 1, True, "auto", "shard"),
    (4, 1, False, "shard", "shard"), (4, 1, True, "replicate", "replicate"),
    (4, 4, True, "auto", "replicate"), (2, 2, False, "shard", "replicate")])
def test_the_decode_policy_resolves(pcp, dcp, is_moe, knob, policy):
    s = _settings(pcp, dcp, is_moe, decode_policy=knob)
    assert s.decode_policy == policy
    assert s.shard_decodes == (policy == "shard")
    assert s.unsplit_steps_local == (policy == "replicate")


def test_the_other_knobs_reach_the_settings():
    s = _settings(dcp=2, dcp_context_exchange="keys", split_attention="paged")
    assert (s.dcp_context_exchange, s.split_attention) == ("keys", "paged")
    assert (s.pcp_world_size, s.dcp_world_size) == (2, 2)


# -- CUDA graphs -------------------------------------------------------------------------------

@pytest.mark.parametrize("over,asked,taken", [
    ({}, "FULL_AND_PIECEWISE", "FULL_AND_PIECEWISE"),
    ({}, "FULL_DECODE_ONLY", "FULL_DECODE_ONLY"),
    ({}, "FULL", "FULL_AND_PIECEWISE"),  # full graphs of decode steps only
    ({}, "PIECEWISE", "PIECEWISE"), ({}, "NONE", "NONE"),
    (DCP2, "FULL_AND_PIECEWISE", "PIECEWISE"), (DCP2, "FULL_DECODE_ONLY", "NONE"),
    (DCP2, "FULL", "NONE"), (DCP2, "PIECEWISE", "PIECEWISE"),
    (dict(additional_config={"pcp_decode_policy": "shard"}), "FULL_AND_PIECEWISE",
     "PIECEWISE"),
    (dict(pcp=4, is_moe=True), "FULL_DECODE_ONLY", "NONE")])  # auto: shard
def test_full_cuda_graphs_are_kept_only_for_decodes_every_rank_writes_locally(
        over, asked, taken):
    """Full graphs replay decode steps whose rows every rank computes and writes itself
    (``replicate`` at DCP = 1); under -dcp or sharded decodes vllm-pcp plans every step's
    attention, which runs outside the graphs (piecewise, or none)."""
    from vllm.config import CUDAGraphMode

    cfg = _config(cudagraph_mode=CUDAGraphMode[asked], **over)
    assert prepare_pcp_config(cfg)
    assert cfg.compilation_config.cudagraph_mode == CUDAGraphMode[taken]


@pytest.mark.parametrize("over,mode,message", [
    ({}, "FULL", "-cc.cudagraph_mode FULL: full CUDA graphs of steps with prefills"),
    (DCP2, "FULL_AND_PIECEWISE", "-cc.cudagraph_mode FULL_AND_PIECEWISE: vllm-pcp plans "
     "the attention of every step under -dcp or pcp_decode_policy shard; use PIECEWISE or "
     "NONE")])
def test_a_full_graph_mode_set_after_start_up_is_refused_in_every_worker(over, mode,
                                                                         message):
    from vllm.config import CUDAGraphMode

    cfg = _config(cudagraph_mode=CUDAGraphMode[mode], **over)
    with pytest.raises(PCPConfigError) as err:
        check_pcp_config(cfg)
    assert message in str(err.value)


# -- KV cache dtypes ---------------------------------------------------------------------------

def test_dcp_refuses_quantized_kv_cache_and_names_the_ways_out():
    """-pcp 2 -dcp 2 with fp8: an unquantized cache, or -pcp 2 alone, which takes fp8; with
    e5m2, which -pcp alone refuses too, only the cache."""
    assert ("--kv-cache-dtype fp8: vllm-pcp's DCP runs unquantized KV caches; pass "
            "--kv-cache-dtype auto, or drop -dcp (-pcp 2 alone runs it)") in _refused(
        _config(cache_dtype="fp8", **DCP2))
    assert "unquantized KV caches; pass --kv-cache-dtype auto\n" in _refused(
        _config(cache_dtype="fp8_e5m2", **DCP2)) + "\n"


def test_pcp_alone_takes_fp8_and_refuses_kv_cache_dtypes_no_gpu_run_verified():
    """-pcp 2 and -pcp 4 with an fp8 cache were shown exact against one GPU with fp8; e5m2
    and the other quantized caches have not run, and -dcp keeps its own refusal."""
    assert prepare_pcp_config(_config(cache_dtype="fp8"))
    assert prepare_pcp_config(_config(cache_dtype="auto"))
    for cache_dtype in ("fp8_e5m2", "fp8_e4m3", "nvfp4"):
        msg = _refused(_config(cache_dtype=cache_dtype))
        assert (f"--kv-cache-dtype {cache_dtype}: not verified with -pcp 2 on a GPU (fp8 is)"
                in msg and "pass --kv-cache-dtype fp8 (e4m3) or auto, or drop -pcp" in msg)
    assert _refused(_config(cache_dtype="fp8", **DCP2)).count("--kv-cache-dtype fp8") == 1


# -- features not handled ----------------------------------------------------------------------

CONNECTOR = SimpleNamespace(kv_connector="NixlConnector")


@pytest.mark.parametrize("over,message", [
    (dict(kv_transfer_config=CONNECTOR),
     "--kv-transfer-config (kv_connector NixlConnector): KV connectors key workers by "
     "(pp rank, tp rank) and every PCP rank is tp rank 0; drop it (and "
     "--kv-offloading-size, which sets it) or drop -pcp"),
    (dict(kv_transfer_config=CONNECTOR, **DCP2), "every PCP rank is tp rank 0"),
    (dict(runner_type="pooling"),
     "pooling model 'm' (--runner pooling): not yet verified with vllm-pcp; drop -pcp"),
    (dict(is_hybrid=True), "model 'm' has layers other than attention"),
    (dict(is_attention_free=True), "vllm-pcp runs attention-only models; drop -pcp"),
    (dict(attention_chunk_size=8192),
     "chunked local attention (the model's attention_chunk_size = 8192): its virtual "
     "batches bypass vllm-pcp's K/V exchange; drop -pcp"),
    (dict(kv_sharing_fast_prefill=True), "--kv-sharing-fast-prefill: not handled by "
     "vllm-pcp; drop it or drop -pcp"),
    (dict(enable_hc_sp=True), "--enable-hc-sp (sequence parallelism of HyperConnection "
     "layers): its token scatter over -tp is not verified with vllm-pcp's local batches; "
     "drop it or drop -pcp"),
    (dict(enable_batch_sharded_sampling=True), "--enable-batch-sharded-sampling: not "
     "verified with vllm-pcp's restored batches; drop it or drop -pcp"),
    (dict(enable_expert_parallel=True), "--enable-expert-parallel: vLLM's expert-parallel "
     "dispatch over the PCP ranks is not verified with vllm-pcp; drop it"),
])
def test_unhandled_features_are_refused(over, message):
    assert message in _refused(_config(**over))


# -- attention settings of the model -----------------------------------------------------------

UNPLANNED = [  # model settings vllm-pcp's DCP attention does not plan, and the refusal
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
    assert message + " (run -pcp 2 alone)" in _refused(_config(**model, **DCP2))


@pytest.mark.parametrize("model,message", UNPLANNED)
def test_pcp_alone_keeps_stock_attention_settings(model, message):
    """At DCP = 1 a split step's rows are planned by vLLM's FlashInfer builder, which
    carries logits_soft_cap and sinks (tests/test_attention_settings.py)."""
    assert prepare_pcp_config(_config(**model))


def _window_refusal(window, drop):
    return (f"sliding-window attention (the model's sliding_window = {window}): vLLM's PCP "
            "manager gathers block tables without the sliding-window masking of freed "
            "blocks, and vllm-pcp's attention has no window under -dcp; pass "
            f"--disable-sliding-window (caps --max-model-len at the window), or {drop}")


@pytest.mark.parametrize("over,drop", [
    (dict(), "drop -pcp"), (dict(pcp=4), "drop -pcp"), (DCP2, "drop -pcp and -dcp"),
    (dict(pcp=4, is_moe=True), "drop -pcp")])
def test_sliding_windows_are_refused_under_every_layout(over, drop):
    msg = _refused(_config(hf=dict(sliding_window=4096), **over))
    assert _window_refusal(4096, drop) in msg
    assert msg.count("sliding-window attention") == 1  # named once, with -dcp too


def test_models_without_a_window_are_taken():
    assert prepare_pcp_config(_config(hf=dict(sliding_window=None), **DCP2))
    assert prepare_pcp_config(_config(hf=dict(sliding_window=0)))  # Qwen2-MoE: none


# -- vLLM's own config -------------------------------------------------------------------------

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
        (lambda: real_config(hf=WINDOW), "(the model's sliding_window = 64)"),
        (lambda: real_config(dcp=2, hf=WINDOW), "(the model's sliding_window = 64)"),
        (lambda: real_config(runner="pooling"), "(--runner pooling)"),
        (lambda: real_config(kv_transfer_config=KVTransferConfig(kv_connector="NixlConnector",
                                                                 kv_role="kv_both")),
         "--kv-transfer-config (kv_connector NixlConnector)"),
    ]
    for build, message in cases:
        assert message in _refusal(build)
    plain = real_config()
    assert prepare_pcp_config(plain) and plain.parallel_config.worker_cls == WORKER_CLS


# -- the vLLM version --------------------------------------------------------------------------

def test_the_version_refusal_names_the_version_and_the_ways_out():
    assert version_refusal(VLLM_VERSION) is None
    assert version_refusal("0.34.0") == (
        f"vllm-pcp needs vLLM {VLLM_VERSION} and found vLLM 0.34.0: install "
        f"vllm=={VLLM_VERSION} (pip install vllm-pcp brings it), or drop -pcp")
    assert version_refusal("0.33.0rc1") is not None


def _without(**fields):
    """A way out: set these stand-in fields (``hf``: the model's hf config ones)."""
    def apply(cfg):
        for key, value in fields.items():
            if key == "hf":
                vars(cfg.model_config.hf_text_config).update(value)
            elif hasattr(cfg.parallel_config, key):
                setattr(cfg.parallel_config, key, value)
            elif key == "cache_dtype":
                cfg.cache_config.cache_dtype = value
            else:
                setattr(cfg, key, value)
        return cfg
    return apply


NO_DCP, NO_CP = _without(decode_context_parallel_size=1), _without(
    prefill_context_parallel_size=1, decode_context_parallel_size=1)


@pytest.mark.parametrize("over,way_outs", [
    (dict(hf=dict(attn_logit_softcapping=30.0), **DCP2), {"drop -dcp": NO_DCP}),
    (dict(architectures=["GptOssForCausalLM"], **DCP2), {"drop -dcp": NO_DCP}),
    (dict(cache_dtype="fp8", **DCP2), {"--kv-cache-dtype auto": _without(cache_dtype="auto"),
                                       "drop -dcp": NO_DCP}),
    (dict(hf=dict(sliding_window=4096), **DCP2), {  # vLLM sets it to None (test_sliding_window)
        "--disable-sliding-window": _without(hf=dict(sliding_window=None)),
        "drop -pcp and -dcp": NO_CP}),
    (dict(pcp=4, is_moe=True, additional_config={"pcp_decode_policy": "replicate"}), {
        "drop the knob": _without(additional_config={}),
        "use -pcp 2": _without(prefill_context_parallel_size=2)}),
    (dict(additional_config={"pcp_decode_policy": "shard"}, **DCP2), {
        "drop the knob": _without(additional_config={}), "drop -dcp": NO_DCP}),
    (dict(speculative_config=object()), {"drop -pcp": NO_CP}),
])
def test_every_way_out_a_refusal_names_is_accepted(over, way_outs):
    """Each way out that a refusal offers, taken, passes every check of the plugin (or
    leaves the config to vLLM, where it drops -pcp)."""
    for phrase, take in way_outs.items():
        assert phrase in _refused(_config(**over)), phrase
        cfg = take(_config(**over))
        assert prepare_pcp_config(cfg) is takes_over(cfg), phrase
