"""The ragged kernel of fresh split steps at DCP = 1 (:mod:`vllm_pcp.pcp.ragged`) on the
CPU: the key rows it names, the layer that gathers, writes and attends with it (FlashInfer
replaced by the reference kernels), and where the plugin's builder chooses it."""
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from vllm.v1.attention.backends.flashinfer import FlashInferImpl, FlashInferMetadataBuilder

import fake_flashinfer
from helpers import pcp_settings, pcp_step
from vllm_pcp.config import PCPConfigError
from vllm_pcp.knobs import PCPKnobs
from vllm_pcp.pcp.partition import build_pcp_metadata
from vllm_pcp.pcp.ragged import ragged_kv_rows

# fresh prompts: long ones split, short ones computed whole on every rank
FRESH = [37, 2, 100, 16, 5]


@pytest.fixture
def float32_flashinfer(monkeypatch):
    fake_flashinfer.install(monkeypatch, float32=True)
    monkeypatch.setattr(FlashInferImpl, "do_kv_cache_update", fake_flashinfer.torch_cache_write)


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
    from vllm_pcp.manager import PCPStep

    def fresh(computed):
        computed = np.asarray(computed, dtype=np.int64)
        return PCPStep((), 0, computed, np.ones_like(computed), True).is_fresh

    assert fresh([0, 0, 0]) and fresh([0])
    assert not fresh([0, 5]) and not fresh([])


@pytest.mark.parametrize("world,scheduled,kv_layout", [
    (2, FRESH, "NHD"), (3, FRESH, "HND"), (4, [64, 9], "NHD"), (8, [200, 1, 33], "HND")])
def test_the_ragged_layer_matches_one_process(float32_flashinfer, monkeypatch, world,
                                              scheduled, kv_layout):
    """The plugin's layer on a fresh split step (``tests/split_harness.py``): each rank's
    restored output is one process's causal attention, and every rank's cache holds
    every token of the step."""
    from split_harness import run_ragged_split_step
    from vllm_pcp.backend import PCPRaggedMetadata

    results, expect = run_ragged_split_step(monkeypatch, world, scheduled, "cpu",
                                            torch.float32, hq=8, hkv=2, dim=16,
                                            kv_layout=kv_layout)
    for rank, result in enumerate(results):
        assert isinstance(result.metadata, PCPRaggedMetadata)
        assert result.plan.is_split and result.plan.num_local_tokens > 0
        torch.testing.assert_close(result.restored, expect, atol=1e-5, rtol=1e-5)
        assert result.cache_written, rank


def test_a_rank_without_rows_plans_no_ragged_kernel(float32_flashinfer, monkeypatch):
    """The ragged plan of a rank without local rows (the builder gives such a rank
    ``PCPEmptyMetadata`` before it gets here) plans no kernel and attends nothing."""
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
    assert PCPKnobs.from_additional_config({"pcp_split_attention": None}).split_attention \
        == "auto"  # null: the default
    assert PCPKnobs.from_additional_config(
        {"pcp_split_attention": "paged"}).split_attention == "paged"
    for bad in ("ragged", 1):
        with pytest.raises(PCPConfigError, match="pcp_split_attention"):
            PCPKnobs.from_additional_config({"pcp_split_attention": bad})


def _builder(split_attention="auto", **settings):
    """The plugin's builder of a ``-pcp 2`` group (the fields its ragged choice reads)."""
    from vllm_pcp.backend import PCPFlashInferMetadataBuilder

    builder = object.__new__(PCPFlashInferMetadataBuilder)
    values = dict(cache_dtype="auto", window_left=-1, logits_soft_cap=None, has_sinks=False,
                  global_hyperparameters=SimpleNamespace(has_same_all_params=True),
                  pcp_world_size=2, pcp_dcp=False,
                  pcp_settings=pcp_settings(2, split_attention=split_attention))
    values.update(settings)
    builder.__dict__.update(values)
    return builder


def test_groups_whose_settings_the_ragged_plan_does_not_carry_stay_paged():
    assert _builder().can_attend_ragged()
    assert not _builder(split_attention="paged").can_attend_ragged()
    assert not _builder(cache_dtype="fp8").can_attend_ragged()
    assert not _builder(window_left=4095).can_attend_ragged()
    assert not _builder(logits_soft_cap=30.0).can_attend_ragged()
    assert not _builder(has_sinks=True).can_attend_ragged()
    assert not _builder(global_hyperparameters=SimpleNamespace(
        has_same_all_params=False)).can_attend_ragged()


@pytest.mark.parametrize("computed,scheduled,knob,ragged", [
    ([0, 0, 0, 0], [40, 37, 2, 9], "auto", True),
    ([0, 0, 0, 0], [40, 37, 2, 9], "paged", False),  # the knob keeps the paged kernel
    ([30, 0, 0, 12], [1, 37, 2, 9], "auto", False),  # a decode and a continuation: context
    ([0, 0], [3, 5], "auto", False),  # fresh, but nothing split: no K/V exchange
])
def test_the_builder_plans_the_ragged_kernel_on_fresh_split_steps(monkeypatch, computed,
                                                                  scheduled, knob, ragged):
    """The builder takes FlashInfer's ragged kernel on a step that splits fresh prompts
    (with the knob ``auto`` and layers it can plan), vLLM's own plan on any other."""
    from vllm_pcp.backend import PCPEmptyMetadata, PCPRaggedMetadata

    monkeypatch.setattr(FlashInferMetadataBuilder, "build",
                        lambda self, prefix, cm, fast_build=False: "vLLM's plan")
    builder, planned = _builder(knob), []
    builder._plan_ragged = lambda step: planned.append(step) or "ragged"
    step = pcp_step(computed, scheduled, 2, 1, min_split_tokens=8)
    cm = SimpleNamespace(num_actual_tokens=step.plan.num_local_tokens, slot_mapping="slots")
    metadata = builder.build(0, cm, pcp_step=step)
    if ragged:
        assert isinstance(metadata, PCPRaggedMetadata) and planned == [step]
        assert (metadata.slot_mapping, metadata.ragged) == ("slots", "ragged")
    else:
        assert metadata == "vLLM's plan" and not planned
    assert builder.build(0, cm) == "vLLM's plan"  # dummy and capture runs: no step
    empty = builder.build(0, SimpleNamespace(num_actual_tokens=0, slot_mapping="slots"),
                          pcp_step=step)
    assert isinstance(empty, PCPEmptyMetadata) and empty.slot_mapping == "slots"
