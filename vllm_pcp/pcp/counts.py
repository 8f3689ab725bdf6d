"""What a rank's steps looked like: evidence for logs and engine checks."""
from __future__ import annotations

from dataclasses import dataclass

from vllm.logger import init_logger

logger = init_logger("vllm.vllm_pcp.pcp.counts")


@dataclass
class PCPStepCounts:
    """This rank's steps so far, for logs and tests (``LLM.collective_rpc(
    "pcp_step_counts")``: one dict per rank).

    steps : steps the manager partitioned.
    split_steps : steps with a split request.
    fresh_split_steps : split steps without cached context (fresh prompts): at DCP = 1
        with ``pcp_split_attention`` ``auto`` their rows attend with FlashInfer's ragged
        kernel (:mod:`vllm_pcp.pcp.ragged`) where the layers allow it.
    gathered_steps : steps whose layers all-gathered the K/V (split steps, and every
        step under the ``shard`` decode policy).
    steps_without_local_tokens : steps in which this rank had no token (``shard``: fewer
        decodes than ranks); it ran one empty row and joined every collective.
    """

    steps: int = 0
    split_steps: int = 0
    fresh_split_steps: int = 0
    gathered_steps: int = 0
    steps_without_local_tokens: int = 0

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
