"""Check mode: every PCP rank samples the same tokens.

Each PCP rank samples from its own logits and, with async scheduling, feeds its tokens
into its next step; under ``-tp T -pcp N`` each TP group computes unsplit steps on its own,
so the ranks stay in step only while their logits are bitwise identical.
``VLLM_PCP_CHECK_SAMPLED_TOKENS=1`` (read when the runner is built) all-gathers each step's
sampled ids over the PCP group and stops the engine at the first step whose ranks differ:
one small all-gather and one host sync a step; off (the default), nothing runs.
"""
from __future__ import annotations

import os

import torch
from vllm.logger import init_logger

logger = init_logger("vllm.vllm_pcp.pcp.agreement")

CHECK_ENV = "VLLM_PCP_CHECK_SAMPLED_TOKENS"


def check_enabled(environ=os.environ) -> bool:
    """Whether :data:`CHECK_ENV` turns the check on (``1``, ``true``, ``yes``)."""
    return environ.get(CHECK_ENV, "").strip().lower() in ("1", "true", "yes")


def differing_ranks(gathered: torch.Tensor, world_size: int) -> list[int]:
    """Ranks ``r >= 1`` (ascending) whose block of ``gathered`` (every rank's ids, rank
    order along dim 0) differs from rank 0's."""
    blocks = gathered.reshape(world_size, -1)
    differs = (blocks[1:] != blocks[:1]).any(dim=1)
    return [rank + 1 for rank in differs.nonzero().flatten().tolist()]


class SampledTokenCheck:
    """One rank's check. Every rank calls :meth:`check` at the same point of every step
    with ids of one shape (from the scheduler output), so the all-gather lines up;
    ``checked`` counts the steps checked."""

    def __init__(self, group, enabled: bool):
        self.group = group  # vLLM GroupCoordinator of the PCP ranks
        self.enabled = enabled
        self.checked = 0

    @classmethod
    def from_env(cls, group) -> SampledTokenCheck:
        check = cls(group, check_enabled())
        if check.enabled:
            logger.info("%s: sampled token ids compared across the %d PCP ranks every "
                        "step", CHECK_ENV, group.world_size)
        return check

    def check(self, sampled_token_ids: torch.Tensor) -> None:
        """Compare ``sampled_token_ids [R, k]`` across the ranks; RuntimeError if any differ."""
        if not self.enabled:
            return
        self.checked += 1
        gathered = self.group.all_gather(sampled_token_ids.contiguous(), dim=0)
        ranks = differing_ranks(gathered, self.group.world_size)
        if ranks:
            raise RuntimeError(
                f"{CHECK_ENV}: step {self.checked}: the sampled token ids of PCP ranks "
                f"{ranks} differ from rank 0's (the ranks' logits are not identical; "
                f"-tp with -pcp needs bitwise-identical logits on every TP group)")
