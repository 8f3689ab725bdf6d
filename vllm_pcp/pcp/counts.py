"""What a rank's steps looked like: evidence for logs and engine checks."""
from __future__ import annotations

from dataclasses import dataclass

from vllm.logger import init_logger

logger = init_logger("vllm.vllm_pcp.pcp.counts")


@dataclass
class PCPStepCounts:
    """This rank's steps so far (``LLM.collective_rpc("pcp_step_counts")``)."""

    steps: int = 0  # steps the manager partitioned
    split_steps: int = 0
    fresh_split_steps: int = 0  # without cached context (the ragged kernel's, DCP = 1)
    gathered_steps: int = 0  # the K/V all-gathered: split steps, every step under shard
    steps_without_local_tokens: int = 0  # one empty row run, every collective joined

    def count(self, step) -> None:
        """Count one :class:`vllm_pcp.manager.PCPStep`."""
        plan = step.plan
        self.steps += 1
        self.split_steps += plan.is_split
        self.fresh_split_steps += plan.is_split and step.is_fresh
        self.gathered_steps += step.gathered
        if plan.num_local_tokens == 0:
            self.steps_without_local_tokens += 1
            logger.debug("PCP step without local tokens: %s tokens per rank",
                         plan.num_tokens_per_rank)
