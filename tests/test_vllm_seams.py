"""The seams where vllm-pcp enters vLLM 0.33.0: its two runtime patches and the hooks it uses
without patching, each pinned on vLLM's own code (the rows V, P1, P2 and H1 to H5 of
``vllm_pcp/patches/README.md``).

A test fails when vLLM moves a seam, so the patch or hook is revisited instead of silently
doing nothing. Each asserts on vLLM's real objects where they build on the CPU (configs,
the PCP manager, the model state, attention groups), else on signatures or on the method's
source read with ``ast``. ``tests/test_vllm_internals.py`` pins what the plugin's
subclasses read, write and call behind these seams.
"""
import ast
import dataclasses
import importlib
import inspect
import sys
from types import ModuleType, SimpleNamespace

import numpy as np
import pytest
import torch
import vllm

from vllm_fixtures import (bind, calls, cls, eager, func, global_batch, group,  # noqa: F401
                           config_paths, make_builder, make_config, manager_kwargs,
                           methods, optional_class, params, plugin_modules, resolve,
                           settings, tree)
from vllm_pcp.patches import model_config_dcp, platform_config


def test_vllm_and_flashinfer_are_the_pinned_versions():
    """README V. The plugin runs on one vLLM (config.VLLM_VERSION) and the FlashInfer it
    requires."""
    import importlib.metadata

    import flashinfer

    from vllm_pcp.config import VLLM_VERSION, version_refusal

    assert vllm.__version__ == VLLM_VERSION == "0.33.0"
    assert version_refusal(vllm.__version__) is None
    assert f"flashinfer-python=={flashinfer.__version__}" in importlib.metadata.requires("vllm")


# -- P1: CudaPlatformBase.check_and_update_config -----------------------------------------

def test_platform_hook_resolves_the_worker_before_the_wrap_runs():
    """README P1. vLLM's CUDA platform resolves ``worker_cls = "auto"`` in the classmethod
    the patch wraps (read without importing vllm.platforms.cuda, which needs libcuda), to a
    worker the plugin replaces; every VllmConfig runs it when it is built."""
    from vllm_pcp.config import STOCK_WORKER_CLS

    module, class_name, method = platform_config.SYMBOL
    fn = func(cls(tree(module), class_name), method)
    assert [ast.unparse(d) for d in fn.decorator_list] == ["classmethod"]
    assert [a.arg for a in fn.args.args] == ["cls", "vllm_config"]
    [resolve] = [n for n in ast.walk(fn) if isinstance(n, ast.If)
                 and ast.unparse(n.test) == "parallel_config.worker_cls == 'auto'"]
    [assign] = resolve.body
    assert ast.unparse(assign.targets[0]) == "parallel_config.worker_cls"
    assert {"auto", assign.value.value} <= set(STOCK_WORKER_CLS)
    post_init = func(cls(tree("vllm.config.vllm"), "VllmConfig"), "__post_init__")
    assert calls(post_init, "current_platform.check_and_update_config")


def test_wrap_runs_vllm_first_then_the_plugin_once(monkeypatch):
    calls_ = []

    class FakePlatform:
        @classmethod
        def check_and_update_config(cls, vllm_config):
            calls_.append(("vllm", vllm_config))

    import vllm_pcp.config as config_mod

    monkeypatch.setattr(config_mod, "prepare_pcp_config", lambda c: calls_.append(("pcp", c)))
    assert platform_config.wrap(FakePlatform)
    assert not platform_config.wrap(FakePlatform)  # idempotent
    FakePlatform.check_and_update_config("cfg")
    assert calls_ == [("vllm", "cfg"), ("pcp", "cfg")]


def test_wrap_with_a_refusal_refuses_only_what_the_plugin_takes_over(make_config, monkeypatch):
    """README P1, ``refusal=``: on another vLLM the wrap refuses ``-pcp`` on non-MLA models
    with the message, after vLLM's own body, and runs none of the plugin's checks."""
    import vllm_pcp.config as config_mod
    from vllm_pcp.config import PCPConfigError

    seen = []
    monkeypatch.setattr(config_mod, "prepare_pcp_config", lambda c: seen.append("checks"))

    class FakePlatform:
        @classmethod
        def check_and_update_config(cls, vllm_config):
            seen.append("vllm")

    assert platform_config.wrap(FakePlatform, refusal="needs vLLM 0.33.0")
    with pytest.raises(PCPConfigError, match="^needs vLLM 0.33.0$"):
        FakePlatform.check_and_update_config(make_config(prefill_context_parallel_size=2))
    assert seen == ["vllm"]
    FakePlatform.check_and_update_config(make_config())  # -pcp 1
    mla = SimpleNamespace(parallel_config=SimpleNamespace(prefill_context_parallel_size=2),
                          model_config=SimpleNamespace(use_mla=True))
    FakePlatform.check_and_update_config(mla)  # vLLM's own PCP
    assert seen == ["vllm"] * 3


def _fake_cuda(monkeypatch, **attrs) -> None:
    """The platform shown as CUDA, with a stand-in ``vllm.platforms.cuda`` (the real one
    needs libcuda)."""
    from vllm.platforms import current_platform

    fake = ModuleType("vllm.platforms.cuda")
    fake.__dict__.update(attrs)
    monkeypatch.setitem(sys.modules, "vllm.platforms.cuda", fake)
    monkeypatch.setattr(current_platform, "is_cuda", lambda: True)


def test_apply_leaves_non_cuda_platforms_alone(monkeypatch):
    from vllm.platforms import current_platform

    monkeypatch.setattr(current_platform, "is_cuda", lambda: False)
    assert platform_config.apply() is False

    class FakeCudaPlatformBase:
        @classmethod
        def check_and_update_config(cls, vllm_config):
            pass

    _fake_cuda(monkeypatch, CudaPlatformBase=FakeCudaPlatformBase)
    assert platform_config.apply() is True
    assert getattr(FakeCudaPlatformBase.check_and_update_config.__func__,
                   platform_config.PATCHED_ATTR)
    assert platform_config.apply() is False  # idempotent


def test_another_vllm_gets_only_the_refusal(make_config, monkeypatch):
    """README P1. ``register()`` on a vLLM other than 0.33.0 installs the refusal on the
    CUDA platform (naming the version it needs) and neither the backend nor the patches;
    where vLLM lacks the hook, it patches nothing and does not fail."""
    import vllm.v1.attention.backends.registry as registry

    import vllm_pcp
    import vllm_pcp.patches as patches
    from vllm_pcp.config import PCPConfigError, version_refusal

    class FakeCudaPlatformBase:
        @classmethod
        def check_and_update_config(cls, vllm_config):
            pass

    config = make_config(prefill_context_parallel_size=2)
    _fake_cuda(monkeypatch, CudaPlatformBase=FakeCudaPlatformBase)
    monkeypatch.setattr(vllm, "__version__", "0.34.0")
    monkeypatch.setattr(vllm_pcp, "_registered", False)
    touched = []
    monkeypatch.setattr(patches, "apply_all", lambda: touched.append("patches"))
    monkeypatch.setattr(registry, "register_backend", lambda *a: touched.append("backend"))
    vllm_pcp.register()
    assert touched == []
    with pytest.raises(PCPConfigError) as err:
        FakeCudaPlatformBase.check_and_update_config(config)
    assert str(err.value) == version_refusal("0.34.0") and "0.33.0" in str(err.value)
    _fake_cuda(monkeypatch)  # no CudaPlatformBase: an ImportError inside
    patches.refuse_pcp("reason")


# -- P2: ModelConfig.verify_with_parallel_config ------------------------------------------

def _unpatched_verify():
    from vllm.config.model import ModelConfig

    method = ModelConfig.verify_with_parallel_config
    return getattr(method, "__wrapped__", method)


def test_patched_model_config_check_has_the_0_33_shape():
    """README P2. The TP-vs-KV-heads checks run only for ``decode_context_parallel_size >
    1`` on non-MLA models, read from ``parallel_config`` once: showing DCP as 1 skips them."""
    fn = ast.parse(inspect.getsource(_unpatched_verify()).lstrip())
    assert [a.arg for a in fn.body[0].args.args] == ["self", "parallel_config"]
    [read] = [n for n in ast.walk(fn) if isinstance(n, ast.Assign)
              and ast.unparse(n.value) == "parallel_config.decode_context_parallel_size"]
    name = read.targets[0].id
    [guard] = [n for n in ast.walk(fn) if isinstance(n, ast.If)
               and ast.unparse(n.test) == f"{name} > 1 and (not self.use_mla)"]
    body = ast.unparse(guard)
    assert "tensor_parallel_size <= total_num_kv_heads" in body
    assert "max_dcp_size = tensor_parallel_size // total_num_kv_heads" in body
    assert len([n for n in ast.walk(fn) if isinstance(n, ast.Attribute)
                and ast.unparse(n) == "parallel_config.decode_context_parallel_size"]) == 1


def test_model_config_wrapper_hides_dcp_only_when_it_spans_pcp():
    seen = []

    class FakeModelConfig:
        use_mla = False

        def verify_with_parallel_config(self, parallel_config):
            seen.append(parallel_config.decode_context_parallel_size)

    assert model_config_dcp.wrap(FakeModelConfig)
    assert not model_config_dcp.wrap(FakeModelConfig)
    for pcp, dcp in ((2, 2), (1, 2), (2, 1), (4, 2), (4, 4)):
        par = SimpleNamespace(prefill_context_parallel_size=pcp,
                              decode_context_parallel_size=dcp)
        FakeModelConfig().verify_with_parallel_config(par)
        assert par.decode_context_parallel_size == dcp  # restored
    FakeModelConfig.use_mla = True
    FakeModelConfig().verify_with_parallel_config(SimpleNamespace(
        prefill_context_parallel_size=2, decode_context_parallel_size=2))
    assert seen == [1, 2, 1, 2, 1, 2]


def test_real_config_takes_dcp_over_pcp_only_with_the_patch(make_config):
    """README P2. vLLM's own check refuses ``-pcp 2 -dcp 2`` on a GQA model at TP 1 (2 KV
    heads); the patched one, installed by ``register()``, lets the config build."""
    from vllm.config.model import ModelConfig

    config = make_config(prefill_context_parallel_size=2, decode_context_parallel_size=2)
    assert getattr(ModelConfig.verify_with_parallel_config, model_config_dcp.PATCHED_ATTR)
    with pytest.raises(ValueError, match="Decode context parallelism for GQA/MQA requires"):
        _unpatched_verify()(config.model_config, config.parallel_config)
    config.model_config.verify_with_parallel_config(config.parallel_config)
    assert config.parallel_config.decode_context_parallel_size == 2
    with pytest.raises(ValueError, match="greater than the model's total number of KV heads"):
        make_config(tensor_parallel_size=2, decode_context_parallel_size=2)  # DCP inside TP


# -- H1: register_backend and vLLM's PCP gates ---------------------------------------------

def test_flashinfer_override_passes_vllms_pcp_selection():
    """README H1. After ``register()`` FLASHINFER resolves to the plugin's backend, whose
    ``validate_configuration`` (run on the class ``get_class()`` returns) accepts
    ``use_pcp``, which stock FlashInfer refuses; the CUDA platform resolves every backend
    through ``get_class()`` and the selector sets ``use_pcp`` from ``-pcp``."""
    from vllm.platforms.interface import DeviceCapability
    from vllm.v1.attention.backends.flashinfer import FlashInferBackend
    from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend
    from vllm.v1.attention.selector import AttentionSelectorConfig

    import vllm_pcp
    from vllm_pcp.backend import PCPFlashInferBackend

    vllm_pcp.register()
    assert params(register_backend) == ["backend", "class_path", "is_mamba"]
    flashinfer = AttentionBackendEnum.FLASHINFER
    assert flashinfer.is_overridden() and flashinfer.get_path() == vllm_pcp.BACKEND
    assert flashinfer.get_class() is PCPFlashInferBackend
    assert PCPFlashInferBackend.get_name() == "FLASHINFER"
    selector = AttentionSelectorConfig(head_size=128, dtype=torch.bfloat16,
                                       kv_cache_dtype="auto", block_size=16, use_pcp=True)
    args = dict(selector._asdict(), device_capability=DeviceCapability(9, 0))
    assert set(args) == set(params(FlashInferBackend.validate_configuration))
    assert "PCP not supported" in FlashInferBackend.validate_configuration(**args)
    assert flashinfer.get_class().validate_configuration(**args) == []
    cuda = tree("vllm.platforms.cuda")
    assert ast.unparse(func(cuda, "_get_attn_backend_class").body[-1]) == \
        "return backend.get_class()"
    platform = cls(cuda, "CudaPlatformBase")
    for method in ("get_valid_backends", "get_attn_backend_cls"):
        assert calls(func(platform, method), "_get_attn_backend_class"), method
    assert "use_pcp=vllm_config.parallel_config.prefill_context_parallel_size > 1" in \
        ast.unparse(tree("vllm.v1.attention.selector"))


def _layer(impl, backend):
    """An attention layer as vLLM's static forward context holds it."""
    from vllm.model_executor.layers.attention_layer_base import AttentionLayerBase

    layer_cls = type("Layer", (AttentionLayerBase,), dict(
        get_attn_backend=lambda self: backend, get_kv_cache_spec=lambda self, c: None))
    layer = layer_cls.__new__(layer_cls)
    layer.impl = impl
    return layer


@pytest.mark.parametrize("dcp", [1, 2])
def test_kv_cache_init_check_passes_the_plugins_layers(make_builder, dcp):
    """README H1. ``check_attention_cp_compatibility`` (run by MRV2's
    ``initialize_kv_cache``) asserts the layer's backend ``supports_pcp()`` (the impl's
    flag) and, under DCP, the impl's ``need_to_return_lse_for_decode``, which
    ``AttentionImplBase.__new__`` sets from the DCP group and ``can_return_lse_for_decode``."""
    from vllm.v1.attention.backends.flashinfer import FlashInferBackend, FlashInferImpl
    from vllm.v1.worker.cp_utils import check_attention_cp_compatibility

    from vllm_pcp.backend import PCPFlashInferBackend, PCPFlashInferMetadataBuilder

    _, impl, config = make_builder(PCPFlashInferMetadataBuilder, dcp=dcp)
    layers = config.compilation_config.static_forward_context
    layers["layers.0.attn"] = _layer(impl, PCPFlashInferBackend)
    check_attention_cp_compatibility(config)
    assert impl.need_to_return_lse_for_decode == (dcp > 1)
    assert FlashInferImpl.can_return_lse_for_decode and not FlashInferImpl.supports_pcp
    assert PCPFlashInferBackend.supports_pcp() and not FlashInferBackend.supports_pcp()
    layers["layers.0.attn"] = _layer(impl, FlashInferBackend)
    with pytest.raises(AssertionError, match="FLASHINFER does not support PCP"):
        check_attention_cp_compatibility(config)
    if dcp > 1:
        layers["layers.0.attn"] = _layer(impl, PCPFlashInferBackend)
        impl.need_to_return_lse_for_decode = False
        with pytest.raises(AssertionError, match="return the softmax LSE"):
            check_attention_cp_compatibility(config)
    runner = cls(tree("vllm.v1.worker.gpu.model_runner"), "GPUModelRunner")
    assert calls(func(runner, "initialize_kv_cache"), "check_attention_cp_compatibility")


# -- H2: Worker._make_model_runner ----------------------------------------------------------

def test_worker_builds_its_runner_through_make_model_runner(make_config, monkeypatch):
    """README H2. ``init_device`` builds ``self.model_runner`` from ``_make_model_runner()``
    (no arguments), vLLM's builds MRV2's runner from ``(vllm_config, device)`` when
    ``use_v2_model_runner``, which ``-pcp`` turns on; the worker is built and initialised
    inside the current vLLM config, which the PCP manager reads."""
    from vllm.v1.worker.gpu.model_runner import GPUModelRunner
    from vllm.v1.worker.gpu_worker import Worker

    import vllm_pcp.runner as runner
    from vllm_pcp.worker import PCPWorker

    worker = cls(tree("vllm.v1.worker.gpu_worker"), "Worker")
    assert calls(func(worker, "init_device"), "self._init_workspace_and_model_runner")
    assert "self.model_runner: GPUModelRunner = self._make_model_runner()" in \
        ast.unparse(func(worker, "_init_workspace_and_model_runner"))
    make = ast.unparse(func(worker, "_make_model_runner"))
    assert "from vllm.v1.worker.gpu.model_runner import GPUModelRunner as GPUModelRunnerV2" \
        in make and "return GPUModelRunnerV2(self.vllm_config, self.device)" in make
    assert "self.use_v2_model_runner = vllm_config.use_v2_model_runner" in \
        ast.unparse(func(worker, "__init__"))
    assert params(Worker._make_model_runner) == params(PCPWorker._make_model_runner) == ["self"]
    assert params(GPUModelRunner.__init__) == ["self", "vllm_config", "device"]
    assert issubclass(runner.PCPModelRunner, GPUModelRunner)
    assert make_config(prefill_context_parallel_size=2).use_v2_model_runner
    wrapper = func(cls(tree("vllm.v1.worker.worker_base"), "WorkerWrapperBase"), "init_device")
    assert [w for w in ast.walk(wrapper) if isinstance(w, ast.With)
            and ast.unparse(w.items[0].context_expr) == "set_current_vllm_config(self.vllm_config)"
            and calls(w, "self.worker.init_device")]
    built = PCPWorker.__new__(PCPWorker)
    built.vllm_config, built.device, built.use_v2_model_runner = "cfg", "dev", True
    monkeypatch.setattr(runner, "PCPModelRunner", lambda *args: args)
    assert built._make_model_runner() == ("cfg", "dev")
    built.use_v2_model_runner = False
    with pytest.raises(RuntimeError, match="Model Runner V2"):
        built._make_model_runner()


# -- H3: GPUModelRunner.pcp_manager_cls and maybe_build_pcp_manager ------------------------

def test_runner_picks_its_manager_through_pcp_manager_cls():
    """README H3. MRV2's runner builds its manager in ``__init__`` with
    ``maybe_build_pcp_manager(..., cls=self.pcp_manager_cls)``, a property."""
    from vllm.v1.worker.gpu.model_runner import GPUModelRunner
    from vllm.v1.worker.gpu.pcp_manager import PCPManager

    from vllm_pcp.manager import GQAPCPManager
    from vllm_pcp.runner import PCPModelRunner

    init = func(cls(tree("vllm.v1.worker.gpu.model_runner"), "GPUModelRunner"), "__init__")
    [build] = calls(init, "pcp.maybe_build_pcp_manager")
    assert {k.arg: ast.unparse(k.value) for k in build.keywords} == {
        "cls": "self.pcp_manager_cls"}
    assert [ast.unparse(a) for a in build.args] == ["self.vllm_config", "self.device",
                                                    "self.supports_mm_inputs"]
    for runner, manager in ((GPUModelRunner, PCPManager), (PCPModelRunner, GQAPCPManager)):
        prop = inspect.getattr_static(runner, "pcp_manager_cls")
        assert isinstance(prop, property) and prop.fget(None) is manager
    assert issubclass(GQAPCPManager, PCPManager)


@pytest.mark.parametrize("dcp", [1, 2])
def test_vllm_builds_the_plugins_manager(make_config, monkeypatch, dcp):
    """README H3. vLLM's ``maybe_build_pcp_manager`` runs ``cls.validate_config(config,
    supports_mm_inputs)`` (the plugin's refusals, where stock PCPManager refuses GQA) and
    builds ``cls(**kwargs)`` with keywords vLLM's PCPManager takes; the plugin's manager
    reads its settings from the current config."""
    import vllm.v1.worker.gpu.pcp_manager as pcp_manager
    from vllm.config import set_current_vllm_config

    from vllm_pcp.config import PCPConfigError
    from vllm_pcp.knobs import PCPSettings
    from vllm_pcp.manager import GQAPCPManager

    fn = func(tree("vllm.v1.worker.gpu.pcp_manager"), "maybe_build_pcp_manager")
    [validate], [build] = calls(fn, "cls.validate_config"), calls(fn, "cls")
    assert [ast.unparse(a) for a in validate.args] == ["vllm_config", "supports_mm_inputs"]
    assert validate.lineno < build.lineno
    bind(pcp_manager.PCPManager.__init__, build, bound_self=True)
    monkeypatch.setattr(pcp_manager, "get_pcp_group", lambda: group(2, rank=1))
    monkeypatch.setattr(pcp_manager, "get_dcp_group", lambda: group(dcp, rank=1))
    config = make_config(prefill_context_parallel_size=2, decode_context_parallel_size=dcp)
    with set_current_vllm_config(config):
        built = pcp_manager.maybe_build_pcp_manager(config, torch.device("cpu"), False,
                                                    cls=GQAPCPManager)
        with pytest.raises(PCPConfigError, match="multimodal"):
            pcp_manager.maybe_build_pcp_manager(config, torch.device("cpu"), True,
                                                cls=GQAPCPManager)
        with pytest.raises(NotImplementedError, match="MLA models only"):
            pcp_manager.maybe_build_pcp_manager(config, torch.device("cpu"), False)
    assert isinstance(built, GQAPCPManager)
    assert (built.pcp_world_size, built.pcp_rank, built.dcp_world_size) == (2, 1, dcp)
    assert built.settings == PCPSettings.from_vllm_config(config)
    assert built.input_buffers.max_num_tokens == \
        config.scheduler_config.max_num_batched_tokens


# -- H4: the model state's model_specific_attn_metadata ------------------------------------

def _spy_builder(builder_cls, seen: list):
    """A builder of ``builder_cls`` made without ``__init__`` whose ``build`` records the
    arguments vLLM passes, bound to ``builder_cls.build``'s signature."""
    builder = builder_cls.__new__(builder_cls)
    signature = inspect.signature(builder_cls.build)

    def build(*args, **kwargs):
        seen.append((builder_cls, signature.bind(builder, *args, **kwargs).arguments))
        return builder_cls.__name__

    builder.build = build
    return builder


def test_model_state_hands_the_step_to_the_plugins_builders_only(make_config):
    """README H4. vLLM's ``DefaultModelState.prepare_attn`` forwards
    ``model_specific_attn_metadata`` to ``build_attn_metadata``, which asks it for
    ``get_extra_attn_kwargs(builder, num_reqs)`` and passes them through
    ``AttentionGroup.build_metadata`` to ``builder.build(common_prefix_len,
    common_attn_metadata, **kwargs)``: on a real local batch of the plugin's manager, the
    plugin's builder gets the step (``pcp_step``), stock FlashInfer's nothing extra."""
    from vllm.config import CUDAGraphMode, set_current_vllm_config
    from vllm.v1.attention.backends.flashinfer import FlashInferBackend, FlashInferMetadataBuilder
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
    from vllm.v1.worker.gpu.model_states import resolve_model_state_cls
    from vllm.v1.worker.gpu.model_states.default import DefaultModelState
    from vllm.v1.worker.utils import AttentionGroup

    from vllm_pcp.backend import PCPFlashInferBackend, PCPFlashInferMetadataBuilder
    from vllm_pcp.manager import GQAPCPManager
    from vllm_pcp.runner import PCPModelState

    config, model = make_config(prefill_context_parallel_size=2), torch.nn.Linear(2, 2)
    with set_current_vllm_config(config):
        assert resolve_model_state_cls(config, model) is DefaultModelState
        state = PCPModelState(config, model, None, torch.device("cpu"))
    manager = GQAPCPManager(**manager_kwargs(2, 1), settings=settings(2))
    batch = global_batch([0, 5], [40, 1])
    local = manager.partition_batch(batch, eager())
    slots = manager._convert_to_gathered_slot_mappings(
        torch.arange(batch.num_tokens, dtype=torch.int64).unsqueeze(0))
    spec = FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=64, dtype=torch.bfloat16)
    seen = []
    groups = [[AttentionGroup(backend, [name], spec, 0, metadata_builders=[
        _spy_builder(builder_cls, seen)]) for backend, builder_cls, name in (
        (PCPFlashInferBackend, PCPFlashInferMetadataBuilder, "l0"),
        (FlashInferBackend, FlashInferMetadataBuilder, "l1"))]]
    kv_config = KVCacheConfig(num_blocks=8, kv_cache_tensors=[],
                              kv_cache_groups=[KVCacheGroupSpec(["l0", "l1"], spec)])
    tables = (torch.zeros(local.num_reqs_after_padding, 8, dtype=torch.int32),)
    metadata = state.prepare_attn(local, CUDAGraphMode.NONE, tables, slots, groups, kv_config)
    assert metadata == {"l0": "PCPFlashInferMetadataBuilder", "l1": "FlashInferMetadataBuilder"}
    (_, plugin), (_, stock) = seen
    assert plugin["pcp_step"] is local.pcp.step and "pcp_step" not in stock
    assert plugin["common_prefix_len"] == 0
    cm = plugin["common_attn_metadata"]
    assert (cm.num_reqs, cm.num_actual_tokens) == (local.num_reqs, local.num_tokens)
    assert cm.slot_mapping.data_ptr() == slots[0].data_ptr() and cm.block_table_tensor is tables[0]
    assert np.array_equal(cm.query_start_loc_cpu.numpy(),
                          local.query_start_loc_np[:local.num_reqs + 1])


def test_runner_swaps_in_the_model_state_vllm_built():
    """README H4. MRV2's ``load_model`` builds the state with ``init_model_state(vllm_config,
    model, encoder_cache, device)`` and keeps no other reference to it (only
    ``self.model_state.X`` after), so the plugin's swap after it is what every later step
    uses; no vLLM caller of ``prepare_attn`` passes ``model_specific_attn_metadata`` (the
    plugin's state fills it), and the runner passes the local batch first."""
    from vllm.v1.worker.gpu.model_states.default import DefaultModelState

    runner = cls(tree("vllm.v1.worker.gpu.model_runner"), "GPUModelRunner")
    load = func(runner, "load_model")
    [made] = [n for n in ast.walk(load) if isinstance(n, ast.Assign)
              and ast.unparse(n.targets[0]) == "self.model_state"]
    assert ast.unparse(made.value) == \
        "init_model_state(self.vllm_config, self.model, self.encoder_cache, self.device)"
    bare = [n for n in ast.walk(load) if isinstance(n, ast.Attribute)
            and ast.unparse(n) == "self.model_state" and isinstance(n.ctx, ast.Load)]
    parents = {id(c): p for p in ast.walk(load) for c in ast.iter_child_nodes(p)}
    assert bare and all(isinstance(parents[id(n)], ast.Attribute) for n in bare)
    assert params(DefaultModelState.__init__) == ["self", "vllm_config", "model",
                                                  "encoder_cache", "device"]
    assert "model_specific_attn_metadata" in params(DefaultModelState.prepare_attn)
    for module in ("model_runner", "cudagraph_utils", "ubatch_utils"):
        for call in [c for c in ast.walk(tree(f"vllm.v1.worker.gpu.{module}"))
                     if isinstance(c, ast.Call) and ast.unparse(c.func).endswith(
                         "model_state.prepare_attn")]:
            assert "model_specific_attn_metadata" not in {k.arg for k in call.keywords}
            assert call.args, ast.unparse(call)
    [step] = calls(func(runner, "execute_model"), "self.model_state.prepare_attn")
    assert ast.unparse(step.args[0]) == "input_batch"


# -- H5: the subclasses' overrides and the names the plugin imports ------------------------

# plugin methods that override nothing of vLLM's; every other method must override one
OWN_METHODS = {
    "vllm_pcp.manager.GQAPCPManager": {"plan_split"},
    "vllm_pcp.runner.PCPModelRunner": set(),
    "vllm_pcp.runner.PCPModelState": set(),
    "vllm_pcp.runner.PCPStepAttnKwargs": {"__init__"},
    "vllm_pcp.worker.PCPWorker": {"pcp_step_counts", "pcp_sampled_token_checks", "pcp_memory"},
    "vllm_pcp.backend.PCPFlashInferImpl": {"_forward_ragged", "_forward_dcp", "_kv_views"},
    "vllm_pcp.backend.PCPFlashInferMetadataBuilder": {"can_attend_ragged", "_plan_ragged",
                                                      "_build_dcp"},
    "vllm_pcp.backend.PCPFlashInferBackend": set(),
}


@pytest.mark.parametrize("path", sorted(OWN_METHODS))
def test_overrides_override_a_vllm_method_of_the_same_shape(path):
    """README H5. Each method a subclass defines overrides its vLLM base's method of that
    name (a renamed vLLM method would leave the override dead) with the same kind
    (static, class, property) and vLLM's parameters first; ``*args, **kwargs`` pass
    vLLM's through."""
    module, name = path.rsplit(".", 1)
    plugin = getattr(importlib.import_module(module), name)
    base = plugin.__mro__[1]
    assert base.__module__.startswith("vllm."), base
    for method in methods(cls(tree(module), name)) - OWN_METHODS[path]:
        ours, theirs = (inspect.getattr_static(c, method, None) for c in (plugin, base))
        assert theirs is not None, f"{base.__name__} has no {method}"
        assert type(ours) is type(theirs), method
        if isinstance(ours, property):
            continue
        ours, theirs = (inspect.signature(getattr(c, method)).parameters for c in (plugin, base))
        kinds = {p.kind for p in ours.values()}
        if inspect.Parameter.VAR_POSITIONAL in kinds and inspect.Parameter.VAR_KEYWORD in kinds:
            continue
        assert list(ours)[:len(theirs)] == list(theirs), method
        added = list(ours.values())[len(theirs):]
        assert all(p.default is not inspect.Parameter.empty for p in added), method


def test_every_vllm_name_the_plugin_imports_exists():
    """README H5. Every name the plugin imports from vLLM or FlashInfer (at module level
    or inside a function) exists in 0.33.0 / 0.7.2.post1, and so does every attribute it
    reads on an imported class or module (``FlashInferBackend.X``, ``flashinfer.X``)."""
    missing, checked = [], 0
    for module in plugin_modules():
        source = tree(module)
        bound = {}
        for node in ast.walk(source):
            if isinstance(node, ast.ImportFrom) and node.module and \
                    node.module.split(".")[0] in ("vllm", "flashinfer"):
                for alias in node.names:
                    try:
                        bound[alias.asname or alias.name] = resolve(node.module, alias.name)
                    except (AttributeError, ImportError) as exc:
                        missing.append(f"{module}: {node.module}.{alias.name} ({exc})")
            elif isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.name.split(".")[0] in ("vllm", "flashinfer"):
                        bound[alias.asname or alias.name.split(".")[0]] = importlib.import_module(
                            alias.name.split(".")[0])
        for node in ast.walk(source):
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and \
                    node.value.id in bound:
                owner = bound[node.value.id]
                if inspect.isclass(owner) or inspect.ismodule(owner):
                    checked += 1
                    if not hasattr(owner, node.attr):
                        missing.append(f"{module}: {node.value.id}.{node.attr}")
    assert checked >= 10 and missing == []


def test_config_fields_the_plugin_reads_exist(make_config):
    """README H5. Every VllmConfig attribute path the plugin reads (many through
    ``getattr(..., default)``, which would pass silently if vLLM renamed the field) resolves
    on vLLM's real config; below a field the test config leaves None (an optional
    sub-config), on that field's declared class."""
    config = make_config(prefill_context_parallel_size=2)
    paths = set().union(*(config_paths(m) for m in plugin_modules()))
    assert ("parallel_config", "dcp_comm_backend") in paths  # the parser still works
    unresolved = []
    for path in sorted(paths):
        obj, owner = config, None
        for name in path:
            if obj is None:  # an optional sub-config left unset: check its class
                found = optional_class(*owner)
                if found is None or not (name in {f.name for f in dataclasses.fields(found)}
                                         or hasattr(found, name)):
                    unresolved.append(path)
                break
            if not hasattr(obj, name):
                unresolved.append(path)
                break
            owner, obj = (type(obj), name), getattr(obj, name)
    assert unresolved == []
