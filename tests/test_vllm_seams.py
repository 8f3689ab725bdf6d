"""vLLM 0.26.0 symbols that vllm-pcp patches or overrides still have the shape it relies on.

Each test fails if an upgrade of vLLM changes the symbol, so the patch or
override is revisited instead of silently misbehaving.
"""
import ast
import dataclasses
import importlib.util
import inspect

import pytest
import vllm
from vllm.forward_context import ForwardContext
from vllm.v1.attention.backend import CommonAttentionMetadata
from vllm.v1.attention.backends.flashinfer import FlashInferImpl, FlashInferMetadataBuilder
from vllm.v1.worker.gpu_model_runner import GPUModelRunner
from vllm.v1.worker.gpu_worker import Worker

from vllm_pcp.patches import platform_config as patch_platform_config


def _params(fn):
    return list(inspect.signature(fn).parameters)


def test_vllm_version_is_the_target():
    assert vllm.__version__ == "0.26.0"


def _cuda_platform_method():
    """The AST of CudaPlatformBase.check_and_update_config, read without importing
    vllm.platforms.cuda (that import needs libcuda)."""
    path = importlib.util.find_spec("vllm.platforms.cuda").origin
    tree = ast.parse(open(path).read())
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef)
               and n.name == "CudaPlatformBase")
    return next(n for n in cls.body if isinstance(n, ast.FunctionDef)
                and n.name == "check_and_update_config")


def test_patched_platform_hook_has_the_0_26_shape():
    fn = _cuda_platform_method()
    assert [d.id for d in fn.decorator_list if isinstance(d, ast.Name)] == ["classmethod"]
    assert [a.arg for a in fn.args.args] == ["cls", "vllm_config"]
    source = ast.unparse(fn)
    assert "parallel_config.worker_cls == 'auto'" in source
    assert "parallel_config.worker_cls = 'vllm.v1.worker.gpu_worker.Worker'" in source


def test_wrap_runs_vllm_first_then_the_plugin_once(monkeypatch):
    calls = []

    class FakePlatform:
        @classmethod
        def check_and_update_config(cls, vllm_config):
            calls.append(("vllm", vllm_config))

    import vllm_pcp.config as config_mod

    monkeypatch.setattr(config_mod, "prepare_pcp_config", lambda c: calls.append(("pcp", c)))
    assert patch_platform_config.wrap(FakePlatform)
    assert not patch_platform_config.wrap(FakePlatform)  # idempotent
    FakePlatform.check_and_update_config("cfg")
    assert calls == [("vllm", "cfg"), ("pcp", "cfg")]


def test_apply_leaves_non_cuda_platforms_alone(monkeypatch):
    """Runs on every host: the platform is shown as non-CUDA, then as CUDA with a
    stand-in ``vllm.platforms.cuda`` (the real one needs libcuda), whose class
    ``apply`` must wrap."""
    import sys
    from types import ModuleType

    from vllm.platforms import current_platform

    monkeypatch.setattr(current_platform, "is_cuda", lambda: False)
    assert patch_platform_config.apply() is False

    class FakeCudaPlatformBase:
        @classmethod
        def check_and_update_config(cls, vllm_config):
            pass

    fake = ModuleType("vllm.platforms.cuda")
    fake.CudaPlatformBase = FakeCudaPlatformBase
    monkeypatch.setitem(sys.modules, "vllm.platforms.cuda", fake)
    monkeypatch.setattr(current_platform, "is_cuda", lambda: True)
    assert patch_platform_config.apply() is True
    assert getattr(FakeCudaPlatformBase.check_and_update_config.__func__,
                   patch_platform_config.PATCHED_ATTR)
    assert patch_platform_config.apply() is False  # idempotent


def test_runner_seams():
    assert _params(GPUModelRunner._prepare_inputs) == [
        "self", "scheduler_output", "num_scheduled_tokens"]
    build = _params(GPUModelRunner._build_attention_metadata)
    for name in ("num_tokens", "num_reqs", "max_query_len", "ubatch_slices",
                 "for_cudagraph_capture", "slot_mappings"):
        assert name in build
    assert _params(GPUModelRunner._model_forward) == [
        "self", "input_ids", "positions", "intermediate_tensors", "inputs_embeds",
        "model_kwargs"]
    assert callable(Worker.init_device)


def test_backend_seams():
    assert _params(FlashInferImpl.do_kv_cache_update) == [
        "self", "layer", "key", "value", "kv_cache", "slot_mapping"]
    assert _params(FlashInferMetadataBuilder.build) == [
        "self", "common_prefix_len", "common_attn_metadata", "fast_build"]
    fields = {f.name for f in dataclasses.fields(CommonAttentionMetadata)}
    assert {"query_start_loc", "query_start_loc_cpu", "seq_lens", "_seq_lens_cpu",
            "_num_computed_tokens_cpu", "seq_lens_cpu_upper_bound", "num_reqs",
            "num_actual_tokens", "max_query_len", "max_seq_len", "block_table_tensor",
            "slot_mapping", "causal", "positions"} <= fields
    ctx_fields = {f.name for f in dataclasses.fields(ForwardContext)}
    assert {"attn_metadata", "slot_mapping", "cudagraph_runtime_mode", "batch_descriptor",
            "is_padding"} <= ctx_fields


def test_pcp_gate_reads_the_impl_flag():
    from vllm_pcp.backend import PCPFlashInferBackend

    assert PCPFlashInferBackend.supports_pcp()
    assert PCPFlashInferBackend.get_name() == "FLASHINFER"


def test_patched_model_config_check_has_the_0_26_shape():
    from vllm.config.model import ModelConfig

    original = ModelConfig.verify_with_parallel_config
    original = getattr(original, "__wrapped__", original)
    assert _params(original) == ["self", "parallel_config"]
    source = inspect.getsource(original)
    assert "decode_context_parallel_size > 1 and not self.use_mla" in source
    assert "assert tensor_parallel_size > total_num_kv_heads" in source


def test_model_config_wrapper_hides_dcp_only_when_it_spans_pcp():
    from types import SimpleNamespace

    from vllm_pcp.patches import model_config_dcp as patch_model_config_dcp

    seen = []

    class FakeModelConfig:
        use_mla = False

        def verify_with_parallel_config(self, parallel_config):
            seen.append(parallel_config.decode_context_parallel_size)

    assert patch_model_config_dcp.wrap(FakeModelConfig)
    assert not patch_model_config_dcp.wrap(FakeModelConfig)
    for pcp, dcp in ((2, 2), (1, 2), (2, 1), (4, 2)):
        par = SimpleNamespace(prefill_context_parallel_size=pcp,
                              decode_context_parallel_size=dcp)
        FakeModelConfig().verify_with_parallel_config(par)
        assert par.decode_context_parallel_size == dcp  # restored
    assert seen == [1, 2, 1, 2]


def test_v2_model_runner_choice_has_the_0_26_shape():
    from vllm.config.vllm import VllmConfig

    original = VllmConfig._get_v2_model_runner_unsupported_features
    original = getattr(original, "__wrapped__", original)
    assert _params(original) == ["self"]
    # the property vLLM reads in every process consults the patched method
    assert "_get_v2_model_runner_unsupported_features()" in inspect.getsource(
        VllmConfig.use_v2_model_runner.fget)


def test_register_wraps_the_v2_model_runner_choice():
    from vllm.config.vllm import VllmConfig

    import vllm_pcp
    from vllm_pcp.patches import v2_model_runner as patch_v2_model_runner

    vllm_pcp.register()
    method = VllmConfig._get_v2_model_runner_unsupported_features
    assert getattr(method, patch_v2_model_runner.PATCHED_ATTR, False)


def test_v2_model_runner_is_refused_only_where_the_plugin_runs_pcp1():
    from types import SimpleNamespace

    from vllm_pcp.patches import v2_model_runner as patch_v2_model_runner

    class FakeVllmConfig:
        def __init__(self, pcp, dcp, backend, use_mla=False):
            self.parallel_config = SimpleNamespace(prefill_context_parallel_size=pcp,
                                                   decode_context_parallel_size=dcp)
            self.model_config = SimpleNamespace(use_mla=use_mla)
            self.attention_config = SimpleNamespace(
                backend=backend and SimpleNamespace(name=backend))

        def _get_v2_model_runner_unsupported_features(self):
            return ["stock"]

    assert patch_v2_model_runner.wrap(FakeVllmConfig)
    assert not patch_v2_model_runner.wrap(FakeVllmConfig)
    feature = patch_v2_model_runner.FEATURE
    cases = {(1, 2, "FLASHINFER", False): ["stock", feature],  # the plugin's DCP inside TP
             (1, 2, None, False): ["stock"],  # vLLM's own choice: refused elsewhere
             (1, 2, "FLASH_ATTN", False): ["stock"],
             (1, 2, "FLASHINFER", True): ["stock"],  # MLA: vLLM's
             (1, 1, "FLASHINFER", False): ["stock"],
             (2, 2, "FLASHINFER", False): ["stock"]}  # PCP > 1: vLLM lists it itself
    for args, expect in cases.items():
        assert FakeVllmConfig(*args)._get_v2_model_runner_unsupported_features() == expect


@pytest.mark.parametrize("tp,dcp,backend,v2", [
    (2, 2, "FLASHINFER", False),  # the plugin's DCP inside TP runs the V1 runner subclass
    (2, 2, None, True), (2, 1, "FLASHINFER", True), (1, 1, None, True)])
def test_real_config_picks_v1_only_for_the_plugins_dcp(tmp_path, monkeypatch, tp, dcp,
                                                       backend, v2):
    """vLLM's own VllmConfig (Triton shown as present, as on a GPU host)."""
    from vllm.config import AttentionConfig

    from helpers import real_vllm_config

    config = real_vllm_config(tmp_path, monkeypatch,
                              dict(tensor_parallel_size=tp, decode_context_parallel_size=dcp),
                              hf=dict(num_key_value_heads=1),
                              attention_config=AttentionConfig(backend=backend))
    assert config.use_v2_model_runner == v2
