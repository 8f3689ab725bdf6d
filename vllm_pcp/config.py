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

    min_split_tokens : prefills with fewer scheduled tokens in a step are
        computed whole on every rank instead of being split (``pcp_min_split_tokens``).
    """

    min_split_tokens: int = 2

    @classmethod
    def from_additional_config(cls, additional_config: Any) -> PCPKnobs:
        raw = additional_config if isinstance(additional_config, dict) else {}
        value = raw.get("pcp_min_split_tokens", cls.min_split_tokens)
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise PCPConfigError(
                f"--additional-config pcp_min_split_tokens must be a non-negative "
                f"integer, got {value!r}")
        return cls(min_split_tokens=value)


def _attention_backend_name(vllm_config) -> str | None:
    backend = getattr(getattr(vllm_config, "attention_config", None), "backend", None)
    return None if backend is None else getattr(backend, "name", str(backend))


def _refusals(vllm_config) -> list[str]:
    parallel = vllm_config.parallel_config
    model = vllm_config.model_config
    pcp = parallel.prefill_context_parallel_size
    out = []
    if parallel.data_parallel_size > 1:
        out.append("--data-parallel-size > 1: run one PCP engine per replica "
                   "instead, or drop --prefill-context-parallel-size")
    if parallel.pipeline_parallel_size > 1:
        out.append("--pipeline-parallel-size > 1: use -tp with -pcp instead")
    if parallel.decode_context_parallel_size > 1:
        out.append("--decode-context-parallel-size > 1 together with "
                   f"--prefill-context-parallel-size {pcp} is not supported yet: "
                   "drop -dcp (every PCP rank then keeps the whole KV cache)")
    if vllm_config.speculative_config is not None:
        out.append("--speculative-config: speculative decoding is not supported "
                   "with PCP; drop it or drop -pcp")
    if vllm_config.lora_config is not None:
        out.append("--enable-lora: LoRA is not supported with PCP; drop it or drop -pcp")
    if getattr(model, "is_multimodal_model", False):
        out.append(f"multimodal model {model.model!r}: PCP serves text-only "
                   "models; drop -pcp")
    if getattr(model, "enable_prompt_embeds", False):
        out.append("--enable-prompt-embeds is not supported with PCP; drop it or drop -pcp")
    backend = _attention_backend_name(vllm_config)
    if backend not in (None, "FLASHINFER"):
        out.append(f"--attention-backend {backend}: PCP for GQA models runs on "
                   "FLASHINFER only; pass --attention-backend FLASHINFER or omit it")
    return out


def prepare_pcp_config(vllm_config) -> bool:
    """Validate a PCP > 1 config for a non-MLA model and select the PCP worker.

    Returns True when the plugin takes the config over, False when it leaves
    it to vLLM (PCP = 1, MLA models, no model). Raises :class:`PCPConfigError`
    listing every refused flag.
    """
    parallel = vllm_config.parallel_config
    model = vllm_config.model_config
    if parallel.prefill_context_parallel_size <= 1 or model is None or model.use_mla:
        return False
    refused = _refusals(vllm_config)
    PCPKnobs.from_additional_config(vllm_config.additional_config)
    if refused:
        raise PCPConfigError(
            "vllm-pcp cannot run --prefill-context-parallel-size "
            f"{parallel.prefill_context_parallel_size} with:\n  - " + "\n  - ".join(refused))
    if parallel.worker_cls not in STOCK_WORKER_CLS and parallel.worker_cls != WORKER_CLS:
        raise PCPConfigError(
            f"--worker-cls {parallel.worker_cls}: PCP needs the plugin's worker "
            f"{WORKER_CLS}; omit --worker-cls")
    parallel.worker_cls = WORKER_CLS
    return True
