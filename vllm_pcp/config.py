"""Start-up checks and plugin knobs for PCP on GQA models.

:func:`prepare_pcp_config` runs once, where vLLM finalises its config (see
``patch_platform_config``): it refuses what the plugin cannot run exactly,
naming the flag and the way out, and selects the plugin's worker. Knobs come
from ``--additional-config``.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

WORKER_CLS = "vllm_pcp.worker.PCPWorker"
STOCK_WORKER_CLS = ("auto", "vllm.v1.worker.gpu_worker.Worker")


class PCPConfigError(ValueError):
    """A flag combination vllm-pcp refuses at start-up."""


@dataclass(frozen=True)
class PCPKnobs:
    """Plugin knobs, read from ``--additional-config``.

    min_split_tokens : prompts shorter than this are computed whole on every rank;
        every chunk of a longer one is split (``pcp_min_split_tokens``). None (the
        default): :data:`DEFAULT_MIN_SPLIT_TOKENS` (see :func:`min_split_tokens`).
    dcp_context_exchange : with ``-dcp``, how a split chunk reaches the context that
        earlier steps stored on other ranks (``pcp_dcp_context_exchange``):
        ``"queries"`` all-gathers its queries and sends partial outputs back,
        ``"keys"`` all-gathers the context K/V, ``"auto"`` (default) whichever moves
        fewer bytes in that step (:mod:`vllm_pcp.dcp_plan`).
    """

    min_split_tokens: int | None = None
    dcp_context_exchange: str = "auto"

    @classmethod
    def from_additional_config(cls, additional_config: Any) -> PCPKnobs:
        raw = additional_config if isinstance(additional_config, dict) else {}
        unknown = sorted(k for k in raw if str(k).startswith("pcp_") and k not in _KNOBS)
        if unknown:
            raise PCPConfigError(f"--additional-config {', '.join(unknown)}: not a vllm-pcp "
                                 f"knob (known: {', '.join(_KNOBS)})")
        value = raw.get("pcp_min_split_tokens")
        if value is not None and (isinstance(value, bool) or not isinstance(value, int)
                                  or value < 0):
            raise PCPConfigError(
                f"--additional-config pcp_min_split_tokens must be a non-negative "
                f"integer, got {value!r}")
        exchange = raw.get("pcp_dcp_context_exchange", "auto")
        if exchange not in CONTEXT_EXCHANGES:
            raise PCPConfigError(
                f"--additional-config pcp_dcp_context_exchange must be one of "
                f"{', '.join(CONTEXT_EXCHANGES)}, got {exchange!r}")
        return cls(min_split_tokens=value, dcp_context_exchange=exchange)


_KNOBS = ("pcp_min_split_tokens", "pcp_dcp_context_exchange")
# how split chunks reach the context stored on other DCP ranks (vllm_pcp.dcp_plan)
CONTEXT_EXCHANGES = ("auto", "queries", "keys")

# A fresh 4K prompt split over 2 x H200 reached its first token 1.12x later than on one
# GPU, while 32K and 128K prompts gained 1.85x and 1.92x (benchmarks/results/run-45a125d/
# ttft.json); unsplit below 8192 tokens the 4K prompt is within 1 % of one GPU
# (run-94ba6c7/ttft.json, pcp2-min8k).
DEFAULT_MIN_SPLIT_TOKENS = 8192


def min_split_tokens(knobs: PCPKnobs, pcp_world_size: int) -> int:
    """Prompt length from which a prefill is split across the PCP ranks, every chunk
    of it (:func:`vllm_pcp.partition.split_requests`).

    The knob if set, else :data:`DEFAULT_MIN_SPLIT_TOKENS`. Never below
    ``2 * pcp_world_size``: every rank must get tokens of a split prefill.
    """
    value = DEFAULT_MIN_SPLIT_TOKENS if knobs.min_split_tokens is None else \
        knobs.min_split_tokens
    return max(value, 2 * pcp_world_size)


def _attention_backend_name(vllm_config) -> str | None:
    backend = getattr(getattr(vllm_config, "attention_config", None), "backend", None)
    return None if backend is None else getattr(backend, "name", str(backend))


def _dcp_refusals(vllm_config) -> list[str]:
    parallel = vllm_config.parallel_config
    pcp, dcp = parallel.prefill_context_parallel_size, parallel.decode_context_parallel_size
    if dcp == 1:
        return []
    if pcp > 1 and dcp != pcp:
        return [f"--decode-context-parallel-size {dcp}: with -pcp {pcp} it must be 1 or "
                f"{pcp} (the KV cache sharded over the PCP ranks)"]
    out = []
    if getattr(parallel, "dcp_comm_backend", "ag_rs") == "a2a":
        out.append("--dcp-comm-backend a2a: vllm-pcp's DCP exchanges partial states itself; "
                   "omit the flag")
    cache_dtype = getattr(getattr(vllm_config, "cache_config", None), "cache_dtype", "auto")
    if cache_dtype not in ("auto", "bfloat16", "float16"):
        out.append(f"--kv-cache-dtype {cache_dtype}: vllm-pcp's DCP runs unquantized KV "
                   "caches")
    return out


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
    backend = _attention_backend_name(vllm_config)
    if backend not in (None, "FLASHINFER"):
        out.append(f"--attention-backend {backend}: PCP for GQA models runs on "
                   "FLASHINFER only; pass --attention-backend FLASHINFER or omit it")
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
