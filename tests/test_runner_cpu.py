"""The worker and model runner around vLLM's Model Runner V2 on the CPU (vLLM's own
runner stubbed out): the PCP manager they select, the step they hand to the plugin's
attention builders and to no other, the model states they run, the groups they accept."""
from types import SimpleNamespace

import pytest
import torch
import vllm.distributed.parallel_state as parallel_state
from vllm.v1.worker.gpu.model_states.default import DefaultModelState

from vllm_pcp.backend import PCPFlashInferMetadataBuilder
from vllm_pcp.config import PCPConfigError
from vllm_pcp.manager import GQAPCPManager
from vllm_pcp.runner import GPUModelRunner, PCPModelRunner, PCPModelState, PCPStepAttnKwargs
from vllm_pcp.worker import PCPWorker


def test_the_runner_builds_the_plugins_pcp_manager():
    """vLLM's runner builds ``self.pcp_manager_cls`` (``maybe_build_pcp_manager``)."""
    assert object.__new__(PCPModelRunner).pcp_manager_cls is GQAPCPManager


def test_the_step_reaches_the_plugins_builders_only():
    step = object()
    extra = PCPStepAttnKwargs(step)
    plugin = object.__new__(PCPFlashInferMetadataBuilder)
    assert extra.get_extra_attn_kwargs(plugin, num_reqs=3) == {"pcp_step": step}
    assert extra.get_extra_attn_kwargs(object(), num_reqs=3) == {}  # another backend's


def test_the_model_state_hands_each_step_to_the_attention(monkeypatch):
    """A PCP step's local batch carries its split (``input_batch.pcp.step``): vLLM's
    ``prepare_attn`` gets it as model-specific attention metadata; dummy and capture
    batches (no step) and metadata a caller gives are passed through unchanged."""
    seen = []
    monkeypatch.setattr(DefaultModelState, "prepare_attn",
                        lambda self, batch, *args, **kwargs: seen.append((args, kwargs)))
    state, step = object.__new__(PCPModelState), object()
    state.prepare_attn(SimpleNamespace(pcp=SimpleNamespace(step=step)), "mode", "tables")
    (args, kwargs), = seen
    assert args == ("mode", "tables")
    assert isinstance(kwargs["model_specific_attn_metadata"], PCPStepAttnKwargs)
    assert kwargs["model_specific_attn_metadata"].step is step
    for batch in (SimpleNamespace(pcp=None), SimpleNamespace(pcp=SimpleNamespace(step=None))):
        state.prepare_attn(batch, "mode")
        assert seen[-1] == (("mode",), {})
    given = object()
    state.prepare_attn(SimpleNamespace(pcp=SimpleNamespace(step=step)), "mode",
                       model_specific_attn_metadata=given)
    assert seen[-1][1] == {"model_specific_attn_metadata": given}


def _runner(monkeypatch, dcp=1, dcp_ranks=(0, 1), pcp_ranks=(0, 1)):
    """A PCPModelRunner built through its ``__init__`` (vLLM's stubbed out)."""
    monkeypatch.setattr(GPUModelRunner, "__init__",
                        lambda self, vllm_config, device: setattr(self, "dcp_size", dcp))
    monkeypatch.setattr(parallel_state, "get_pcp_group", lambda: SimpleNamespace(
        ranks=list(pcp_ranks), world_size=len(pcp_ranks)))
    monkeypatch.setattr(parallel_state, "get_dcp_group", lambda: SimpleNamespace(
        ranks=list(dcp_ranks), world_size=len(dcp_ranks)))
    return PCPModelRunner(SimpleNamespace(), torch.device("cpu"))


def test_dcp_must_span_the_pcp_ranks(monkeypatch):
    """-tp 2 -pcp 2 -dcp 2 would put DCP inside TP: the plugin shards the KV cache over
    the PCP ranks only."""
    assert _runner(monkeypatch, dcp=2).pcp_sampled_tokens.group.ranks == [0, 1]
    assert _runner(monkeypatch, dcp=1, dcp_ranks=(0, 2)) is not None  # DCP unused
    with pytest.raises(RuntimeError, match=r"DCP group \[0, 2\] differs from PCP group "
                       r"\[0, 1\]: vllm-pcp shards the KV cache over the PCP ranks only"):
        _runner(monkeypatch, dcp=2, dcp_ranks=(0, 2))


def test_the_model_state_is_the_plugins_for_decoder_only_models(monkeypatch):
    """After vLLM loads the model, its decoder-only model state is replaced by the
    plugin's; any other model state (encoder-only, Mamba hybrids) is refused."""
    made = []
    monkeypatch.setattr(GPUModelRunner, "load_model", lambda self, *a, **k: None)
    monkeypatch.setattr(PCPModelState, "__init__",
                        lambda self, *args: made.append(args))
    runner = object.__new__(PCPModelRunner)
    runner.__dict__.update(vllm_config="config", model="model", encoder_cache=None,
                           device="cpu", model_state=object.__new__(DefaultModelState))
    runner.load_model()
    assert isinstance(runner.model_state, PCPModelState)
    assert made == [("config", "model", None, "cpu")]

    class OtherState(DefaultModelState):
        pass

    runner.model_state = object.__new__(OtherState)
    with pytest.raises(PCPConfigError, match="this model's state is OtherState: drop "
                       "--prefill-context-parallel-size"):
        runner.load_model()


def test_the_worker_makes_the_plugins_runner_on_model_runner_v2(monkeypatch):
    made = []
    monkeypatch.setattr(PCPModelRunner, "__init__",
                        lambda self, config, device: made.append((config, device)))
    worker = object.__new__(PCPWorker)
    worker.__dict__.update(vllm_config="config", device="cpu", use_v2_model_runner=True)
    assert isinstance(worker._make_model_runner(), PCPModelRunner)
    assert made == [("config", "cpu")]
    worker.use_v2_model_runner = False
    with pytest.raises(RuntimeError, match="Model Runner V2: unset VLLM_USE_V2_MODEL_RUNNER"):
        worker._make_model_runner()


def test_the_worker_reports_its_step_counts_and_checks():
    from vllm_pcp.pcp.counts import PCPStepCounts

    worker = object.__new__(PCPWorker)
    counts = PCPStepCounts(steps=3, split_steps=1, gathered_steps=2)
    worker.model_runner = SimpleNamespace(pcp_manager=SimpleNamespace(step_counts=counts),
                                          pcp_sampled_tokens=SimpleNamespace(checked=4))
    assert worker.pcp_step_counts() == dict(steps=3, split_steps=1, fresh_split_steps=0,
                                            gathered_steps=2, steps_without_local_tokens=0)
    assert worker.pcp_sampled_token_checks() == 4
