"""The ragged kernel of fresh split steps at DCP = 1 (:mod:`vllm_pcp.pcp.ragged`) on the
CPU: the key rows it names, the layer that gathers, writes and attends with it (FlashInfer
replaced by the reference kernels), and where the runner chooses it."""
import sys
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from vllm.v1.attention.backends.flashinfer import FlashInferImpl
from vllm.v1.worker.gpu_model_runner import GPUModelRunner

from helpers import ThreadGroup
from test_dcp_attention_cpu import SIXTEEN_BIT, _fake_flashinfer, _torch_cache_write
from vllm_pcp.config import PCPConfigError
from vllm_pcp.knobs import PCPKnobs
from vllm_pcp.pcp.partition import build_pcp_metadata
from vllm_pcp.pcp.ragged import is_fresh_step, ragged_kv_rows

# fresh prompts: long ones split, short ones computed whole on every rank
FRESH = [37, 2, 100, 16, 5]


@pytest.fixture
def float32_flashinfer(monkeypatch):
    monkeypatch.setitem(sys.modules, "flashinfer",
                        _fake_flashinfer((*SIXTEEN_BIT, torch.float32)))
    monkeypatch.setattr(FlashInferImpl, "do_kv_cache_update", _torch_cache_write)


@pytest.mark.parametrize("world", [2, 3, 4, 8])
@pytest.mark.parametrize("min_split", [2, 16])
def test_each_row_reads_its_prompt_up_to_the_row_end(world, min_split):
    """Row j of request q reads q's tokens ``0 .. seq_lens[j]`` in position order, named
    as rows of the gathered buffer (the buffer filled with each row's global token)."""
    start = np.cumsum(FRESH) - FRESH
    for rank in range(world):
        plan = build_pcp_metadata([0] * len(FRESH), FRESH, world, rank,
                                  min_split_tokens=min_split)
        kv_rows, kv_indptr = ragged_kv_rows(plan, FRESH)
        tokens = plan.gathered_token_indices[kv_rows]  # what each named row holds
        assert len(kv_indptr) == plan.num_rows + 1 and int(kv_indptr[-1]) == len(kv_rows)
        for j, (req, seq_len) in enumerate(zip(plan.row_req_indices.tolist(),
                                                plan.seq_lens.tolist())):
            row = tokens[int(kv_indptr[j]):int(kv_indptr[j + 1])]
            assert row.tolist() == list(range(start[req], start[req] + seq_len)), (rank, j)


def test_fresh_steps():
    assert is_fresh_step([0, 0, 0]) and is_fresh_step(np.zeros(1, np.int32))
    assert not is_fresh_step([0, 5]) and not is_fresh_step([])


@pytest.mark.parametrize("world,scheduled", [(2, FRESH), (3, FRESH), (4, [64, 9]),
                                             (8, [200, 1, 33]), (3, [2]), (8, [5])])
def test_the_ragged_layer_matches_one_process(float32_flashinfer, monkeypatch, world,
                                              scheduled):
    """The plugin's layer on a fresh split step (``tests/split_harness.py``): each rank's
    restored output is one process's causal attention, and every rank's cache holds
    every token of the step. A 2-token prompt over 3 ranks and a 5-token one over 8
    leave ranks without tokens (the runner never splits chunks that short)."""
    from split_harness import run_ragged_split_step

    results, expect = run_ragged_split_step(monkeypatch, world, scheduled, "cpu",
                                            torch.float32, hq=8, hkv=2, dim=16)
    for rank, result in enumerate(results):
        torch.testing.assert_close(result.restored, expect, atol=1e-5, rtol=1e-5)
        assert result.cache_written, rank


def test_a_rank_without_rows_still_gathers_and_writes(float32_flashinfer, monkeypatch):
    """A 2-token prompt kept whole (below the split threshold) beside nothing else has
    no split: the runner never plans it. A rank without local rows plans no kernel,
    writes zeros, and still joins the exchange."""
    from vllm_pcp.pcp.ragged import RaggedSplitAttention

    plan = SimpleNamespace(num_rows=0, num_local_tokens=0)
    attention = object.__new__(RaggedSplitAttention)
    attention._wrapper = SimpleNamespace(plan=lambda *a, **k: 1 / 0)
    step = attention.plan(plan, [2], torch.device("cpu"))
    assert step.kv_rows is None and step.num_local_tokens == 0
    out = torch.full((0, 2, 4), 1.0)
    step.run(out, torch.zeros(4, 1, 4), torch.zeros(4, 1, 4), out)  # attends nothing


def test_the_knob():
    assert PCPKnobs.from_additional_config({}).split_attention == "auto"
    assert PCPKnobs.from_additional_config(
        {"pcp_split_attention": "paged"}).split_attention == "paged"
    for bad in ("ragged", None, 1):
        with pytest.raises(PCPConfigError, match="pcp_split_attention"):
            PCPKnobs.from_additional_config({"pcp_split_attention": bad})


def _builder(**settings):
    from vllm_pcp.backend import PCPFlashInferMetadataBuilder

    builder = object.__new__(PCPFlashInferMetadataBuilder)
    values = dict(cache_dtype="auto", window_left=-1, logits_soft_cap=None, has_sinks=False,
                  global_hyperparameters=SimpleNamespace(has_same_all_params=True))
    values.update(settings)
    builder.__dict__.update(values)
    return builder


def test_groups_whose_settings_the_ragged_plan_does_not_carry_stay_paged():
    assert _builder().can_attend_ragged()
    assert not _builder(cache_dtype="fp8").can_attend_ragged()
    assert not _builder(window_left=4095).can_attend_ragged()
    assert not _builder(logits_soft_cap=30.0).can_attend_ragged()
    assert not _builder(has_sinks=True).can_attend_ragged()
    assert not _builder(global_hyperparameters=SimpleNamespace(
        has_same_all_params=False)).can_attend_ragged()


@pytest.mark.parametrize("computed,knob,ragged_ok,ragged", [
    ([0, 0, 0, 0], "auto", True, True),
    ([0, 0, 0, 0], "paged", True, False),  # the knob keeps the paged kernel
    ([0, 0, 0, 0], "auto", False, False),  # a group whose settings the plan lacks
    ([30, 0, 0, 12], "auto", True, False),  # decodes and a continuation: context
])
def test_the_runner_plans_the_ragged_kernel_on_fresh_steps(monkeypatch, computed, knob,
                                                           ragged_ok, ragged):
    from test_runner_cpu import _make_runner

    runner = _make_runner(ThreadGroup(2), 1)
    runner.pcp_split_attention = knob
    runner.input_batch.num_computed_tokens_cpu = np.array(computed, np.int32)
    runner.input_batch.num_prompt_tokens = np.array([40, 37, 2, 21], np.int32)
    builder = runner.attn_groups[0][0].get_metadata_builder(0)
    planned = []
    builder.can_attend_ragged = lambda: ragged_ok
    builder.build_ragged = lambda plan, scheduled: planned.append(
        (plan, list(scheduled))) or SimpleNamespace(num_local_tokens=plan.num_local_tokens)
    monkeypatch.setattr(GPUModelRunner, "_prepare_inputs", lambda self, so, n: ("idx", None))
    scheduled = [40, 37, 2, 9] if not any(computed) else [1, 37, 2, 9]
    runner.positions = torch.cat([c + torch.arange(s) for c, s in zip(computed, scheduled)])
    runner._prepare_inputs(None, np.array(scheduled, np.int32))
    plan = runner._step.plan
    slots = torch.arange(sum(scheduled), dtype=torch.int64) * 3 + 5
    metadata, _ = runner._build_attention_metadata(slot_mappings={0: slots})
    split = metadata["l0"]
    assert metadata["l1"] is split
    if ragged:
        assert split.local is None and planned == [(plan, scheduled)]
        assert split.num_actual_tokens == plan.num_local_tokens
    else:
        assert split.ragged is None and split.local is not None and not planned
    assert runner.pcp_step_counts.ragged_steps == int(ragged)
