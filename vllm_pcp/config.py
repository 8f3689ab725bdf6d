"""Start-up checks for PCP on GQA models.

:func:`prepare_pcp_config` runs once, where vLLM finalises its config (see
``patch_platform_config``): it refuses what the plugin cannot run exactly,
naming the flag and the way out, checks the knobs (:mod:`vllm_pcp.knobs`), and
selects the plugin's worker.
"""
from __future__ import annotations

WORKER_CLS = "vllm_pcp.worker.PCPWorker"
STOCK_WORKER_CLS = ("auto", "vllm.v1.worker.gpu_worker.Worker")


class PCPConfigError(ValueError):
    """A flag combination vllm-pcp refuses at start-up."""


def _attention_backend_name(vllm_config) -> str | None:
    backend = getattr(getattr(vllm_config, "attention_config", None), "backend", None)
    return None if backend is None else getattr(backend, "name", str(backend))


# KV cache dtypes vllm-pcp's DCP attention runs (unquantized), and those -pcp alone takes
# (each shown exact against one GPU on a GPU: fp8 in tests/gpu/results/exactness-features.json);
# both read where they are checked
DCP_CACHE_DTYPES = ("auto", "bfloat16", "float16")
PCP_CACHE_DTYPES = (*DCP_CACHE_DTYPES, "fp8")


def pcp_kv_dtype_refusal(cache_dtype: str, pcp: int) -> str:
    """Why ``-pcp`` (DCP = 1) refuses a KV cache dtype no GPU run has shown exact (fp8 is:
    its e4m3 format under the name ``fp8``)."""
    return (f"--kv-cache-dtype {cache_dtype}: not verified with -pcp {pcp} on a GPU "
            "(fp8 is); pass --kv-cache-dtype fp8 (e4m3) or auto, or drop -pcp")


def _dcp_kv_dtype_refusal(cache_dtype: str, pcp: int) -> str:
    """Why ``-dcp`` refuses a quantized KV cache, and the ways out: an unquantized cache, or
    the layout without ``-dcp`` where it takes ``cache_dtype`` (-tp alone is vLLM's own)."""
    way_out = "pass --kv-cache-dtype auto"
    if pcp == 1:
        way_out += ", or drop -dcp (vLLM runs it with -tp alone)"
    elif cache_dtype in PCP_CACHE_DTYPES:
        way_out += f", or drop -dcp (-pcp {pcp} alone runs it)"
    return (f"--kv-cache-dtype {cache_dtype}: vllm-pcp's DCP runs unquantized KV caches; "
            f"{way_out}")


def _dcp_refusals(vllm_config) -> list[str]:
    parallel = vllm_config.parallel_config
    pcp, dcp = parallel.prefill_context_parallel_size, parallel.decode_context_parallel_size
    cache_dtype = getattr(getattr(vllm_config, "cache_config", None), "cache_dtype", "auto")
    if dcp == 1:
        return ([pcp_kv_dtype_refusal(cache_dtype, pcp)]
                if pcp > 1 and cache_dtype not in PCP_CACHE_DTYPES else [])
    if pcp > 1 and dcp != pcp:
        return [f"--decode-context-parallel-size {dcp}: with -pcp {pcp} it must be 1 or "
                f"{pcp} (the KV cache sharded over the PCP ranks)"]
    out = []
    if getattr(parallel, "dcp_comm_backend", "ag_rs") == "a2a":
        out.append("--dcp-comm-backend a2a: vllm-pcp's DCP exchanges partial states itself; "
                   "omit the flag")
    if cache_dtype not in DCP_CACHE_DTYPES:
        out.append(_dcp_kv_dtype_refusal(cache_dtype, pcp))
    return out + _dcp_attention_refusals(vllm_config.model_config, pcp)


# vLLM 0.26.0 models whose attention layers have sinks, by architecture or by the hf
# config setting that turns them on (gpt_oss.py, mimo_v2.py, laguna.py)
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
    """Attention settings of the model that vllm-pcp's DCP attention does not plan
    (it runs FlashInfer without ``window_left``, ``logits_soft_cap`` or sinks).

    The sliding window is ``ModelConfig.get_sliding_window()`` (the hf text config's
    ``sliding_window``, None once ``--disable-sliding-window`` is given), the soft cap
    the ``attn_logit_softcapping`` vLLM's models pass to their attention layers.
    :class:`vllm_pcp.backend.PCPFlashInferImpl` checks every layer again.
    """
    way_out = f"drop -dcp (run -pcp {pcp} alone)" if pcp > 1 else "drop -dcp"
    out = []
    window = _hf_setting(model, "sliding_window")
    if window:  # Qwen2-MoE configs keep 0 for no window
        out.append(f"sliding-window attention (the model's sliding_window = {window}): "
                   "vllm-pcp's DCP attention has no window; "
                   f"{way_out}, or pass --disable-sliding-window (caps --max-model-len at "
                   "the window)")
    softcap = _hf_setting(model, "attn_logit_softcapping")
    if softcap:
        out.append(f"logit soft-capping (the model's attn_logit_softcapping = {softcap}): "
                   f"vllm-pcp's DCP attention does not cap logits; {way_out}")
    sinks = _attention_sinks(model)
    if sinks is not None:
        out.append(f"attention sinks ({sinks}): vllm-pcp's DCP attention has no sinks; "
                   f"{way_out}")
    return out


def dcp_layer_error(settings: list[str], pcp: int, dcp: int) -> PCPConfigError:
    """The refusal of an attention layer whose ``settings`` (e.g. ``"sliding window of
    4096 tokens"``) vllm-pcp's DCP attention does not plan; raised while the model is
    built, so it stops the engine at start-up whatever the model's config says."""
    layout = f"-pcp {pcp} -dcp {dcp}" if pcp > 1 else f"-dcp {dcp}"
    way_out = f"run -pcp {pcp} alone" if pcp > 1 else "run without it"
    return PCPConfigError(
        f"vllm-pcp cannot run --decode-context-parallel-size {dcp} ({layout}) with an "
        f"attention layer with {' and '.join(settings)}: vllm-pcp's DCP attention plans "
        "FlashInfer without window_left, logits_soft_cap, sinks or a quantized KV cache; "
        f"drop --decode-context-parallel-size ({way_out})")


def _cp_flags(pcp: int, dcp: int) -> tuple[str, str]:
    """The layout's flags (``-pcp 2 -dcp 2``) and how to drop them (``drop -pcp and
    -dcp``)."""
    flags = [f"-{name} {size}" for name, size in (("pcp", pcp), ("dcp", dcp)) if size > 1]
    names = [flag.split()[0] for flag in flags]
    return " ".join(flags), "drop " + " and ".join(names)


def cp_layer_error(settings: list[str], pcp: int, dcp: int) -> PCPConfigError:
    """The refusal of an attention layer with ``settings`` (e.g. ``"ALiBi slopes"``)
    that no attention path of vllm-pcp applies, under every layout the plugin takes
    over; raised while the model is built, so it stops the engine at start-up whatever
    the model's config says."""
    flags, drop = _cp_flags(pcp, dcp)
    return PCPConfigError(
        f"vllm-pcp cannot run {flags} with an attention layer with {' and '.join(settings)}: "
        f"vllm-pcp's attention does not apply {'them' if len(settings) > 1 else 'it'}; "
        f"{drop} (vLLM's default attention backend runs the layer on one GPU or with -tp "
        "alone)")


def dcp_scales_error(scales: list[float], pcp: int, dcp: int) -> PCPConfigError:
    """The refusal of a KV cache group whose attention layers have different softmax
    ``scales``: vllm-pcp's DCP attention plans one scale per group (the builder's
    ``sm_scale``, its first layer's)."""
    flags, drop = _cp_flags(pcp, dcp)
    return PCPConfigError(
        f"vllm-pcp cannot run {flags} with attention layers of softmax scales "
        f"{', '.join(map(str, scales))} in one KV cache group: vllm-pcp's DCP attention "
        f"plans one scale for all of them; {drop} (vLLM's default attention backend takes "
        "a scale per layer)")


def _refusals(vllm_config) -> list[str]:
    parallel = vllm_config.parallel_config
    model = vllm_config.model_config
    cp = "-pcp" if parallel.prefill_context_parallel_size > 1 else "-dcp"
    out = []
    if parallel.data_parallel_size > 1:
        out.append("--data-parallel-size > 1: run one PCP engine per replica "
                   "instead, or drop --prefill-context-parallel-size")
    if parallel.pipeline_parallel_size > 1:
        out.append("--pipeline-parallel-size > 1: use -tp with -pcp instead")
    if vllm_config.speculative_config is not None:
        out.append("--speculative-config: speculative decoding is not supported "
                   f"with PCP; drop it or drop {cp}")
    if vllm_config.lora_config is not None:
        out.append(f"--enable-lora: LoRA is not supported with PCP; drop it or drop {cp}")
    if getattr(model, "is_multimodal_model", False):
        out.append(f"multimodal model {model.model!r}: PCP serves text-only "
                   f"models; drop {cp}")
    if getattr(model, "enable_prompt_embeds", False):
        out.append(f"--enable-prompt-embeds is not supported with PCP; drop it or drop "
                   f"{cp}")
    if parallel.prefill_context_parallel_size > 2 and getattr(model, "is_moe", False):
        out.append(_moe_refusal(parallel.prefill_context_parallel_size))
    backend = _attention_backend_name(vllm_config)
    if backend not in (None, "FLASHINFER"):
        out.append(f"--attention-backend {backend}: PCP for GQA models runs on "
                   "FLASHINFER only; pass --attention-backend FLASHINFER or omit it")
    return out + _unverified_refusals(vllm_config, cp) + _attention_refusals(vllm_config)


def _moe_refusal(pcp: int) -> str:
    """A mixture-of-experts model at PCP > 2. vLLM 0.26.0 all-gathers each expert layer's
    tokens over the PCP ranks and sums the ranks' parts with a reduce-scatter
    (``MoERunner._maybe_combine``). Each rank's slice is summed in another order, which
    over two ranks gives the same bits (a + b = b + a) and over more does not: the tokens
    every rank computes (decodes, unsplit prefills) then leave the ranks with different
    logits, and each rank feeds its own sampled tokens into its next step."""
    return (f"a mixture-of-experts model at -pcp {pcp}: vLLM sums each expert layer's parts "
            "with a reduce-scatter over the PCP ranks, which over more than two ranks adds "
            "them in another order on each rank, so the ranks' logits differ and they sample "
            "different tokens; use -pcp 2 or drop -pcp (-tp shards the experts too)")


# vLLM 0.26.0 models that always pass ALiBi slopes and that ModelConfig.uses_alibi does
# not name (step1.py)
_ALIBI_ARCHITECTURES = ("Step1ForCausalLM",)


def _alibi(model) -> str | None:
    """What gives the model ALiBi attention, or None: vLLM's own test
    (``ModelConfig.uses_alibi``: BLOOM; Falcon's ``alibi``; MPT's ``attn_config.alibi``;
    ``position_encoding_type = "alibi"``), or an architecture of
    :data:`_ALIBI_ARCHITECTURES`."""
    architectures = list(getattr(model, "architectures", None) or ())
    for arch in architectures:
        if arch in _ALIBI_ARCHITECTURES:
            return f"architecture {arch}"
    if getattr(model, "uses_alibi", False):
        return f"{', '.join(architectures) or 'the model'}: vLLM's ModelConfig.uses_alibi"
    return None


def _sm90() -> bool:
    """Whether the GPU is SM90 (Hopper), where vLLM's FlashInfer metadata builder raises
    on any sliding-window layer, after the weights are loaded."""
    from vllm.platforms import current_platform

    return bool(current_platform.is_device_capability(90))


def _attention_refusals(vllm_config) -> list[str]:
    """Attention settings of the model that no attention path of vllm-pcp applies,
    refused under every layout the plugin takes over (``-pcp``, ``-pcp -dcp``, DCP
    inside TP). :class:`vllm_pcp.backend.PCPFlashInferImpl` checks every layer again."""
    parallel, model = vllm_config.parallel_config, vllm_config.model_config
    _, drop = _cp_flags(parallel.prefill_context_parallel_size,
                        parallel.decode_context_parallel_size)
    out = []
    alibi = _alibi(model)
    if alibi is not None:
        out.append(f"ALiBi attention ({alibi}): vllm-pcp's attention adds no ALiBi bias "
                   "(vLLM 0.26.0's FlashInferImpl keeps the slopes and never reads them); "
                   f"{drop}: vLLM's default attention backend applies ALiBi on one GPU "
                   "and with -tp alone")
    window = _hf_setting(model, "sliding_window")
    if window and parallel.decode_context_parallel_size == 1 and _sm90():
        out.append(f"sliding-window attention (the model's sliding_window = {window}) on "
                   "SM90: vLLM 0.26.0's FlashInfer backend refuses sliding windows on Hopper "
                   f"GPUs; {drop} (vLLM's default attention backend runs the window), or "
                   "pass --disable-sliding-window (caps --max-model-len at the window)")
    shared = _hf_setting(model, "num_kv_shared_layers")
    if shared:
        out.append(f"cross-layer KV sharing (the model's num_kv_shared_layers = {shared}): "
                   "not yet verified with vllm-pcp (under -dcp a sharing layer's forward "
                   f"would write its own K/V into its target layer's cache); {drop}")
    return out


def _kv_transfer_refusal(vllm_config, cp: str) -> str:
    connector = getattr(vllm_config.kv_transfer_config, "kv_connector", None)
    why = ("KV connectors key workers by (pp rank, tp rank) and every PCP rank is tp "
           "rank 0" if cp == "-pcp" else
           "KV connectors are not verified with vllm-pcp's DCP cache layout")
    return (f"--kv-transfer-config (kv_connector {connector}): {why}; drop it (and "
            f"--kv-offloading-size, which sets it) or drop {cp}")


def _unverified_refusals(vllm_config, cp: str) -> list[str]:
    """Features vllm-pcp does not handle: refused until they are made exact."""
    model = vllm_config.model_config
    out = []
    if getattr(vllm_config, "kv_transfer_config", None) is not None:
        out.append(_kv_transfer_refusal(vllm_config, cp))
    if getattr(model, "runner_type", "generate") == "pooling":
        out.append(f"pooling model {model.model!r} (--runner pooling): not yet verified "
                   f"with vllm-pcp; drop {cp}")
    if getattr(model, "is_hybrid", False) or getattr(model, "is_attention_free", False):
        out.append(f"model {model.model!r} has layers other than attention (mamba, "
                   f"linear attention): vllm-pcp runs attention-only models; drop {cp}")
    chunk = getattr(model, "attention_chunk_size", None)
    if chunk is not None:
        out.append(f"chunked local attention (the model's attention_chunk_size = {chunk}): "
                   f"its virtual batches bypass vllm-pcp's K/V exchange; drop {cp}")
    cache = getattr(vllm_config, "cache_config", None)
    if getattr(cache, "kv_sharing_fast_prefill", False):
        out.append(f"--kv-sharing-fast-prefill: not handled by vllm-pcp; drop it or drop "
                   f"{cp}")
    if cp == "-pcp" and getattr(vllm_config.parallel_config, "enable_expert_parallel", False):
        out.append("--enable-expert-parallel: vLLM's expert-parallel dispatch over the PCP "
                   "ranks is not verified with vllm-pcp; drop it (without it the experts are "
                   "sharded over the -tp x -pcp ranks and every rank's rows line up) or drop "
                   "-pcp")
    if cp == "-pcp" and getattr(cache, "calculate_kv_scales", False):
        out.append("--calculate-kv-scales: each PCP rank would take the KV scales from its "
                   "own chunks' keys; drop it or drop -pcp")
    pass_config = getattr(getattr(vllm_config, "compilation_config", None), "pass_config",
                          None)
    if cp == "-pcp" and getattr(pass_config, "enable_sp", False):
        out.append("--compilation-config pass_config.enable_sp (sequence parallelism; "
                   "fuse_gemm_comms turns it on): split steps run a local token count it "
                   "does not scatter over -tp; turn both off or drop -pcp")
    return out


def stock_flashinfer_dcp_error(dcp: int) -> PCPConfigError:
    """The refusal of vLLM's own FlashInfer DCP (PCP = 1, DCP = ``dcp``, FlashInfer
    chosen by vLLM rather than named, so the plugin's worker is not in place)."""
    return PCPConfigError(
        f"vllm-pcp: --decode-context-parallel-size {dcp} on a FLASHINFER backend vLLM chose "
        "itself would run vLLM 0.26.0's own FlashInfer DCP, whose tokens differ from one "
        "GPU's (measured on 2 x H200: from the first generated token); pass "
        "--attention-backend FLASHINFER to run vllm-pcp's DCP instead, or "
        "--attention-backend FLASH_ATTN for vLLM's")


def takes_over(vllm_config) -> bool:
    """PCP > 1 on a non-MLA model; or DCP inside TP (PCP = 1) with FLASHINFER named:
    vLLM 0.26.0's own FlashInfer DCP gives wrong tokens, the plugin's replaces it."""
    parallel, model = vllm_config.parallel_config, vllm_config.model_config
    if model is None or model.use_mla:
        return False
    if parallel.prefill_context_parallel_size > 1:
        return True
    return (parallel.decode_context_parallel_size > 1
            and _attention_backend_name(vllm_config) == "FLASHINFER")


def prepare_pcp_config(vllm_config) -> bool:
    """Validate a PCP > 1 config (or DCP inside TP on FlashInfer) for a non-MLA model
    and select the PCP worker.

    Returns True when the plugin takes the config over, False when it leaves
    it to vLLM (PCP = 1 without FlashInfer DCP, MLA models, no model). Raises
    :class:`PCPConfigError` listing every refused flag.
    """
    parallel = vllm_config.parallel_config
    if not takes_over(vllm_config):
        return False
    from vllm_pcp.knobs import PCPKnobs  # here, not above: knobs.py imports PCPConfigError

    PCPKnobs.from_additional_config(vllm_config.additional_config)  # refuses bad knobs
    refused = _refusals(vllm_config) + _dcp_refusals(vllm_config)
    if refused:
        pcp, dcp = (parallel.prefill_context_parallel_size,
                    parallel.decode_context_parallel_size)
        layout = (f"--prefill-context-parallel-size {pcp}" if pcp > 1 else
                  f"--decode-context-parallel-size {dcp} (DCP inside TP)")
        raise PCPConfigError(f"vllm-pcp cannot run {layout} with:\n  - "
                             + "\n  - ".join(refused))
    if parallel.worker_cls not in STOCK_WORKER_CLS and parallel.worker_cls != WORKER_CLS:
        raise PCPConfigError(
            f"--worker-cls {parallel.worker_cls}: PCP needs the plugin's worker "
            f"{WORKER_CLS}; omit --worker-cls")
    parallel.worker_cls = WORKER_CLS
    if parallel.decode_context_parallel_size > 1:
        _decode_cuda_graphs_only(vllm_config)
    return True


def _logger():
    from vllm.logger import init_logger

    return init_logger("vllm.vllm_pcp.config")


def _decode_cuda_graphs_only(vllm_config) -> None:
    """Under PCP x DCP only pure decode steps replay CUDA graphs (full graphs of
    the plugin's folded decode); every other step runs eagerly. ``NONE`` stays."""
    from vllm.config import CUDAGraphMode

    compilation = vllm_config.compilation_config
    if compilation.cudagraph_mode not in (CUDAGraphMode.NONE, CUDAGraphMode.FULL_DECODE_ONLY):
        _logger().info("PCP x DCP: cudagraph_mode %s set to FULL_DECODE_ONLY (full graphs "
                       "of pure decode steps, other steps eager)",
                       getattr(compilation.cudagraph_mode, "name", "default"))
        compilation.cudagraph_mode = CUDAGraphMode.FULL_DECODE_ONLY
