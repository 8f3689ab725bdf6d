"""vLLM 0.33.0 internals that vllm-pcp's subclasses read, write and call behind the seams of
``tests/test_vllm_seams.py`` (the I rows of ``vllm_pcp/patches/README.md``): MRV2's step, the
FlashInfer builder and impl, the attention layer, FlashInfer's wrappers, the DCP layout,
process groups, MoE, CUDA graph modes. Each test asserts on vLLM's own objects, built on the
CPU where vLLM allows it, else on signatures or the source read with ``ast``; where the
plugin's code decides what is relied on, it parses the plugin's module too."""
from __future__ import annotations

import ast
import dataclasses
import importlib
import inspect
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from vllm_fixtures import (DECODE, WRAPPERS, bind, calls, cls, eager,  # noqa: F401
                           flashinfer_method, func, global_batch, group, kept, make_builder,
                           make_config, manager_kwargs, methods, param_loads, params,
                           run_statements, self_loads, self_stores, settings, tree)

RUNNER = "vllm.v1.worker.gpu.model_runner"
MANAGER = "vllm.v1.worker.gpu.pcp_manager"


def _line(node: ast.AST, dotted: str) -> int:
    [call] = calls(node, dotted)
    return call.lineno


# -- MRV2's step: the runner and the PCP manager ------------------------------------------

def test_execute_model_runs_the_managers_seams_in_order():
    """README I1. One step: the dispatch size (``get_num_tokens_for_dispatch``), the local
    batch (``partition_batch``, last in ``prepare_inputs``), the manager's ``prepare_attn``,
    the model state's, the forward; ``restore_for_sampling`` before ``sample``. vLLM's
    calls bind to the plugin's overrides."""
    from vllm_pcp.manager import GQAPCPManager

    runner = cls(tree(RUNNER), "GPUModelRunner")
    step = func(runner, "execute_model")
    [dispatch] = calls(step, "self.pcp_manager.get_num_tokens_for_dispatch")
    assert [ast.unparse(a) for a in dispatch.args] == [
        "batch_req_state.num_scheduled_tokens", "batch_req_state.is_prefilling_np"]
    bind(GQAPCPManager.get_num_tokens_for_dispatch, dispatch, bound_self=True)
    order = [dispatch.lineno, _line(step, "dispatch_cg_and_sync_dp"),
             _line(step, "self.prepare_inputs"), _line(step, "self.prepare_attn"),
             _line(step, "self.model_state.prepare_attn"), _line(step, "set_forward_context")]
    assert order == sorted(order)
    prepare = func(runner, "prepare_inputs")
    [partition] = calls(prepare, "self.pcp_manager.partition_batch")
    bind(GQAPCPManager.partition_batch, partition, bound_self=True)
    assert ast.unparse(prepare.body[-1]) == "return input_batch"
    assert ast.unparse(prepare.body[-2]) == "if self.pcp_manager is not None:\n    " \
        "input_batch = self.pcp_manager.partition_batch(input_batch, batch_desc)"
    assert "return self.pcp_manager.prepare_attn(input_batch)" in \
        ast.unparse(func(runner, "prepare_attn"))
    sample = func(runner, "sample_tokens")
    [restore] = calls(sample, "self.pcp_manager.restore_for_sampling")
    assert [ast.unparse(a) for a in restore.args] == ["hidden_states", "aux_hidden_states"]
    assert restore.lineno < _line(sample, "self.sample")


def test_sample_runs_once_a_step_before_the_ids_are_fed_back():
    """README I2. ``sample(hidden_states, input_batch, grammar_output)`` is called once a
    step, by ``sample_tokens``, on the restored global batch (the same on every PCP rank),
    and returns ``(SamplerOutput, num_sampled, num_rejected)`` whose first item's
    ``sampled_token_ids`` reach the request states (``postprocess_sampled``) after it."""
    from vllm.v1.worker.gpu.model_runner import GPUModelRunner
    from vllm.v1.worker.gpu.sample.output import SamplerOutput

    assert params(GPUModelRunner.sample) == ["self", "hidden_states", "input_batch",
                                             "grammar_output"]
    runner = cls(tree(RUNNER), "GPUModelRunner")
    assert ast.unparse(func(runner, "sample").returns) == \
        "tuple[SamplerOutput, torch.Tensor, torch.Tensor]"
    assert len(calls(runner, "self.sample")) == 1
    sample = func(runner, "sample_tokens")
    [call] = calls(sample, "self.sample")
    [assign] = [n for n in ast.walk(sample) if isinstance(n, ast.Assign) and n.value is call]
    assert ast.unparse(assign.targets[0]) == "(sampler_output, num_sampled, num_rejected)"
    [feedback] = calls(sample, "self.postprocess_sampled")
    assert ast.unparse(feedback.args[1]) == "sampler_output.sampled_token_ids"
    assert call.lineno < feedback.lineno
    assert "sampled_token_ids" in {f.name for f in dataclasses.fields(SamplerOutput)}


def test_vllm_sizes_the_kv_cache_from_the_profile_runs_torch_peak():
    """README I3. ``determine_available_memory`` runs ``profile_run`` inside
    ``memory_profiling``, which resets the torch peak right before it measures and reads
    ``allocated_bytes.all.peak`` after: memory held through the run counts against the KV
    cache (a second reset at the run's start changes nothing in that count)."""
    from vllm.v1.worker.gpu.model_runner import GPUModelRunner

    fn = func(cls(tree("vllm.v1.worker.gpu_worker"), "Worker"), "determine_available_memory")
    profiling = next(n for n in ast.walk(fn) if isinstance(n, ast.With)
                     and "memory_profiling" in ast.unparse(n.items[0].context_expr))
    [run] = calls(profiling, "self.model_runner.profile_run")
    bind(GPUModelRunner.profile_run, run, bound_self=True)
    assert params(GPUModelRunner.profile_run) == ["self", "randomize_inputs"]
    body = ast.unparse(func(tree("vllm.utils.mem_utils"), "memory_profiling"))
    reset, measure = body.index("reset_peak_memory_stats"), body.index("before_profile.measure")
    assert reset < measure < body.index("yield result") < body.index("after_profile.measure")
    measure_fn = func(cls(tree("vllm.utils.mem_utils"), "MemorySnapshot"), "measure")
    assert "self.torch_peak = stats.get('allocated_bytes.all.peak', 0)" in ast.unparse(measure_fn)


def test_runner_and_worker_read_state_vllms_runner_sets():
    """README I4. Every ``self.X`` PCPModelRunner reads and does not set is assigned by
    MRV2's runner (``dcp_size`` in ``__init__``, ``model_state`` in ``load_model``), and so
    is the ``pcp_manager`` the worker's RPCs read."""
    vllm_runner = cls(tree(RUNNER), "GPUModelRunner")
    plugin = cls(tree("vllm_pcp.runner"), "PCPModelRunner")
    read = self_loads(plugin) - self_stores(plugin) - methods(plugin)
    read |= {n.attr for n in ast.walk(tree("vllm_pcp.worker")) if isinstance(n, ast.Attribute)
             and ast.unparse(n.value) == "self.model_runner"} - self_stores(plugin)
    assert read - (self_stores(vllm_runner) | methods(vllm_runner)) == set()
    init = func(vllm_runner, "__init__")
    assert {"dcp_size", "pcp_manager", "vllm_config", "device", "encoder_cache"} <= \
        self_stores(init)
    assert "self.dcp_size = self.parallel_config.decode_context_parallel_size" in \
        ast.unparse(init)
    assert {"model", "model_state"} <= self_stores(func(vllm_runner, "load_model"))


def test_partition_batch_lays_out_the_batch_the_override_returns(monkeypatch):
    """README I5. vLLM's ``partition_batch`` calls ``_build_batch_layout(num_scheduled,
    num_computed, is_prefilling, query_start_loc_np, padded_num_tokens=...)`` once, builds
    the local batch from this rank's segments and takes this rank's rows of
    ``_padded_gather_idx`` as ``_local_gather_idx`` (real GQAPCPManager, CPU)."""
    from vllm_pcp.manager import GQAPCPManager, PCPStepBatchMetadata

    seen = []

    class Spy(GQAPCPManager):
        def _build_batch_layout(self, *args, **kwargs):
            out = super()._build_batch_layout(*args, **kwargs)
            seen.append((args, kwargs, out))
            return out

    batch = global_batch([0, 7, 0], [1, 1, 50])
    for desc in (eager(), eager(64)):
        seen.clear()
        manager = Spy(**manager_kwargs(2, 1), settings=settings(2))
        local = manager.partition_batch(batch, desc)
        [(args, kwargs, (segments, per_rank))] = seen
        assert args[0] is batch.num_scheduled_tokens and args[1] is batch.num_computed_tokens_np
        assert args[2] is batch.is_prefilling_np and args[3] is batch.query_start_loc_np
        assert kwargs == {"padded_num_tokens": desc.num_tokens or None}
        rows = local.num_tokens_after_padding
        assert rows == (desc.num_tokens or max(per_rank))
        gather = manager._local_gather_idx
        assert gather.data_ptr() == manager._padded_gather_idx[rows:].data_ptr()
        assert len(gather) == rows
        n = local.num_tokens
        assert torch.equal(local.input_ids[:n], batch.input_ids[gather][:n])
        assert torch.equal(local.positions[:n], batch.positions[gather][:n])
        for seg in segments[1]:  # vLLM's rows (segments) are the tokens gathered
            assert torch.equal(local.positions[seg.rank_local_batch_slice],
                               batch.positions[seg.global_batch_slice])
        assert isinstance(local.pcp, PCPStepBatchMetadata)
        assert local.pcp.global_num_tokens == batch.num_tokens


def test_manager_state_the_subclass_shares_with_vllm():
    """README I6. What GQAPCPManager reads or writes on ``self`` and does not own is vLLM's:
    it sets ``_padded_gather_idx``, ``_gathered_kv_write_mask`` and ``_hidden_restore_idx``,
    which vLLM's methods read; it reads ``_local_gather_idx``, ``_gathered_kv_slot_mappings``
    and ``_pad_slot_id``, which vLLM sets."""
    from vllm.v1.attention.backends.utils import PAD_SLOT_ID
    from vllm.v1.worker.gpu.pcp_manager import PCPManager

    vllm_cls, plugin = cls(tree(MANAGER), "PCPManager"), cls(tree("vllm_pcp.manager"),
                                                             "GQAPCPManager")
    own = self_stores(func(plugin, "__init__")) | methods(plugin)
    touched = (self_loads(plugin) | self_stores(plugin)) - own
    assert touched - (self_stores(vllm_cls) | methods(vllm_cls)) == set()
    written = self_stores(plugin) - own
    assert written == {"_padded_gather_idx", "_gathered_kv_write_mask", "_hidden_restore_idx"}
    readers = {"partition_batch", "_convert_to_gathered_slot_mappings", "restore_hidden_states"}
    assert written <= set().union(*(self_loads(func(vllm_cls, m)) for m in readers))
    assert {"_local_gather_idx", "_gathered_kv_slot_mappings", "_pad_slot_id"} <= touched
    manager = PCPManager(**manager_kwargs(2, 0))
    assert manager._pad_slot_id.dtype == torch.int64 and int(manager._pad_slot_id) == PAD_SLOT_ID
    assert manager._gathered_kv_slot_mappings.shape == (1, 2 * manager.input_buffers.max_num_tokens)
    assert manager._local_gather_idx is None and manager._hidden_restore_idx is None


def test_vllm_writes_the_gathered_slot_mapping_and_restores_as_the_override_expects(monkeypatch):
    """README I7. ``prepare_attn`` -> ``prepare_slot_mappings`` -> vLLM's
    ``_convert_to_gathered_slot_mappings``, which picks ``_padded_gather_idx`` into
    ``_gathered_kv_slot_mappings`` and pads what ``_gathered_kv_write_mask`` leaves out;
    dummy runs take ``get_dummy_slot_mappings(num_tokens)``; ``restore_hidden_states``
    returns its input when ``_hidden_restore_idx`` is None, else the all-gather's rows."""
    import vllm.v1.worker.gpu.pcp_manager as pcp_manager
    from vllm.v1.worker.gpu.pcp_manager import PCPManager

    vllm_cls = cls(tree(MANAGER), "PCPManager")
    assert calls(func(vllm_cls, "prepare_attn"), "self.prepare_slot_mappings")
    prepare = func(vllm_cls, "prepare_slot_mappings")
    assert ast.unparse(prepare.body[-1]) == \
        "return self._convert_to_gathered_slot_mappings(global_batch_slot_mappings)"
    dummy_attn = func(cls(tree(RUNNER), "GPUModelRunner"), "prepare_dummy_attn")
    assert "block_table_provider = self.pcp_manager or self.block_tables" in ast.unparse(dummy_attn)
    assert calls(dummy_attn, "block_table_provider.get_dummy_slot_mappings")
    manager = PCPManager(**manager_kwargs(2, 1))
    manager._padded_gather_idx = torch.tensor([0, 1, 4, 0, 2, 3, 4, 0])
    manager._gathered_kv_write_mask = torch.tensor([1, 1, 1, 0, 1, 1, 0, 0], dtype=torch.bool)
    slots = 100 + torch.arange(5).unsqueeze(0)
    out = manager._convert_to_gathered_slot_mappings(slots)
    assert out.tolist() == [[100, 101, 104, -1, 102, 103, -1, -1]]
    assert out.data_ptr() == manager._gathered_kv_slot_mappings.data_ptr()
    dummy = manager.get_dummy_slot_mappings(3)
    assert dummy.shape == (1, 6) and (dummy == -1).all()
    assert dummy.data_ptr() == manager._gathered_kv_slot_mappings.data_ptr()
    hidden = torch.arange(8.0).view(4, 2)
    assert manager.restore_hidden_states(hidden) is hidden
    monkeypatch.setattr(pcp_manager, "get_pcp_group", lambda: group(2, all_gather=lambda x, dim:
                                                                    torch.cat([x, x + 100])))
    manager._hidden_restore_idx = torch.tensor([4, 0])
    manager._global_batch = "global"
    restored, aux, batch = manager.restore_for_sampling(hidden, None)
    assert restored.tolist() == [[100.0, 101.0], [0.0, 1.0]] and aux is None and batch == "global"


def test_batch_metadata_the_step_rides_in():
    """README I8. ``PCPBatchMetadata``: a frozen dataclass the plugin subclasses with a
    defaulted ``step``, of which vLLM reads only its own fields; InputBatch's ``pcp``;
    ``RankSegment``'s fields; the fields of InputBatch and the batch descriptor the
    plugin reads."""
    from vllm.v1.worker.gpu.cudagraph_utils import BatchExecutionDescriptor
    from vllm.v1.worker.gpu.input_batch import InputBatch
    from vllm.v1.worker.gpu.pcp_manager import PCPBatchMetadata, RankSegment

    from vllm_pcp.manager import PCPStepBatchMetadata

    for dc in (PCPBatchMetadata, RankSegment, PCPStepBatchMetadata):
        assert dataclasses.is_dataclass(dc) and dc.__dataclass_params__.frozen
    names = [f.name for f in dataclasses.fields(PCPBatchMetadata)]
    assert [f.name for f in dataclasses.fields(PCPStepBatchMetadata)] == names + ["step"]
    read = {n.attr for n in ast.walk(tree("vllm.v1.worker.gpu.model_states.default"))
            if isinstance(n, ast.Attribute) and ast.unparse(n.value) == "input_batch.pcp"}
    assert read and read <= set(names)
    batch_fields = {f.name: f for f in dataclasses.fields(InputBatch)}
    assert batch_fields["pcp"].default is None
    plugin = tree("vllm_pcp.manager")
    assert self_loads(plugin, "input_batch") <= set(batch_fields)
    assert self_loads(plugin, "batch_desc") <= {f.name for f in dataclasses.fields(
        BatchExecutionDescriptor)}
    for call in calls(plugin, "RankSegment"):
        bind(RankSegment, call)
    assert RankSegment(global_batch_req_idx=0, global_batch_slice=slice(3, 8),
                       rank_local_batch_slice=slice(0, 5)).num_tokens == 5


# -- the FlashInfer builder and impl ------------------------------------------------------

def test_grow_row_buffers_replaces_buffers_vllm_makes_and_reads(make_builder):
    """README I9. The buffers ``grow_row_buffers`` replaces are made by vLLM's builder
    ``__init__`` for ``max_num_seqs`` rows of ``cdiv(max_model_len, block_size)`` pages and
    read again by its planning; the plugin's builder has them for twice the rows."""
    from vllm.v1.attention.backends.flashinfer import FlashInferMetadataBuilder
    from vllm.v1.utils import CpuGpuBuffer

    from vllm_pcp.backend import PCPFlashInferMetadataBuilder

    fn = func(tree("vllm_pcp.backend"), "grow_row_buffers")
    replaced = self_stores(fn, "builder")
    vllm_cls = cls(tree("vllm.v1.attention.backends.flashinfer"), "FlashInferMetadataBuilder")
    assert (self_loads(fn, "builder") | replaced) <= self_stores(func(vllm_cls, "__init__"))
    readers = [m for m in vllm_cls.body if isinstance(m, ast.FunctionDef) and m.name != "__init__"]
    for name in replaced:
        assert any(name in self_loads(m) for m in readers), name
    stock, _, config = make_builder(FlashInferMetadataBuilder)
    grown, _, _ = make_builder(PCPFlashInferMetadataBuilder)
    rows = config.scheduler_config.max_num_seqs
    pages = -(-config.model_config.max_model_len // 16)
    for builder, n in ((stock, rows), (grown, 2 * rows)):
        assert {type(builder.paged_kv_indptr), type(builder.paged_kv_last_page_len)} == {
            CpuGpuBuffer}
        assert builder.paged_kv_indptr.cpu.shape == (n + 1,)
        assert builder.paged_kv_last_page_len.np.shape == (n,)
        assert builder.paged_kv_indices.shape == (n * pages,)


@pytest.mark.parametrize("dcp", [1, 2])
def test_real_builder_has_what_the_plugins_builder_reads(make_builder, dcp):
    """README I10. Every ``self.X`` PCPFlashInferMetadataBuilder reads and does not set,
    and every ``builder.X`` of vllm_pcp/backend.py's helpers, is on vLLM's real builder,
    with the values the plugin plans with; the ``cm.X`` it reads are CommonAttentionMetadata
    fields; capture runs call ``build`` without a step."""
    from vllm.v1.attention.backend import CommonAttentionMetadata
    from vllm.v1.attention.backends.utils import get_per_layer_parameters

    from vllm_pcp.backend import PCPFlashInferImpl, PCPFlashInferMetadataBuilder

    module = tree("vllm_pcp.backend")
    plugin = cls(module, "PCPFlashInferMetadataBuilder")
    read = (self_loads(plugin) - self_stores(plugin) - methods(plugin)) | \
        param_loads(module, "builder")
    builder, _, config = make_builder(PCPFlashInferMetadataBuilder, dcp=dcp)
    assert read and {n for n in read if not hasattr(builder, n)} == set()
    assert (builder.num_qo_heads, builder.num_kv_heads, builder.head_dim,
            builder.page_size) == (8, 2, 64, 16)
    assert builder.q_data_type_prefill == torch.bfloat16 and builder.device.type == "cpu"
    assert builder.sm_scale == builder.global_hyperparameters.sm_scale == 0.125
    assert builder.global_hyperparameters.has_same_all_params is True  # one layer
    assert (builder.dcp_world_size, builder.pcp_dcp) == (dcp, dcp > 1)
    assert (builder.cache_dtype, builder.window_left, builder.logits_soft_cap,
            builder.has_sinks) == ("auto", -1, None, False)
    assert params(builder._get_workspace_buffer) == []
    [layer] = get_per_layer_parameters(config, ["layers.0.attn"], PCPFlashInferImpl).values()
    assert layer.sm_scale == 0.125
    assert self_loads(module, "cm") <= {f.name for f in dataclasses.fields(CommonAttentionMetadata)}
    capture = func(cls(tree("vllm.v1.attention.backend"), "AttentionMetadataBuilder"),
                   "build_for_cudagraph_capture")
    [call] = calls(capture, "self.build")
    assert {k.arg for k in call.keywords} == {"common_prefix_len", "common_attn_metadata"}


def test_real_impl_has_the_settings_the_plugin_checks(make_builder):
    """README I11. What PCPFlashInferImpl and the helpers taking ``impl`` read is on vLLM's
    impl, in the encoding they test (no window ``(-1, -1)``, a window of W ``(W - 1, 0)``),
    and ``pcp_world_size`` / ``dcp_world_size`` come from vLLM's groups."""
    from vllm_pcp.backend import PCPFlashInferImpl, PCPFlashInferMetadataBuilder

    module = tree("vllm_pcp.backend")
    plugin = cls(module, "PCPFlashInferImpl")
    read = (self_loads(plugin) - self_stores(plugin) - methods(plugin)) | \
        param_loads(module, "impl")
    _, impl, _ = make_builder(PCPFlashInferMetadataBuilder, dcp=2)
    assert read and {n for n in read if not hasattr(impl, n)} == set()
    assert (impl.pcp_world_size, impl.dcp_world_size) == (2, 2)
    assert impl.sliding_window == (-1, -1) and impl.sinks is None
    assert impl.logits_soft_cap is None and impl.head_size == 64
    assert impl.alibi_slopes is None and impl.kv_sharing_target_layer_name is None
    assert impl.kv_cache_dtype == "auto" and isinstance(impl, PCPFlashInferImpl)
    from vllm_pcp.config import PCPConfigError

    # vLLM keeps a window of W as (W - 1, 0): the plugin's layer check reads it back as W
    with pytest.raises(PCPConfigError, match="a sliding window of 16 tokens"):
        make_builder(PCPFlashInferMetadataBuilder, sliding_window=16)


def test_attention_layer_reaches_the_impls_overrides(make_builder, monkeypatch):
    """README I12. vLLM's attention layer leaves FlashInfer's cache write to
    ``unified_kv_cache_update``, which calls ``impl.do_kv_cache_update(layer, key, value,
    kv_cache, slot_mapping)`` with the layer's slot mapping: run on a real forward context,
    a slot mapping of N * P rows makes the plugin's override all-gather the P local rows
    over the PCP group first. ``unified_attention_with_output`` calls ``impl.forward``,
    and vLLM's forward writes zeros without metadata (profile runs)."""
    from vllm.config import CUDAGraphMode, set_current_vllm_config
    from vllm.forward_context import set_forward_context
    from vllm.model_executor.layers.attention import attention
    from vllm.v1.attention.backends.flashinfer import FlashInferBackend, FlashInferImpl

    import vllm_pcp.backend as backend
    from vllm_pcp.backend import PCPFlashInferMetadataBuilder

    source = tree("vllm.model_executor.layers.attention.attention")
    assert "not self.attn_backend.forward_includes_kv_cache_update" in \
        ast.unparse(func(cls(source, "Attention"), "forward"))
    assert FlashInferBackend.forward_includes_kv_cache_update is False
    _, impl, config = make_builder(PCPFlashInferMetadataBuilder)
    layer = config.compilation_config.static_forward_context["layers.0.attn"]
    layer.layer_name, layer.kv_cache = "layers.0.attn", torch.zeros(1)
    written = []
    monkeypatch.setattr(FlashInferImpl, "do_kv_cache_update",
                        lambda self, *args: written.append(args))
    monkeypatch.setattr(backend, "get_pcp_group", lambda: group(2, all_gather=lambda x, dim:
                                                                torch.cat([x, x + 100])))
    key, value = torch.ones(3, 2, 64), torch.zeros(3, 2, 64)
    slots = torch.arange(6)
    with set_current_vllm_config(config), set_forward_context(
            {"layers.0.attn": None}, config, slot_mapping={"layers.0.attn": slots},
            cudagraph_runtime_mode=CUDAGraphMode.NONE):
        assert backend._layer_metadata(layer) is None
        attention.unified_kv_cache_update(key, value, "layers.0.attn")
        out = torch.ones(3, 2, 64)
        attention.unified_attention_with_output(key, key, value, out, "layers.0.attn")
    [(got_layer, k, v, cache, slot_mapping)] = written
    assert got_layer is layer and cache is layer.kv_cache and slot_mapping is slots
    assert k.shape == (6, 2, 64) and (k[:3] == 1).all() and (k[3:] == 101).all()
    assert (v[3:] == 100).all() and (out == 0).all()


def test_kv_cache_views_are_what_vllms_flashinfer_reads(make_builder):
    """README I13. The plugin's K/V views of a layer's cache (its DCP attention and context
    reads) are the ones vLLM's FlashInfer forward hands FlashInfer, in every layout
    FlashInfer has a name for: the cache permuted by the layout's ``layer_view_order``,
    split into K and V by ``head_size``, zero-copy; the builder reads the layout vLLM
    resolved (``kv_cache_layout``)."""
    from vllm.utils.torch_utils import canonicalize_singleton_dim_strides
    from vllm.v1.attention.backends import utils
    from vllm.v1.kv_cache_layout import KVCacheLayout

    from vllm_pcp.backend import PCPFlashInferMetadataBuilder

    forward = ast.unparse(func(cls(tree("vllm.v1.attention.backends.flashinfer"),
                                   "FlashInferImpl"), "forward"))
    assert "stride_order = kv_cache_layout.layer_view_order" in forward
    assert "kv_cache_permute = kv_cache.permute(*stride_order)" in forward
    assert "kv_cache_tuple = kv_cache_permute.split(hs, dim=-1)" in forward
    builder, impl, config = make_builder(PCPFlashInferMetadataBuilder)
    assert builder.kv_cache_layout is config.cache_config.get_resolved_kv_cache_layout()
    for name in utils._FLASHINFER_LAYOUT_NAMES:
        order, shape = KVCacheLayout[name].layer_view_order, (5, 2, 16, 128)  # (B, H, N, 2D)
        cache = torch.randn([shape[i] for i in order]).permute(*[order.index(i)
                                                                 for i in range(4)])
        theirs = canonicalize_singleton_dim_strides(cache.permute(*order)).split(64, dim=-1)
        ours = impl._kv_views(cache, tuple(order))
        assert all(torch.equal(a, b) and a.stride() == b.stride() for a, b in zip(ours, theirs))
        assert ours[0].data_ptr() == cache.data_ptr()


# -- FlashInfer planning ------------------------------------------------------------------

def test_fast_plan_decode_takes_the_dcp_attention_arguments():
    """README I14. Every call of vLLM's ``fast_plan_decode`` in vllm_pcp/dcp/attention.py
    binds to its 0.33.0 signature (the decode wrapper first, then ``indptr_cpu, indices,
    last_page_len_cpu, seq_lens_cpu``), and its own call of the wrapper's ``plan`` binds
    to FlashInfer's."""
    from vllm.v1.attention.backends.flashinfer import fast_plan_decode

    names = {f"self.{k}" for k, v in kept("vllm_pcp.dcp.attention").items()
             if v == ("alias", "fast_plan_decode")}
    found = [c for name in names for c in calls(tree("vllm_pcp.dcp.attention"), name)]
    assert names and found
    for call in found:
        bind(fast_plan_decode, call)
    assert params(fast_plan_decode)[:9] == [
        "self", "indptr_cpu", "indices", "last_page_len_cpu", "seq_lens_cpu", "num_qo_heads",
        "num_kv_heads", "head_dim", "page_size"]
    [plan] = calls(func(tree("vllm.v1.attention.backends.flashinfer"), "fast_plan_decode"),
                   "self.plan")
    assert {k.arg: ast.unparse(k.value) for k in plan.keywords}["seq_lens"] == "seq_lens_cpu"
    bind(flashinfer_method(DECODE, "plan"), plan, bound_self=True)


@pytest.mark.parametrize("module", ["vllm_pcp.dcp.attention", "vllm_pcp.pcp.ragged"])
def test_flashinfer_wrappers_take_the_plugins_arguments(module):
    """README I15. Every FlashInfer call of the module binds: constructors, ``plan`` and
    ``run`` of the wrappers it builds, the merges it keeps; ``plan``/``run`` on a wrapper
    the source does not name (a parameter, a step's wrapper) to one of FlashInfer's three.
    No call sets ``lse_base``: the prefill wrappers return base-2 LSEs by default, the base
    the merges and vLLM's own FlashInfer DCP combine (``is_lse_base_on_e=False``) use."""
    import flashinfer

    held = kept(module)
    assert {v[1] for v in held.values() if v[0] == "instance"} <= set(WRAPPERS)
    bound = 0
    for call in (n for n in ast.walk(tree(module)) if isinstance(n, ast.Call)):
        callee = ast.unparse(call.func)
        head, _, method = callee.rpartition(".")
        assert "lse_base" not in {k.arg for k in call.keywords}, callee
        if callee.startswith("flashinfer."):
            bind(getattr(flashinfer, callee[11:]).__init__, call, bound_self=True)
        elif callee.startswith("self.") and held.get(callee[5:], ("",))[0] == "alias" \
                and held[callee[5:]][1] != "fast_plan_decode":
            bind(getattr(flashinfer, held[callee[5:]][1]), call)
        elif method in ("plan", "run") and held.get(head[5:], ("",))[0] == "instance":
            bind(flashinfer_method(held[head[5:]][1], method), call, bound_self=True)
        elif method in ("plan", "run") and head not in ("self", ""):
            errors = []
            for name in WRAPPERS:
                try:
                    bind(flashinfer_method(name, method), call, bound_self=True)
                    break
                except TypeError as exc:
                    errors.append(exc)
            else:
                raise AssertionError(f"{callee} binds to no FlashInfer wrapper: {errors}")
        else:
            continue
        bound += 1
    assert bound >= (12 if module.endswith("attention") else 3)
    for name in WRAPPERS[:2]:
        assert inspect.signature(flashinfer_method(name, "run")).parameters[
            "lse_base"].default == "log2"
    assert "is_lse_base_on_e=False" in ast.unparse(func(cls(tree(
        "vllm.v1.attention.backends.flashinfer"), "FlashInferImpl"), "__init__"))


# -- the DCP layout and process groups ----------------------------------------------------

@pytest.mark.parametrize("world,interleave,block_size", [
    (2, 1, 16), (2, 8, 16), (2, 16, 16), (4, 4, 16), (3, 2, 32), (4, 1, 32)])
def test_dcp_slot_mapping_is_the_layout_the_plugin_assumes(world, interleave, block_size):
    """README I16. The context-parallel arithmetic of MRV2's slot-mapping kernel
    (``_compute_slot_mappings_kernel``, what ``BlockTables.compute_slot_mappings`` runs with
    ``cp_size = dcp_size``), evaluated on the CPU, places token p on rank ``dcp_owner`` at
    local offset o = ``dcp_local_offset`` (vllm_pcp.dcp.layout), slot
    ``block_table[o // block_size] * block_size + o % block_size``, and gives the other
    ranks -1. vLLM requires the interleave to divide the block size."""
    from vllm.v1.attention.backends.utils import PAD_SLOT_ID

    from vllm_pcp.dcp.layout import dcp_local_offset, dcp_owner

    kernel = func(tree("vllm.v1.worker.gpu.block_table"), "_compute_slot_mappings_kernel")
    [(loop, cp)] = [(n, s) for n in ast.walk(kernel) if isinstance(n, ast.For)
                    for s in n.body if isinstance(s, ast.If)
                    and ast.unparse(s.test) == "CP_SIZE == 1"]
    after = loop.body[loop.body.index(cp) + 1:]
    assert [ast.unparse(s.targets[0]) for s in after if isinstance(s, ast.Assign)] == [
        "block_indices", "block_offsets", "block_numbers", "slot_ids", "slot_ids"]
    pos = np.arange(5 * block_size * world, dtype=np.int64)
    table = np.arange(100, 110, dtype=np.int64)  # one request's block-table row
    for rank in range(world):
        env = dict(positions=pos, kv_block_size=block_size, CP_SIZE=world, cp_rank=rank,
                   CP_INTERLEAVE=interleave, PAD_ID=PAD_SLOT_ID, sharded=np.True_,
                   mapping_enabled=np.True_, is_real_req=np.True_,
                   tl=SimpleNamespace(where=np.where))
        run_statements(cp.orelse, env)
        for stmt in after:
            if isinstance(stmt, ast.Assign) and ast.unparse(stmt.targets[0]) == "block_numbers":
                env["block_numbers"] = table[np.where(env["is_local"], env["block_indices"], 0)]
            elif not isinstance(stmt, ast.Expr):  # the store
                run_statements([stmt], env)
        owner = dcp_owner(torch.from_numpy(pos), world, interleave).numpy()
        local = dcp_local_offset(torch.from_numpy(pos), world, interleave).numpy()
        mine = owner == rank
        assert np.array_equal(env["is_local"], mine)
        expect = np.where(mine, table[local // block_size] * block_size + local % block_size, -1)
        assert np.array_equal(env["slot_ids"], expect)
    runner = func(cls(tree(RUNNER), "GPUModelRunner"), "initialize_kv_cache")
    [tables] = calls(runner, "BlockTables")
    assert {k.arg: ast.unparse(k.value) for k in tables.keywords if k.arg.startswith("cp_")} \
        == {"cp_size": "self.dcp_size", "cp_rank": "self.dcp_rank",
            "cp_interleave": "self.cp_interleave"}
    assert "block_size % self.parallel_config.cp_kv_cache_interleave_size == 0" in ast.unparse(
        func(cls(tree("vllm.config.vllm"), "VllmConfig"), "validate_block_size"))


@pytest.mark.parametrize("world,interleave", [(1, 1), (2, 1), (2, 8), (4, 4), (3, 16)])
def test_dcp_local_seq_lens_counts_the_tokens_a_rank_stores(world, interleave):
    """README I17. vllm_pcp.dcp.layout's calls bind to vLLM's ``get_dcp_local_seq_lens``,
    which counts, for one rank or (rank None) every rank, the first L tokens the slot
    mapping above gives it."""
    from vllm.v1.attention.backends.utils import get_dcp_local_seq_lens

    from vllm_pcp.dcp.layout import dcp_owner

    found = calls(tree("vllm_pcp.dcp.layout"), "get_dcp_local_seq_lens")
    assert len(found) >= 2
    for call in found:
        bind(get_dcp_local_seq_lens, call)
    assert params(get_dcp_local_seq_lens) == ["seq_lens", "dcp_size", "dcp_rank",
                                              "cp_kv_cache_interleave_size"]
    lens = torch.arange(0, 4 * world * interleave + 3)
    owner = dcp_owner(torch.arange(int(lens.max())), world, interleave)
    every = get_dcp_local_seq_lens(lens, world, None, interleave)
    for rank in range(world):
        expect = torch.tensor([int((owner[:n] == rank).sum()) for n in lens.tolist()])
        assert torch.equal(get_dcp_local_seq_lens(lens, world, rank, interleave).long(), expect)
        assert torch.equal(every[:, rank].long(), expect)


@pytest.mark.parametrize("tp,pcp", [(1, 2), (2, 2), (1, 4), (4, 2)])
def test_process_groups_are_what_the_plugin_uses(tp, pcp):
    """README I18. ``initialize_model_parallel``'s own rank arithmetic, evaluated on the
    CPU: with DCP = PCP every DCP group is a PCP group, as PCPModelRunner checks at
    start-up. GroupCoordinator has ``world_size``, ``rank_in_group``, ``ranks``,
    ``device_group``, ``all_gather(input_, dim)`` and no ``all_to_all`` of its own
    (vllm_pcp.pcp.exchange.all_to_all runs torch's on ``device_group``)."""
    from vllm.distributed import parallel_state
    from vllm.distributed.parallel_state import GroupCoordinator

    init = func(cls(tree("vllm.distributed.parallel_state"), "GroupCoordinator"), "__init__")
    assert {"world_size", "rank_in_group", "ranks", "device_group"} <= self_stores(init)
    assert params(GroupCoordinator.all_gather) == params(GroupCoordinator.reduce_scatter) \
        == ["self", "input_", "dim"]
    assert not hasattr(GroupCoordinator, "all_to_all")
    assert params(parallel_state.get_pcp_group) == params(parallel_state.get_dcp_group) == []
    fn = func(tree("vllm.distributed.parallel_state"), "initialize_model_parallel")
    [all_ranks] = [n for n in ast.walk(fn) if isinstance(n, ast.Assign)
                   and ast.unparse(n.targets[0]) == "all_ranks"]

    def block(name):  # the statements after ``global _X`` up to the group's creation
        start = next(i for i, s in enumerate(fn.body) if isinstance(s, ast.Global)
                     and s.names == [name])
        end = next(i for i, s in enumerate(fn.body) if i > start and isinstance(s, ast.Assign)
                   and ast.unparse(s.targets[0]) == name)
        return [s for s in fn.body[start + 1:end] if not isinstance(s, ast.Assert)]

    groups = {}
    for name in ("_DCP", "_PCP"):
        env = dict(torch=torch, world_size=tp * pcp, data_parallel_size=1,
                   pipeline_model_parallel_size=1, tensor_model_parallel_size=tp,
                   prefill_context_model_parallel_size=pcp,
                   decode_context_model_parallel_size=pcp, enable_elastic_ep=False,
                   local_all_ranks=None)
        groups[name] = run_statements([all_ranks] + block(name), env)["group_ranks"]
    assert sorted(groups["_DCP"]) == sorted(groups["_PCP"])
    assert all(len(g) == pcp for g in groups["_PCP"])


# -- MoE and CUDA graph modes ------------------------------------------------------------

def test_moe_layers_gather_and_reduce_scatter_over_the_pcp_group():
    """README I19. vLLM's MoE runner all-gathers an expert layer's tokens over the PCP
    group and reduce-scatters its output (the MoE refusal and decode policy of
    vllm_pcp/config.py and knobs.py); ``ModelConfig.is_moe`` says which models have such
    layers; the manager's MoE padding mask is on unless expert parallelism is."""
    from vllm.config import ModelConfig

    runner = cls(tree("vllm.model_executor.layers.fused_moe.runner.moe_runner"), "MoERunner")
    assert calls(func(runner, "_maybe_dispatch"), "get_pcp_group().all_gather")
    assert calls(func(runner, "_maybe_combine"), "get_pcp_group().reduce_scatter")
    assert isinstance(inspect.getattr_static(ModelConfig, "is_moe"), property)
    build = ast.unparse(func(tree(MANAGER), "maybe_build_pcp_manager"))
    assert "moe_gathers_tokens=not parallel_config.enable_expert_parallel" in build


def test_cuda_graph_modes_config_reads():
    """README I20. The CUDAGraphMode methods and members vllm_pcp/config.py uses exist and
    mean what it relies on: full graphs kept only as a separate decode routine, else
    piecewise or none (vLLM's own PCPManager.validate_config allows the same)."""
    from vllm.config import CUDAGraphMode

    used = {n.attr for n in ast.walk(tree("vllm_pcp.config")) if isinstance(n, ast.Attribute)
            and ast.unparse(n.value) in ("mode", "CUDAGraphMode")}
    assert {"has_full_cudagraphs", "separate_routine"} <= used
    assert all(hasattr(CUDAGraphMode, n) or hasattr(CUDAGraphMode.FULL, n) for n in used)
    M = CUDAGraphMode
    assert [m.has_full_cudagraphs() for m in (M.FULL, M.FULL_AND_PIECEWISE, M.FULL_DECODE_ONLY,
                                              M.PIECEWISE, M.NONE)] == [True] * 3 + [False] * 2
    assert [m.separate_routine() for m in (M.FULL, M.FULL_AND_PIECEWISE, M.FULL_DECODE_ONLY)] \
        == [False, True, True]
    assert [m.has_piecewise_cudagraphs() for m in (M.FULL_AND_PIECEWISE, M.FULL,
                                                   M.FULL_DECODE_ONLY)] == [True, False, False]
    assert "cudagraph_mode.has_full_cudagraphs()\n            and not " \
        "cudagraph_mode.separate_routine()" in inspect.getsource(
            importlib.import_module(MANAGER).PCPManager.validate_config)
