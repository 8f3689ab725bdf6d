"""vLLM's GPU worker, building vllm-pcp's model runner for ``-pcp`` > 1."""
from __future__ import annotations

from dataclasses import asdict

import torch
from vllm.v1.worker.gpu_worker import Worker

from vllm_pcp.pcp.memory import split_step_reserve_bytes


class PCPWorker(Worker):
    """Selected by :func:`vllm_pcp.config.prepare_pcp_config` for ``-pcp`` > 1."""

    def _make_model_runner(self):
        if not self.use_v2_model_runner:
            raise RuntimeError("vllm-pcp runs on vLLM's Model Runner V2: unset "
                               "VLLM_USE_V2_MODEL_RUNNER")
        from vllm_pcp.runner import PCPModelRunner

        return PCPModelRunner(self.vllm_config, self.device)

    def pcp_step_counts(self) -> dict[str, int]:
        """This rank's :class:`vllm_pcp.pcp.counts.PCPStepCounts` (``collective_rpc``)."""
        return asdict(self.model_runner.pcp_manager.step_counts)

    def pcp_sampled_token_checks(self) -> int:
        """Steps whose sampled ids this rank compared (:mod:`vllm_pcp.pcp.agreement`)."""
        return self.model_runner.pcp_sampled_tokens.checked

    def pcp_memory(self, reset: bool = False) -> dict[str, int | None]:
        """This rank's torch allocations now and at peak (then reset with ``reset``), the
        profile run's peak and the split-step reserve (``collective_rpc``)."""
        out = {"allocated_bytes": torch.cuda.memory_allocated(self.device),
               "peak_allocated_bytes": torch.cuda.max_memory_allocated(self.device),
               "profile_peak_bytes": getattr(self.model_runner, "pcp_profile_peak_bytes",
                                             None),
               "split_step_reserve_bytes": split_step_reserve_bytes(self.vllm_config)}
        if reset:
            torch.cuda.reset_peak_memory_stats(self.device)
        return out
