"""The check mode VLLM_PCP_CHECK_SAMPLED_TOKENS (vllm_pcp.pcp.agreement), on the CPU:
the comparison of gathered ids, and the runner's ``sample`` (vLLM's Model Runner V2's,
with the check after it) driven for the ranks of a thread group, vLLM's own runner
stubbed out."""
from types import SimpleNamespace

import pytest
import torch
import vllm.distributed.parallel_state as parallel_state
from vllm.v1.outputs import SamplerOutput

from helpers import ThreadGroup
from vllm_pcp.pcp.agreement import CHECK_ENV, SampledTokenCheck, check_enabled, differing_ranks
from vllm_pcp.runner import GPUModelRunner, PCPModelRunner
from vllm_pcp.worker import PCPWorker


def test_differing_ranks_compares_every_rank_with_rank_0():
    ids = torch.tensor([[5], [7], [9]], dtype=torch.int32)
    agree = torch.cat([ids] * 4)
    assert differing_ranks(agree, 4) == []
    other = ids.clone()
    other[1] = 8
    assert differing_ranks(torch.cat([ids, ids, other, ids]), 4) == [2]
    assert differing_ranks(torch.cat([ids, other, other, ids]), 4) == [1, 2]
    assert differing_ranks(torch.cat([other, ids, ids, ids]), 4) == [1, 2, 3]
    assert differing_ranks(ids, 1) == []


@pytest.mark.parametrize("value,on", [(None, False), ("", False), ("0", False),
                                      ("1", True), ("true", True), ("YES", True)])
def test_the_environment_variable(value, on):
    assert check_enabled({} if value is None else {CHECK_ENV: value}) is on


def _runners(monkeypatch, group, env):
    """One PCPModelRunner per rank of ``group``, built through its ``__init__`` (vLLM's
    own stubbed out: no DCP) with VLLM_PCP_CHECK_SAMPLED_TOKENS set to ``env``."""
    if env is None:
        monkeypatch.delenv(CHECK_ENV, raising=False)
    else:
        monkeypatch.setenv(CHECK_ENV, env)
    monkeypatch.setattr(GPUModelRunner, "__init__",
                        lambda self, vllm_config, device: setattr(self, "dcp_size", 1))
    runners = []
    for rank in range(group.world_size):
        monkeypatch.setattr(parallel_state, "get_pcp_group", lambda r=rank: group.rank(r))
        runner = PCPModelRunner(SimpleNamespace(), torch.device("cpu"))
        runner.pcp_rank = rank
        runners.append(runner)
    return runners


def _sampler(ids_of):
    """vLLM's ``sample`` stand-in: rank r's sampled ids of the step ``ids_of(r, step)``,
    as vLLM returns them (the sampler's output, sampled and rejected counts)."""
    def sample(self, hidden_states, input_batch, grammar_output):
        self.steps = getattr(self, "steps", 0) + 1
        ids = ids_of(self.pcp_rank, self.steps)
        return (SamplerOutput(sampled_token_ids=ids, logprobs_tensors=None),
                torch.ones(len(ids), dtype=torch.int32), None)
    return sample


def test_a_rank_that_samples_other_tokens_stops_the_step(monkeypatch):
    """Two steps agree, then rank 2 of 3 samples another token for one request: every
    rank raises at step 3, naming rank 2; the steps checked are counted."""
    group = ThreadGroup(3)
    runners = _runners(monkeypatch, group, "1")

    def ids_of(rank, step):
        ids = torch.tensor([[11 * step], [3], [4]], dtype=torch.int32)
        if step == 3 and rank == 2:
            ids[1] = 99
        return ids

    monkeypatch.setattr(GPUModelRunner, "sample", _sampler(ids_of))

    def rank_fn(rank):
        runner = runners[rank]
        for step in (1, 2):
            out, num_sampled, _ = runner.sample(torch.zeros(3, 8), "batch", None)
            assert out.sampled_token_ids[0, 0] == 11 * step and num_sampled.tolist() == [1] * 3
        with pytest.raises(RuntimeError) as err:
            runner.sample(torch.zeros(3, 8), "batch", None)
        return str(err.value), runner

    results = group.run(rank_fn)
    for message, runner in results:
        assert message.startswith(f"{CHECK_ENV}: step 3: the sampled token ids of PCP "
                                  "ranks [2] differ from rank 0's")
        worker = object.__new__(PCPWorker)
        worker.model_runner = runner
        assert worker.pcp_sampled_token_checks() == 3


class _MismatchingGroup:
    """A 2-rank group whose all-gather returns this rank's ids and a changed copy."""

    world_size, rank_in_group = 2, 0

    def __init__(self):
        self.calls = 0

    def all_gather(self, x, dim=0):
        self.calls += 1
        return torch.cat([x, x + 1], dim=dim)


@pytest.mark.parametrize("env", [None, "0"])
def test_off_by_default_no_collective_runs(monkeypatch, env):
    group = _MismatchingGroup()
    monkeypatch.setattr(GPUModelRunner, "sample", _sampler(
        lambda rank, step: torch.tensor([[1], [2]], dtype=torch.int32)))
    [runner] = _runners_with(monkeypatch, group, env)
    for _ in range(3):
        runner.sample(torch.zeros(2, 8), "batch", None)
    assert group.calls == 0 and runner.pcp_sampled_tokens.checked == 0


def test_on_a_mismatching_gather_raises_with_step_and_ranks(monkeypatch):
    group = _MismatchingGroup()
    monkeypatch.setattr(GPUModelRunner, "sample", _sampler(
        lambda rank, step: torch.tensor([[1], [2]], dtype=torch.int32)))
    [runner] = _runners_with(monkeypatch, group, "1")
    with pytest.raises(RuntimeError, match=r"step 1: the sampled token ids of PCP ranks "
                       r"\[1\] differ from rank 0's"):
        runner.sample(torch.zeros(2, 8), "batch", None)
    assert group.calls == 1


def _runners_with(monkeypatch, group, env):
    """The runner of rank 0 of ``group`` (any object with ``all_gather``)."""
    view = SimpleNamespace(world_size=1, rank=lambda r: group)
    return _runners(monkeypatch, view, env)


def test_the_check_reads_the_environment_once(monkeypatch):
    monkeypatch.setenv(CHECK_ENV, "1")
    check = SampledTokenCheck.from_env(_MismatchingGroup())
    monkeypatch.setenv(CHECK_ENV, "0")
    assert check.enabled
