"""Start-up checks for PCP on GQA models.

:func:`prepare_pcp_config` runs once, where vLLM finalises its config
(:mod:`vllm_pcp.patches.platform_config`): it refuses what the plugin cannot run exactly,
naming the flag and the way out, checks the knobs and selects the plugin's worker. Each
worker checks again (:meth:`vllm_pcp.manager.GQAPCPManager.validate_config`).
"""
from __future__ import annotations

WORKER_CLS = "vllm_pcp.worker.PCPWorker"
STOCK_WORKER_CLS = ("auto", "vllm.v1.worker.gpu_worker.Worker")
VLLM_VERSION = "0.33.0"  # the one vLLM release vllm-pcp runs on (pyproject.toml)


class PCPConfigError(ValueError):
    """A flag combination vllm-pcp refuses at start-up."""


def _attention_backend_name(vllm_config) -> str | None:
    backend = getattr(getattr(vllm_config, "attention_config", None), "backend", None)
    return None if backend is None else getattr(backend, "name", str(backend))


# KV cache dtypes of vllm-pcp's DCP attention (unquantized) and of -pcp alone (each shown
# exact against one GPU: fp8 in tests/gpu/results/exactness-features.json)
DCP_CACHE_DTYPES = ("auto", "bfloat16", "float16")
PCP_CACHE_DTYPES = (*DCP_CACHE_DTYPES, "fp8")


def pcp_kv_dtype_refusal(cache_dtype: str, pcp: int) -> str:
    """Why ``-pcp`` (DCP = 1) refuses a KV cache dtype no GPU run has shown exact."""
    return (f"--kv-cache-dtype {cache_dtype}: not verified with -pcp {pcp} on a GPU "
            "(fp8 is); pass --kv-cache-dtype fp8 (e4m3) or auto, or drop -pcp")


def _dcp_kv_dtype_refusal(cache_dtype: str, pcp: int) -> str:
    """Why ``-dcp`` refuses a quantized KV cache, and the ways out."""
    way_out = "pass --kv-cache-dtype auto"
    if cache_dtype in PCP_CACHE_DTYPES:
        way_out += f", or drop -dcp (-pcp {pcp} alone runs it)"
    return (f"--kv-cache-dtype {cache_dtype}: vllm-pcp's DCP runs unquantized KV caches; "
            f"{way_out}")


def _dcp_refusals(vllm_config) -> list[str]:
    parallel = vllm_config.parallel_config
    pcp, dcp = parallel.prefill_context_parallel_size, parallel.decode_context_parallel_size
    cache_dtype = getattr(getattr(vllm_config, "cache_config", None), "cache_dtype", "auto")
    if dcp == 1:
        return ([pcp_kv_dtype_refusal(cache_dtype, pcp)]
                if cache_dtype not in PCP_CACHE_DTYPES else [])
    if dcp != pcp:
        return [f"--decode-context-parallel-size {dcp}: with -pcp {pcp} it must be 1 or "
                f"{pcp} (the KV cache sharded over the PCP ranks)"]
    out = []
    if getattr(parallel, "dcp_comm_backend", "ag_rs") == "a2a":
        out.append("--dcp-comm-backend a2a: vllm-pcp's DCP exchanges partial states itself; "
                   "omit the flag")
    if cache_dtype not in DCP_CACHE_DTYPES:
        out.append(_dcp_kv_dtype_refusal(cache_dtype, pcp))
    return out + _dcp_attention_refusals(vllm_config.model_config, pcp)


# vLLM models with attention sinks: by architecture or hf config setting (gpt_oss.py,
# mimo_v2.py, laguna.py)
_SINK_ARCHITECTURES = ("GptOssForCausalLM",)
_SINK_SETTINGS = ("add_swa_attention_sink_bias", "swa_attention_sink_enabled")


def _hf_setting(model, key: str):
    return getattr(getattr(model, "hf_text_config", None), key, None)


def _attention_sinks(model) -> str | None:
    """What gives the model attention sinks, or None."""
    for arch in getattr(model, "architectures", None) or ():
        if arch in _SINK_ARCHITECTURES:
            return f"architecture {arch}"
    for key in _SINK_SETTINGS:
        if _hf_setting(model, key):
            return f"the model's {key} = {_hf_setting(model, key)!r}"
    return None


def _dcp_attention_refusals(model, pcp: int) -> list[str]:
    """The model's attention settings vllm-pcp's DCP attention does not plan (soft cap,
    sinks); :class:`vllm_pcp.backend.PCPFlashInferImpl` checks every layer again."""
    way_out = f"drop -dcp (run -pcp {pcp} alone)"
    out = []
    softcap = _hf_setting(model, "attn_logit_softcapping")
    if softcap:
        out.append(f"logit soft-capping (the model's attn_logit_softcapping = {softcap}): "
                   f"vllm-pcp's DCP attention does not cap logits; {way_out}")
    sinks = _attention_sinks(model)
    if sinks is not None:
        out.append(f"attention sinks ({sinks}): vllm-pcp's DCP attention has no sinks; "
                   f"{way_out}")
    return out


def dcp_layer_error(settings: list[str], pcp: int) -> PCPConfigError:
    """The refusal of a layer whose ``settings`` (e.g. ``"logits_soft_cap 30.0"``) DCP
    attention does not plan; raised while the model is built, whatever its config says."""
    return PCPConfigError(
        f"vllm-pcp cannot run --decode-context-parallel-size {pcp} (-pcp {pcp} -dcp {pcp}) "
        f"with an attention layer with {' and '.join(settings)}: vllm-pcp's DCP attention "
        "plans FlashInfer without window_left, logits_soft_cap, sinks or a quantized KV "
        f"cache; drop --decode-context-parallel-size (run -pcp {pcp} alone)")


def _cp_flags(pcp: int, dcp: int) -> tuple[str, str]:
    """The layout's flags (``-pcp 2 -dcp 2``) and how to drop them."""
    flags = [f"-{name} {size}" for name, size in (("pcp", pcp), ("dcp", dcp)) if size > 1]
    names = [flag.split()[0] for flag in flags]
    return " ".join(flags), "drop " + " and ".join(names)


def cp_layer_error(settings: list[str], pcp: int, dcp: int) -> PCPConfigError:
    """The refusal of a layer with ``settings`` (e.g. ``"ALiBi slopes"``) no attention path
    of vllm-pcp applies; raised while the model is built, whatever its config says."""
    flags, drop = _cp_flags(pcp, dcp)
    return PCPConfigError(
        f"vllm-pcp cannot run {flags} with an attention layer with {' and '.join(settings)}: "
        f"vllm-pcp's attention does not apply {'them' if len(settings) > 1 else 'it'}; "
        f"{drop} (vLLM's default attention backend runs the layer on one GPU or with -tp "
        "alone)")


def dcp_scales_error(scales: list[float], pcp: int) -> PCPConfigError:
    """The refusal of a KV cache group of several softmax ``scales`` (DCP plans one)."""
    return PCPConfigError(
        f"vllm-pcp cannot run -pcp {pcp} -dcp {pcp} with attention layers of softmax "
        f"scales {', '.join(map(str, scales))} in one KV cache group: vllm-pcp's DCP "
        f"attention plans one scale for all of them; drop -dcp (run -pcp {pcp} alone)")


def _refusals(vllm_config, supports_mm_inputs: bool = False) -> list[str]:
    parallel = vllm_config.parallel_config
    model = vllm_config.model_config
    out = []
    if parallel.data_parallel_size > 1:
        out.append("--data-parallel-size > 1: run one PCP engine per replica "
                   "instead, or drop --prefill-context-parallel-size")
    if parallel.pipeline_parallel_size > 1:
        out.append("--pipeline-parallel-size > 1: use -tp with -pcp instead")
    if vllm_config.speculative_config is not None:
        out.append("--speculative-config: speculative decoding is not supported "
                   "with PCP; drop it or drop -pcp")
    if vllm_config.lora_config is not None:
        out.append("--enable-lora: LoRA is not supported with PCP; drop it or drop -pcp")
    if getattr(model, "is_multimodal_model", False) or supports_mm_inputs:
        out.append(f"multimodal model {model.model!r}: PCP serves text-only "
                   "models; drop -pcp")
    if getattr(model, "is_encoder_decoder", False):
        out.append(f"encoder-decoder model {model.model!r}: PCP serves decoder-only "
                   "models; drop -pcp")
    if getattr(model, "enable_prompt_embeds", False):
        out.append("--enable-prompt-embeds is not supported with PCP; drop it or drop -pcp")
    backend = _attention_backend_name(vllm_config)
    if backend not in (None, "FLASHINFER"):
        out.append(f"--attention-backend {backend}: PCP for GQA models runs on "
                   "FLASHINFER only; pass --attention-backend FLASHINFER or omit it")
    return (out + _knob_refusals(vllm_config) + _unverified_refusals(vllm_config)
            + _attention_refusals(vllm_config) + _cuda_graph_refusals(vllm_config))


def _cuda_graph_refusals(vllm_config) -> list[str]:
    """Refusals of a CUDA graph mode changed after :func:`_fit_cuda_graphs` (any worker)."""
    from vllm_pcp.knobs import PCPSettings

    mode = getattr(vllm_config.compilation_config, "cudagraph_mode", None)
    if mode is None or not mode.has_full_cudagraphs():
        return []
    if not mode.separate_routine():
        return [f"-cc.cudagraph_mode {mode.name}: full CUDA graphs of steps with prefills "
                "would replay a split step's attention; use FULL_AND_PIECEWISE, "
                "FULL_DECODE_ONLY, PIECEWISE or NONE"]
    settings = PCPSettings.from_vllm_config(vllm_config)
    if settings.dcp_world_size > 1 or not settings.unsplit_steps_local:
        return [f"-cc.cudagraph_mode {mode.name}: vllm-pcp plans the attention of every "
                "step under -dcp or pcp_decode_policy shard; use PIECEWISE or NONE"]
    return []


def _knob_refusals(vllm_config) -> list[str]:
    """Knob values the layout cannot take."""
    from vllm_pcp.knobs import PCPKnobs

    parallel, model = vllm_config.parallel_config, vllm_config.model_config
    pcp, dcp = parallel.prefill_context_parallel_size, parallel.decode_context_parallel_size
    policy = PCPKnobs.from_additional_config(vllm_config.additional_config).decode_policy
    if dcp > 1 and policy == "shard":
        return [f"--additional-config pcp_decode_policy shard with -dcp {dcp}: every rank "
                "attends its shard of each decode; drop the knob (auto) or drop -dcp"]
    if dcp == 1 and pcp > 2 and policy == "replicate" and getattr(model, "is_moe", False):
        return [_moe_refusal(pcp)]
    return []


def _moe_refusal(pcp: int) -> str:
    """A mixture-of-experts model at PCP > 2 with decodes on every rank: the expert
    layers' reduce-scatter sums each rank's slice in another order, the same bits over two
    ranks (a + b = b + a) but not more, so the ranks' logits would differ."""
    return (f"--additional-config pcp_decode_policy replicate on a mixture-of-experts "
            f"model at -pcp {pcp}: vLLM sums each expert layer's parts with a "
            "reduce-scatter over the PCP ranks, in another order on each rank beyond two, "
            "so ranks that compute the same decode get different logits; drop the knob "
            "(auto shards the decodes: one rank computes each), or use -pcp 2")


# vLLM models that pass ALiBi slopes unnamed by ModelConfig.uses_alibi (step1.py)
_ALIBI_ARCHITECTURES = ("Step1ForCausalLM",)


def _alibi(model) -> str | None:
    """What gives the model ALiBi attention, or None."""
    architectures = list(getattr(model, "architectures", None) or ())
    for arch in architectures:
        if arch in _ALIBI_ARCHITECTURES:
            return f"architecture {arch}"
    if getattr(model, "uses_alibi", False):
        return f"{', '.join(architectures) or 'the model'}: vLLM's ModelConfig.uses_alibi"
    return None


def _attention_refusals(vllm_config) -> list[str]:
    """The model's attention settings vllm-pcp does not apply or has not verified, under
    every layout (:class:`vllm_pcp.backend.PCPFlashInferImpl` checks every layer again)."""
    parallel, model = vllm_config.parallel_config, vllm_config.model_config
    _, drop = _cp_flags(parallel.prefill_context_parallel_size,
                        parallel.decode_context_parallel_size)
    out = []
    alibi = _alibi(model)
    if alibi is not None:
        out.append(f"ALiBi attention ({alibi}): vllm-pcp's attention adds no ALiBi bias "
                   "(vLLM's FlashInferImpl keeps the slopes and never reads them); "
                   f"{drop}: vLLM's default attention backend applies ALiBi on one GPU "
                   "and with -tp alone")
    window = _hf_setting(model, "sliding_window")
    if window:  # Qwen2-MoE configs keep 0 for no window
        out.append(f"sliding-window attention (the model's sliding_window = {window}): "
                   "vLLM's PCP manager gathers block tables without the sliding-window "
                   "masking of freed blocks, and vllm-pcp's attention has no window under "
                   "-dcp; pass --disable-sliding-window (caps --max-model-len at the "
                   f"window), or {drop}")
    shared = _hf_setting(model, "num_kv_shared_layers")
    if shared:
        out.append(f"cross-layer KV sharing (the model's num_kv_shared_layers = {shared}): "
                   f"not verified with vllm-pcp; {drop}")
    return out


def _kv_transfer_refusal(vllm_config) -> str:
    connector = getattr(vllm_config.kv_transfer_config, "kv_connector", None)
    return (f"--kv-transfer-config (kv_connector {connector}): KV connectors key workers "
            "by (pp rank, tp rank) and every PCP rank is tp rank 0; drop it (and "
            "--kv-offloading-size, which sets it) or drop -pcp")


def _unverified_refusals(vllm_config) -> list[str]:
    """Features vllm-pcp does not handle."""
    model = vllm_config.model_config
    out = []
    if getattr(vllm_config, "kv_transfer_config", None) is not None:
        out.append(_kv_transfer_refusal(vllm_config))
    if getattr(model, "runner_type", "generate") == "pooling":
        out.append(f"pooling model {model.model!r} (--runner pooling): not yet verified "
                   "with vllm-pcp; drop -pcp")
    if getattr(model, "is_hybrid", False) or getattr(model, "is_attention_free", False):
        out.append(f"model {model.model!r} has layers other than attention (mamba, "
                   "linear attention): vllm-pcp runs attention-only models; drop -pcp")
    chunk = getattr(model, "attention_chunk_size", None)
    if chunk is not None:
        out.append(f"chunked local attention (the model's attention_chunk_size = {chunk}): "
                   "its virtual batches bypass vllm-pcp's K/V exchange; drop -pcp")
    cache = getattr(vllm_config, "cache_config", None)
    if getattr(cache, "kv_sharing_fast_prefill", False):
        out.append("--kv-sharing-fast-prefill: not handled by vllm-pcp; drop it or drop -pcp")
    if getattr(vllm_config.parallel_config, "enable_expert_parallel", False):
        out.append("--enable-expert-parallel: vLLM's expert-parallel dispatch over the PCP "
                   "ranks is not verified with vllm-pcp; drop it (without it the experts are "
                   "sharded over the -tp x -pcp ranks and every rank's rows line up) or drop "
                   "-pcp")
    parallel = vllm_config.parallel_config
    if getattr(parallel, "enable_hc_sp", False):
        out.append("--enable-hc-sp (sequence parallelism of HyperConnection layers): its "
                   "token scatter over -tp is not verified with vllm-pcp's local batches; "
                   "drop it or drop -pcp")
    if getattr(parallel, "enable_batch_sharded_sampling", None):
        out.append("--enable-batch-sharded-sampling: not verified with vllm-pcp's restored "
                   "batches; drop it or drop -pcp")
    return out


def version_refusal(installed: str) -> str | None:
    """Why vllm-pcp refuses ``-pcp`` on the installed vLLM, or None on :data:`VLLM_VERSION`."""
    if installed == VLLM_VERSION:
        return None
    return (f"vllm-pcp needs vLLM {VLLM_VERSION} and found vLLM {installed}: install "
            f"vllm=={VLLM_VERSION} (pip install vllm-pcp brings it), or drop -pcp")


def takes_over(vllm_config) -> bool:
    """PCP > 1 on a non-MLA model (MLA models keep vLLM's own PCP)."""
    parallel, model = vllm_config.parallel_config, vllm_config.model_config
    return (model is not None and not model.use_mla
            and parallel.prefill_context_parallel_size > 1)


def _refusal_error(vllm_config, refused: list[str]) -> PCPConfigError:
    pcp = vllm_config.parallel_config.prefill_context_parallel_size
    return PCPConfigError(f"vllm-pcp cannot run --prefill-context-parallel-size {pcp} "
                          "with:\n  - " + "\n  - ".join(refused))


def check_pcp_config(vllm_config, supports_mm_inputs: bool = False) -> None:
    """Raise :class:`PCPConfigError` listing every refused flag of a config taken over."""
    from vllm_pcp.knobs import PCPKnobs

    if not takes_over(vllm_config):
        return
    PCPKnobs.from_additional_config(vllm_config.additional_config)
    refused = _refusals(vllm_config, supports_mm_inputs) + _dcp_refusals(vllm_config)
    if refused:
        raise _refusal_error(vllm_config, refused)


def prepare_pcp_config(vllm_config) -> bool:
    """Validate a config the plugin takes over, select its worker and CUDA graphs; False
    where it is left to vLLM (PCP = 1, MLA, no model)."""
    if not takes_over(vllm_config):
        return False
    from vllm_pcp.knobs import PCPKnobs

    PCPKnobs.from_additional_config(vllm_config.additional_config)
    _fit_cuda_graphs(vllm_config)
    check_pcp_config(vllm_config)
    parallel = vllm_config.parallel_config
    if parallel.worker_cls not in STOCK_WORKER_CLS and parallel.worker_cls != WORKER_CLS:
        raise _refusal_error(vllm_config, [
            f"--worker-cls {parallel.worker_cls}: PCP needs the plugin's worker "
            f"{WORKER_CLS}; omit --worker-cls"])
    parallel.worker_cls = WORKER_CLS
    return True


def _fit_cuda_graphs(vllm_config) -> None:
    """Full CUDA graphs replay only decode steps every rank computes and writes locally
    (``replicate`` at DCP = 1); elsewhere vllm-pcp plans attention each step, so full
    graphs become piecewise ones, or off."""
    from vllm.config import CUDAGraphMode

    from vllm_pcp.knobs import PCPSettings

    compilation = vllm_config.compilation_config
    mode = compilation.cudagraph_mode
    if mode is None or not mode.has_full_cudagraphs():
        return
    settings = PCPSettings.from_vllm_config(vllm_config)
    if settings.unsplit_steps_local and settings.dcp_world_size == 1:
        if mode.separate_routine():
            return
        new = CUDAGraphMode.FULL_AND_PIECEWISE  # full graphs of decode steps only
    else:
        new = (CUDAGraphMode.PIECEWISE if mode.has_piecewise_cudagraphs()
               else CUDAGraphMode.NONE)
    from vllm.logger import init_logger

    init_logger("vllm.vllm_pcp.config").info(
        "vllm-pcp: cudagraph_mode %s set to %s", mode.name, new.name)
    compilation.cudagraph_mode = new
