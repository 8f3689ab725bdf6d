"""What a rank's split steps looked like: evidence for logs and engine checks."""
from __future__ import annotations

from dataclasses import dataclass

from vllm.logger import init_logger

from vllm_pcp.pcp.partition import PrefillContextParallelMetadata

logger = init_logger("vllm.vllm_pcp.pcp.counts")


@dataclass
class PCPStepCounts:
    """What the split steps of this rank's engine looked like so far, for logs and
    tests (``LLM.collective_rpc("pcp_step_counts")``: one dict per rank).

    split_steps : steps with a split request (DCP: steps with a PCP plan, i.e. not
        pure decode steps).
    steps_with_rank_without_tokens : split steps in which some rank got no local
        tokens (under DCP, a split chunk shorter than ``2 * pcp_world_size``; a
        whole-cache split computes such a chunk whole): that rank runs ``P`` pad rows
        and still takes part in every collective.
    steps_without_local_tokens : split steps in which this rank got none.
    ragged_steps : split steps at DCP = 1 whose rows attended with FlashInfer's
        ragged kernel (fresh steps, :mod:`vllm_pcp.pcp.ragged`).
    """

    split_steps: int = 0
    steps_with_rank_without_tokens: int = 0
    steps_without_local_tokens: int = 0
    ragged_steps: int = 0

    def count(self, plan: PrefillContextParallelMetadata | None) -> None:
        if plan is None:
            return
        self.split_steps += 1
        if min(plan.num_tokens_per_rank) == 0:
            self.steps_with_rank_without_tokens += 1
            logger.debug("PCP split step with ranks without tokens: %s tokens per rank",
                         plan.num_tokens_per_rank)
        self.steps_without_local_tokens += plan.num_local_tokens == 0
