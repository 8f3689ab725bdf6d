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
        """Steps whose sampled token ids this rank compared across the PCP ranks
        (``VLLM_PCP_CHECK_SAMPLED_TOKENS``, :mod:`vllm_pcp.pcp.agreement`); 0 when off."""
        return self.model_runner.pcp_sampled_tokens.checked

    def pcp_memory(self, reset: bool = False) -> dict[str, int | None]:
        """This rank's memory (``collective_rpc``), then with ``reset`` its peak reset:
        torch allocations now and at their peak since the start or the last reset; the
        profile run's peak above what it started from, with the split-step reserve
        held (:meth:`vllm_pcp.runner.PCPModelRunner.profile_run`); the reserve."""
        out = {"allocated_bytes": torch.cuda.memory_allocated(self.device),
               "peak_allocated_bytes": torch.cuda.max_memory_allocated(self.device),
               "profile_peak_bytes": getattr(self.model_runner, "pcp_profile_peak_bytes",
                                             None),
               "split_step_reserve_bytes": split_step_reserve_bytes(self.vllm_config)}
        if reset:
            torch.cuda.reset_peak_memory_stats(self.device)
        return out
