"""vLLM's Model Runner V2 with vllm-pcp's PCP manager (``pcp_manager_cls``); it passes each
step's split to vllm-pcp's attention metadata builder (:class:`PCPModelState`), holds the
widest split step's buffers through the profile run (:mod:`vllm_pcp.pcp.memory`) and, with
``VLLM_PCP_CHECK_SAMPLED_TOKENS=1``, compares the sampled tokens across the PCP ranks
(:mod:`vllm_pcp.pcp.agreement`).
"""
from __future__ import annotations

import torch
from vllm.logger import init_logger
from vllm.v1.worker.gpu.model_runner import GPUModelRunner
from vllm.v1.worker.gpu.model_states.default import DefaultModelState
from vllm.v1.worker.gpu.model_states.interface import ModelSpecificAttnMetadata

from vllm_pcp.manager import GQAPCPManager
from vllm_pcp.pcp.agreement import SampledTokenCheck
from vllm_pcp.pcp.memory import split_step_reserve_bytes

logger = init_logger("vllm.vllm_pcp.runner")


class PCPStepAttnKwargs(ModelSpecificAttnMetadata):
    """Hands a step's split to vllm-pcp's builders (``pcp_step``), no one else."""

    def __init__(self, step):
        self.step = step

    def get_extra_attn_kwargs(self, attn_metadata_builder, num_reqs: int) -> dict:
        from vllm_pcp.backend import PCPFlashInferMetadataBuilder

        if isinstance(attn_metadata_builder, PCPFlashInferMetadataBuilder):
            return {"pcp_step": self.step}
        return {}


class PCPModelState(DefaultModelState):
    """vLLM's decoder-only model state, building attention metadata with the step's split."""

    def prepare_attn(self, input_batch, *args, **kwargs):
        step = getattr(input_batch.pcp, "step", None)
        if step is not None and kwargs.get("model_specific_attn_metadata") is None:
            kwargs["model_specific_attn_metadata"] = PCPStepAttnKwargs(step)
        return super().prepare_attn(input_batch, *args, **kwargs)


class PCPModelRunner(GPUModelRunner):
    """Selected by :class:`vllm_pcp.worker.PCPWorker` when ``-pcp`` > 1."""

    def __init__(self, vllm_config, device: torch.device):
        super().__init__(vllm_config, device)
        from vllm.distributed.parallel_state import get_dcp_group, get_pcp_group

        if self.dcp_size > 1 and get_dcp_group().ranks != get_pcp_group().ranks:
            raise RuntimeError(f"DCP group {get_dcp_group().ranks} differs from PCP group "
                               f"{get_pcp_group().ranks}: vllm-pcp shards the KV cache over "
                               "the PCP ranks only (-dcp equal to -pcp)")
        self.pcp_sampled_tokens = SampledTokenCheck.from_env(get_pcp_group())

    @property
    def pcp_manager_cls(self) -> type[GQAPCPManager]:
        return GQAPCPManager

    def load_model(self, *args, **kwargs) -> None:
        super().load_model(*args, **kwargs)
        if type(self.model_state) is not DefaultModelState:
            from vllm_pcp.config import PCPConfigError

            raise PCPConfigError(
                f"vllm-pcp runs decoder-only attention models; this model's state is "
                f"{type(self.model_state).__name__}: drop --prefill-context-parallel-size")
        self.model_state = PCPModelState(self.vllm_config, self.model, self.encoder_cache,
                                         self.device)

    def profile_run(self, *args, **kwargs) -> None:
        """vLLM's profile run with the widest split step's buffers held beside it;
        ``pcp_profile_peak_bytes``: its peak of torch allocations above the start."""
        reserve = split_step_reserve_bytes(self.vllm_config)
        logger.info("vllm-pcp: %.3f GiB held through the profile run for split steps",
                    reserve / (1 << 30))
        torch.cuda.reset_peak_memory_stats(self.device)
        before = torch.cuda.memory_allocated(self.device)
        held = torch.empty(reserve, dtype=torch.uint8, device=self.device)
        try:
            super().profile_run(*args, **kwargs)
        finally:
            del held
        self.pcp_profile_peak_bytes = torch.cuda.max_memory_allocated(self.device) - before

    def sample(self, *args, **kwargs):
        """vLLM's sampling; in check mode the ids are compared across the PCP ranks."""
        out = super().sample(*args, **kwargs)
        if out[0] is not None:
            self.pcp_sampled_tokens.check(out[0].sampled_token_ids)
        return out
