"""vLLM 0.26.0 internals that vllm-pcp's subclasses rely on, pinned on real vLLM objects.

``tests/test_vllm_seams.py`` pins the runtime patches and the signatures of the
methods the subclasses override; this file pins what those subclasses read,
write and call inside vLLM (the rows of ``vllm_pcp/patches/README.md``). Each
test asserts on vLLM's own classes: a real object built on the CPU where vLLM
allows it (``GPUModelRunner``, ``InputBatch``, the FlashInfer builder and impl,
``ForwardContext``, ``VllmConfig``), else ``inspect.signature``,
``dataclasses.fields`` or the source of the method, parsed with ``ast``. Where
the plugin's own code decides what is relied on (keyword names, attributes
read, fields written), the test parses the plugin's module too, so it follows
the code. Every test runs on CPU and GPU hosts alike.
"""
from __future__ import annotations

import ast
import dataclasses
import importlib.util
import inspect
import sys
from types import SimpleNamespace

import numpy as np
import pytest
import torch


# -- source helpers -----------------------------------------------------------------------

def _tree(module: str) -> ast.Module:
    """The AST of ``module``'s file, read without importing it."""
    with open(importlib.util.find_spec(module).origin) as f:
        return ast.parse(f.read())


def _class(tree: ast.AST, name: str) -> ast.ClassDef:
    return next(n for n in ast.walk(tree) if isinstance(n, ast.ClassDef) and n.name == name)


def _func(node: ast.AST, name: str) -> ast.FunctionDef:
    body = node.body if isinstance(node, (ast.ClassDef, ast.Module)) else []
    return next(n for n in body if isinstance(n, ast.FunctionDef) and n.name == name)


def _calls(node: ast.AST, dotted: str) -> list[ast.Call]:
    """Calls in ``node`` whose callee reads ``dotted`` (e.g. ``self._model_forward``)."""
    return [n for n in ast.walk(node)
            if isinstance(n, ast.Call) and ast.unparse(n.func) == dotted]


def _self_stores(node: ast.AST, name: str = "self") -> set[str]:
    """Attributes ``name.X`` assigned (plain or annotated) anywhere in ``node``."""
    out = set()
    for n in ast.walk(node):
        if isinstance(n, ast.Attribute) and isinstance(n.ctx, ast.Store) and \
                isinstance(n.value, ast.Name) and n.value.id == name:
            out.add(n.attr)
    return out


def _self_loads(node: ast.AST, name: str = "self") -> set[str]:
    return {n.attr for n in ast.walk(node)
            if isinstance(n, ast.Attribute) and isinstance(n.ctx, ast.Load)
            and isinstance(n.value, ast.Name) and n.value.id == name}


def _param_loads(tree: ast.Module, param: str) -> set[str]:
    """``param.X`` read by the module-level functions that take ``param``."""
    out = set()
    for fn in tree.body:
        if isinstance(fn, ast.FunctionDef) and param in {a.arg for a in fn.args.args}:
            out |= _self_loads(fn, param)
    return out


def _methods(cls: ast.ClassDef) -> set[str]:
    return {n.name for n in cls.body if isinstance(n, ast.FunctionDef)}


def _bind(fn, call: ast.Call, bound_self: bool = False) -> None:
    """Bind ``call``'s argument shape (positional count, keyword names) to ``fn``'s
    signature; raises TypeError if ``fn`` no longer takes them."""
    assert not any(isinstance(a, ast.Starred) for a in call.args), ast.unparse(call)
    assert all(k.arg is not None for k in call.keywords), ast.unparse(call)
    args = [None] * (len(call.args) + bound_self)
    inspect.signature(fn).bind(*args, **{k.arg: None for k in call.keywords})


# -- fixtures: real vLLM objects on the CPU -----------------------------------------------

@pytest.fixture
def make_config(tmp_path, monkeypatch):
    """``make(**parallel)``: vLLM's own VllmConfig of a tiny GQA model (8 query heads,
    2 KV heads, head size 8 x 8), Triton shown as present, as on a GPU host."""
    from vllm.config import AttentionConfig

    from helpers import real_vllm_config

    def make(**parallel):
        return real_vllm_config(tmp_path, monkeypatch, parallel,
                                hf=dict(hidden_size=512, num_hidden_layers=1),
                                attention_config=AttentionConfig(backend="FLASHINFER"))

    return make


@pytest.fixture
def unpinned(monkeypatch):
    """vLLM's buffers without pinned host memory (a CPU host has no driver to pin
    with; vLLM reads PIN_MEMORY at import and as a default argument)."""
    from vllm.v1.utils import CpuGpuBuffer

    for name, module in list(sys.modules.items()):
        if name.startswith("vllm") and getattr(module, "PIN_MEMORY", None) is True:
            monkeypatch.setattr(module, "PIN_MEMORY", False)
    monkeypatch.setitem(CpuGpuBuffer.__init__.__kwdefaults__, "pin_memory", False)


@pytest.fixture
def real_runner(make_config, unpinned, monkeypatch):
    """vLLM's own ``GPUModelRunner`` built on the CPU (no streams, no SM count)."""
    import vllm.v1.worker.gpu_model_runner as gmr
    from vllm.config import set_current_vllm_config

    class _NoStream:
        def __init__(self, *args, **kwargs):
            pass

        def __getattr__(self, name):
            return lambda *args, **kwargs: None

    monkeypatch.setattr(torch.cuda, "Stream", _NoStream)
    monkeypatch.setattr(torch.cuda, "Event", _NoStream)
    monkeypatch.setattr(gmr, "num_compute_units", lambda *args: 132)
    config = make_config(prefill_context_parallel_size=2)
    with set_current_vllm_config(config):
        return gmr.GPUModelRunner(config, torch.device("cpu"))


@pytest.fixture
def make_builder(make_config, monkeypatch):
    """``make(cls, sliding_window=None, **parallel)``: a real FlashInfer metadata
    builder (and its layer's impl) of one layer, on the CPU, off SM90."""
    from vllm.config import set_current_vllm_config
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    from helpers import attention_layer, flashinfer_on_cpu
    from vllm_pcp.backend import PCPFlashInferImpl

    flashinfer_on_cpu(monkeypatch)

    def make(cls, sliding_window=None, **parallel):
        config = make_config(**parallel)
        spec = FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=64,
                                 dtype=torch.bfloat16)
        with set_current_vllm_config(config):
            impl = PCPFlashInferImpl(8, 64, 0.125, 2, None, sliding_window, "auto")
            config.compilation_config.static_forward_context["layers.0.attn"] = \
                attention_layer(impl)
            builder = cls(spec, ["layers.0.attn"], config, torch.device("cpu"))
        return builder, impl, config

    return make


# -- the model runner ---------------------------------------------------------------------

def _runner_kwargs_read() -> tuple[set[str], set[str]]:
    """Keyword arguments PCPModelRunner._build_attention_metadata takes from vLLM's call:
    ``(read, required)``, ``required`` those it indexes (``kwargs["x"]``)."""
    fn = _func(_class(_tree("vllm_pcp.runner"), "PCPModelRunner"), "_build_attention_metadata")
    explicit = {a.arg for a in fn.args.args[1:] + fn.args.kwonlyargs}
    kw = fn.args.kwarg.arg if fn.args.kwarg else None
    read, required = set(explicit), set()
    for n in ast.walk(fn):
        if kw and isinstance(n, ast.Call) and ast.unparse(n.func) == f"{kw}.get" and \
                isinstance(n.args[0], ast.Constant):
            read.add(n.args[0].value)
        if kw and isinstance(n, ast.Subscript) and ast.unparse(n.value) == kw and \
                isinstance(n.slice, ast.Constant):
            read.add(n.slice.value)
            required.add(n.slice.value)
    assert read, "found no keyword read by PCPModelRunner._build_attention_metadata"
    return read, required


def test_build_attention_metadata_takes_every_kwarg_the_runner_reads():
    """README: GPUModelRunner._build_attention_metadata keyword arguments."""
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    read, _ = _runner_kwargs_read()
    params = inspect.signature(GPUModelRunner._build_attention_metadata).parameters
    assert read <= set(params), read - set(params)
    for name in read:
        assert params[name].kind is inspect.Parameter.POSITIONAL_OR_KEYWORD


def test_vllm_passes_those_arguments_by_keyword_at_every_call():
    """The override reads ``kwargs``: vLLM must pass them by name. Every call in
    gpu_model_runner.py passes no positional argument, and every argument the
    override indexes (``kwargs["x"]``) is passed at every call."""
    read, required = _runner_kwargs_read()
    calls = _calls(_tree("vllm.v1.worker.gpu_model_runner"), "self._build_attention_metadata")
    assert len(calls) >= 2  # execute_model and _dummy_run
    passed = set()
    for call in calls:
        assert not call.args, ast.unparse(call)
        names = {k.arg for k in call.keywords}
        assert required <= names, (required - names, ast.unparse(call))
        passed |= names
    assert read <= passed, read - passed


def test_execute_model_runs_the_seams_in_order():
    """README: the V1 step order. ``_prepare_inputs`` plans, ``_build_attention_metadata``
    consumes the plan, and ``_model_forward`` runs inside ``set_forward_context`` (whose
    fields the runner then rewrites), passed vLLM's per-layer slot mapping."""
    fn = _func(_class(_tree("vllm.v1.worker.gpu_model_runner"), "GPUModelRunner"),
               "execute_model")
    [prepare] = _calls(fn, "self._prepare_inputs")
    [build] = _calls(fn, "self._build_attention_metadata")
    [forward] = _calls(fn, "self._model_forward")
    assert prepare.lineno < build.lineno < forward.lineno
    assert {k.arg for k in forward.keywords} >= {"input_ids", "positions",
                                                 "intermediate_tensors", "inputs_embeds"}
    withs = [w for w in ast.walk(fn) if isinstance(w, ast.With)
             and forward in ast.walk(w)
             and any(ast.unparse(i.context_expr.func) == "set_forward_context"
                     for i in w.items if isinstance(i.context_expr, ast.Call))]
    assert withs, "_model_forward no longer runs inside set_forward_context"
    ctx = next(i.context_expr for i in withs[0].items
               if isinstance(i.context_expr, ast.Call)
               and ast.unparse(i.context_expr.func) == "set_forward_context")
    assert {"cudagraph_runtime_mode", "batch_descriptor", "slot_mapping"} <= \
        {k.arg for k in ctx.keywords}


def test_dummy_run_fills_optimistic_seq_lens_before_building_metadata():
    """README: optimistic_seq_lens_cpu. The DCP graph capture (no _prepare_inputs) plans
    vLLM's dummy decode batch from ``optimistic_seq_lens_cpu[:num_reqs]``: ``_dummy_run``
    must write it before it builds the capture's metadata."""
    runner = _class(_tree("vllm.v1.worker.gpu_model_runner"), "GPUModelRunner")
    fn = _func(runner, "_dummy_run")
    writes = [n.lineno for n in ast.walk(fn) if isinstance(n, ast.Assign)
              and any(isinstance(t, ast.Subscript)
                      and ast.unparse(t.value) == "self.optimistic_seq_lens_cpu"
                      for t in n.targets)]
    builds = [c for c in _calls(fn, "self._build_attention_metadata")
              if "for_cudagraph_capture" in {k.arg for k in c.keywords}]
    assert writes and builds and min(writes) < min(c.lineno for c in builds)


def test_sample_runs_once_a_step_before_the_ids_are_fed_back():
    """README: GPUModelRunner._sample. The check mode (vllm_pcp.pcp.agreement) compares
    the sampled ids in the ``_sample`` override: vLLM calls it exactly once, in
    ``sample_tokens`` (so every rank reaches the all-gather every step), before the ids
    reach the persistent batch (``_update_states_after_model_execute``, async
    scheduling's feedback) and the output (``_bookkeeping_sync``); it returns a
    ``SamplerOutput`` whose ``sampled_token_ids`` is ``[num_reqs, k]``."""
    from vllm.v1.outputs import SamplerOutput
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    assert list(inspect.signature(GPUModelRunner._sample).parameters) == [
        "self", "logits", "spec_decode_metadata"]
    runner = _class(_tree("vllm.v1.worker.gpu_model_runner"), "GPUModelRunner")
    assert len(_calls(runner, "self._sample")) == 1
    fn = _func(runner, "sample_tokens")
    [sample] = _calls(fn, "self._sample")
    [update] = _calls(fn, "self._update_states_after_model_execute")
    [bookkeeping] = _calls(fn, "self._bookkeeping_sync")
    assert sample.lineno < update.lineno < bookkeeping.lineno
    assert ast.unparse(update.args[0]) == "sampler_output.sampled_token_ids"
    assert "sampled_token_ids" in {f.name for f in dataclasses.fields(SamplerOutput)}
    plugin = _func(_class(_tree("vllm_pcp.runner"), "PCPModelRunner"), "_sample")
    assert [a.arg for a in plugin.args.args] == ["self", "logits", "spec_decode_metadata"]


def test_real_runner_has_the_state_the_subclass_reads(real_runner):
    """README: GPUModelRunner state. Every ``self.X`` PCPModelRunner reads and does not
    define itself is on vLLM's runner after ``__init__``, or assigned by one of vLLM's
    methods (``kv_cache_config``: ``initialize_kv_cache``). The types the runner uses."""
    from vllm.v1.worker.gpu_input_batch import InputBatch

    plugin = _class(_tree("vllm_pcp.runner"), "PCPModelRunner")
    own = _self_stores(plugin) | _methods(plugin)
    vllm_cls = _class(_tree("vllm.v1.worker.gpu_model_runner"), "GPUModelRunner")
    assigned_later = _self_stores(vllm_cls) | _methods(vllm_cls)
    missing = {name for name in _self_loads(plugin) - own
               if not hasattr(real_runner, name) and name not in assigned_later}
    assert not missing, missing
    assert "kv_cache_config" in _self_stores(_func(vllm_cls, "initialize_kv_cache"))

    r = real_runner
    lens = r.optimistic_seq_lens_cpu
    assert isinstance(lens, torch.Tensor) and lens.device.type == "cpu"
    assert lens.dtype == torch.int32 and lens.shape == (r.max_num_reqs,)
    assert isinstance(lens[:2].numpy(), np.ndarray)
    # set by calculate_reorder_batch_threshold once the attention groups exist
    assert r.reorder_batch_threshold is None
    assert "reorder_batch_threshold" in _self_stores(
        _func(vllm_cls, "calculate_reorder_batch_threshold"))
    assert type(r.positions) is torch.Tensor and r.positions.dtype == torch.int64
    assert r.positions.shape[0] >= r.max_num_tokens
    assert isinstance(r.input_batch, InputBatch) and r.attn_groups == []
    assert r.num_query_heads == 8
    assert r.model_config.get_num_kv_heads(r.parallel_config) == 2


def test_input_batch_and_block_table_accessors(real_runner):
    """README: InputBatch fields, block-table accessors (vLLM's real InputBatch)."""
    from vllm.v1.kv_cache_interface import KVCacheConfig, KVCacheGroupSpec

    batch = real_runner.input_batch
    assert batch.num_reqs == 0
    for array in (batch.num_computed_tokens_cpu, batch.num_prompt_tokens):
        assert isinstance(array, np.ndarray) and array.shape == (batch.max_num_reqs,)
    table = batch.block_table[0]
    device_rows = table.get_device_tensor(3)
    assert isinstance(device_rows, torch.Tensor) and device_rows.dtype == torch.int32
    assert device_rows.shape[0] == 3
    host = table.get_numpy_array()
    assert isinstance(host, np.ndarray) and host.shape == (batch.max_num_reqs,
                                                           device_rows.shape[1])
    host[0, 0] = 7  # the host array is the table vLLM copies to the device
    assert table.block_table.cpu[0, 0] == 7
    assert isinstance(table.block_size, int)
    assert {"kv_cache_groups"} <= {f.name for f in dataclasses.fields(KVCacheConfig)}
    assert {"layer_names", "kv_cache_spec"} <= \
        {f.name for f in dataclasses.fields(KVCacheGroupSpec)}


def test_attention_groups_hand_out_their_builder():
    """README: attn_groups. ``attn_group.layer_names`` and ``get_metadata_builder(0)``."""
    from vllm.v1.kv_cache_interface import FullAttentionSpec
    from vllm.v1.worker.utils import AttentionGroup

    from vllm_pcp.backend import PCPFlashInferBackend

    group = AttentionGroup(PCPFlashInferBackend, ["l0", "l1"],
                           FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=64,
                                             dtype=torch.bfloat16), 0)
    builder = object()
    group.metadata_builders = [builder]
    assert group.layer_names == ["l0", "l1"] and group.get_metadata_builder(0) is builder
    assert list(inspect.signature(AttentionGroup.get_metadata_builder).parameters) == [
        "self", "ubatch_id"]


@pytest.mark.parametrize("world,interleave,block_size", [
    (1, 1, 16), (2, 1, 16), (2, 8, 16), (2, 16, 16), (4, 4, 16), (3, 2, 32)])
def test_dcp_slot_mapping_is_the_layout_the_plugin_assumes(world, interleave, block_size):
    """README: vLLM's DCP slot mapping. The arithmetic of vLLM's Triton kernel
    (``_compute_slot_mapping_kernel``), evaluated on the CPU, places token p on rank
    ``dcp_owner`` at local offset o = ``dcp_local_offset`` (vllm_pcp.dcp.layout), slot
    ``block_table[o // block_size] * block_size + o % block_size``, and gives every
    other rank slot -1; ``compute_slot_mapping`` runs it over the DCP group with
    ``cp_kv_cache_interleave_size``."""
    from vllm.v1.worker.block_table import PAD_SLOT_ID

    from vllm_pcp.dcp.layout import dcp_local_offset, dcp_owner

    tree = _tree("vllm.v1.worker.block_table")
    kernel = _func(tree, "_compute_slot_mapping_kernel")
    wanted = ("virtual_block_size", "virtual_block_indices", "virtual_block_offsets",
              "is_local", "local_block_offsets", "block_indices", "slot_offsets")
    stmts = {n.targets[0].id: n for n in ast.walk(kernel) if isinstance(n, ast.Assign)
             and isinstance(n.targets[0], ast.Name) and n.targets[0].id in wanted}
    assert set(stmts) == set(wanted), set(wanted) - set(stmts)
    slot_stmts = [n for n in ast.walk(kernel) if isinstance(n, ast.Assign)
                  and ast.unparse(n.targets[0]) == "slot_ids"]
    assert [ast.unparse(n.value) for n in slot_stmts][-1] == \
        "tl.where(is_local, slot_ids, PAD_ID)"
    pos = np.arange(5 * block_size * world, dtype=np.int64)
    table = np.arange(100, 110, dtype=np.int64)  # one request's block-table row

    def run(stmts, env):
        for stmt in stmts:
            exec(compile(ast.Module([stmt], []), "<kernel>", "exec"), {}, env)

    for rank in range(world):
        env = dict(pos=pos, KV_CACHE_BLOCK_SIZE=block_size, TOTAL_CP_WORLD_SIZE=world,
                   TOTAL_CP_RANK=rank, CP_KV_CACHE_INTERLEAVE_SIZE=interleave,
                   BLOCKS_PER_KV_BLOCK=1, block_size=block_size, PAD_ID=PAD_SLOT_ID,
                   tl=SimpleNamespace(where=np.where))
        run([stmts[name] for name in wanted if name != "slot_offsets"], env)
        env["block_numbers"] = table[np.where(env["is_local"], env["block_indices"], 0)]
        run([stmts["slot_offsets"]] + slot_stmts, env)
        owner = dcp_owner(torch.from_numpy(pos), world, interleave).numpy()
        local = dcp_local_offset(torch.from_numpy(pos), world, interleave).numpy()
        mine = owner == rank
        assert np.array_equal(env["is_local"], mine)
        assert np.array_equal(env["block_indices"][mine], local[mine] // block_size)
        assert np.array_equal(env["slot_offsets"][mine], local[mine] % block_size)
        # this rank's tokens at block_table[o // block_size], slot o % block_size; -1 else
        expect = np.where(mine, table[local // block_size] * block_size + local % block_size,
                          -1)
        assert np.array_equal(env["slot_ids"], expect)
    [launch] = [c for c in ast.walk(_func(_class(tree, "BlockTable"), "compute_slot_mapping"))
                if isinstance(c, ast.Call) and isinstance(c.func, ast.Subscript)]
    kw = {k.arg: ast.unparse(k.value) for k in launch.keywords}
    assert kw["TOTAL_CP_WORLD_SIZE"] == "self.dcp_world_size"
    assert kw["TOTAL_CP_RANK"] == "self.dcp_rank"
    assert kw["CP_KV_CACHE_INTERLEAVE_SIZE"] == "self.cp_kv_cache_interleave_size"
    assert kw["PAD_ID"] == "PAD_SLOT_ID" and PAD_SLOT_ID == -1


@pytest.mark.parametrize("world,interleave", [(1, 1), (2, 1), (2, 8), (4, 4), (3, 16)])
def test_dcp_local_seq_lens_counts_the_tokens_a_rank_stores(world, interleave):
    """README: vLLM's DCP slot mapping (get_dcp_local_seq_lens). vllm_pcp.dcp.layout's call
    binds to vLLM's helper, which counts, for every rank, the first L tokens the slot
    mapping above gives it."""
    from vllm.v1.attention.backends.utils import get_dcp_local_seq_lens

    from vllm_pcp.dcp.layout import dcp_owner

    calls = _calls(_tree("vllm_pcp.dcp.layout"), "get_dcp_local_seq_lens")
    assert calls, "vllm_pcp/dcp/layout.py no longer calls get_dcp_local_seq_lens"
    for call in calls:
        _bind(get_dcp_local_seq_lens, call)
    assert list(inspect.signature(get_dcp_local_seq_lens).parameters) == [
        "seq_lens", "dcp_size", "dcp_rank", "cp_kv_cache_interleave_size"]
    lens = torch.arange(0, 4 * world * interleave + 3)
    owner = dcp_owner(torch.arange(int(lens.max())), world, interleave)
    for rank in range(world):
        expect = torch.tensor([int((owner[:n] == rank).sum()) for n in lens.tolist()])
        got = get_dcp_local_seq_lens(lens, world, rank, interleave)
        assert torch.equal(got.to(torch.int64), expect)


def test_allocate_slots_caches_the_blocks_it_allocates():
    """README: prefix caching at allocation (vllm_pcp.dcp.prefix). ``allocate_slots``
    caches blocks up to the tokens the step will compute, so another request of the
    same step can hit them before they are written."""
    fn = _func(_class(_tree("vllm.v1.core.kv_cache_manager"), "KVCacheManager"),
               "allocate_slots")
    [cache] = _calls(fn, "self.coordinator.cache_blocks")
    assert [ast.unparse(a) for a in cache.args] == ["request", "num_tokens_to_cache"]
    assert "total_computed_tokens + num_new_tokens" in ast.unparse(fn)


# -- the worker ---------------------------------------------------------------------------

def test_worker_init_device_builds_the_runner_the_plugin_swaps():
    """README: Worker.init_device / model_runner. vLLM's init_device ends by building
    the V1 runner as ``self.model_runner`` from ``(self.vllm_config, self.device)`` and
    touches it no more; ``use_v2_model_runner`` is set in ``__init__``."""
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner
    from vllm.v1.worker.gpu_worker import Worker

    cls = _class(_tree("vllm.v1.worker.gpu_worker"), "Worker")
    init = ast.unparse(_func(cls, "__init__"))
    assert "self.use_v2_model_runner = vllm_config.use_v2_model_runner" in init
    fn = _func(cls, "init_device")
    assert "device" in _self_stores(fn)
    [v1] = [n for n in ast.walk(fn) if isinstance(n, ast.Assign)
            and ast.unparse(n) == "self.model_runner = GPUModelRunnerV1(self.vllm_config, "
                                  "self.device)"]
    assert "from vllm.v1.worker.gpu_model_runner import GPUModelRunner as " \
           "GPUModelRunnerV1" in ast.unparse(fn)
    later = [s for s in fn.body if s.lineno > v1.lineno]
    assert not any("model_runner" in ast.unparse(s) for s in later)
    assert list(inspect.signature(Worker.init_device).parameters) == ["self"]
    assert list(inspect.signature(GPUModelRunner.__init__).parameters) == [
        "self", "vllm_config", "device"]


# -- the attention backend ----------------------------------------------------------------

def test_flashinfer_override_is_what_vllm_selects():
    """README: register_backend(FLASHINFER). After ``register()`` the enum resolves to the
    plugin's class; its ``validate_configuration`` (which the CUDA platform runs on the
    class ``get_class()`` returns) accepts PCP, which stock FlashInfer refuses."""
    from vllm.platforms.interface import DeviceCapability
    from vllm.v1.attention.backends.flashinfer import FlashInferBackend, FlashInferImpl
    from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend
    from vllm.v1.attention.selector import AttentionSelectorConfig

    import vllm_pcp
    from vllm_pcp.backend import PCPFlashInferBackend

    vllm_pcp.register()
    assert list(inspect.signature(register_backend).parameters) == [
        "backend", "class_path", "is_mamba"]
    flashinfer = AttentionBackendEnum.FLASHINFER
    assert flashinfer.is_overridden()
    assert flashinfer.get_path() == "vllm_pcp.backend.PCPFlashInferBackend"
    assert flashinfer.get_class() is PCPFlashInferBackend
    assert PCPFlashInferBackend.full_cls_name() == ("vllm_pcp.backend", "PCPFlashInferBackend")
    selector = AttentionSelectorConfig(head_size=128, dtype=torch.bfloat16,
                                       kv_cache_dtype="auto", block_size=16, use_pcp=True)
    args = dict(selector._asdict(), device_capability=DeviceCapability(9, 0))
    assert "PCP not supported" in FlashInferBackend.validate_configuration(**args)
    assert flashinfer.get_class().validate_configuration(**args) == []
    # the CUDA platform resolves every backend through get_class()
    cuda = _tree("vllm.platforms.cuda")
    assert ast.unparse(_func(cuda, "_get_attn_backend_class")).endswith(
        "return backend.get_class()")
    platform = _class(cuda, "CudaPlatformBase")
    for method in ("get_valid_backends", "get_attn_backend_cls"):
        assert _calls(_func(platform, method), "_get_attn_backend_class"), method
    assert "use_pcp=vllm_config.parallel_config.prefill_context_parallel_size > 1" in \
        ast.unparse(_tree("vllm.v1.attention.selector"))
    # DCP's start-up check reads the impl's LSE flag: FlashInfer's stays on
    assert FlashInferImpl.can_return_lse_for_decode is True
    cp_check = ast.unparse(_func(_tree("vllm.v1.worker.cp_utils"),
                                 "check_attention_cp_compatibility"))
    assert "backend.supports_pcp()" in cp_check
    assert "layer_impl.need_to_return_lse_for_decode" in cp_check


def test_grow_row_buffers_replaces_buffers_vllm_makes_and_reads():
    """README: grow_row_buffers. Every attribute ``grow_row_buffers`` touches is made by
    FlashInferMetadataBuilder.__init__ (or is its method), and every buffer it replaces
    is read again by the builder's planning methods, so the larger one is used."""
    from vllm_pcp import backend

    fn = _func(_tree("vllm_pcp.backend"), "grow_row_buffers")
    touched = _self_loads(fn, "builder") | _self_stores(fn, "builder")
    replaced = _self_stores(fn, "builder")
    assert replaced, "grow_row_buffers replaces no builder attribute"
    vllm_cls = _class(_tree("vllm.v1.attention.backends.flashinfer"),
                      "FlashInferMetadataBuilder")
    made = _self_stores(_func(vllm_cls, "__init__")) | _methods(vllm_cls)
    assert touched <= made, touched - made
    readers = [m for m in vllm_cls.body if isinstance(m, ast.FunctionDef)
               and m.name != "__init__"]
    for name in replaced:
        assert any(name in _self_loads(m) for m in readers), name
    params = list(inspect.signature(backend.FlashInferMetadataBuilder._make_buffer).parameters)
    assert params == ["self", "size", "dtype"]


def test_real_builders_size_their_row_buffers_as_grow_row_buffers_expects(make_builder):
    """README: grow_row_buffers. vLLM's builder sizes its per-row buffers for
    ``max_num_seqs`` rows of ``cdiv(max_model_len, block_size)`` pages; at PCP > 1 the
    plugin's builder has them for twice the rows, same pages per row."""
    from vllm.v1.attention.backends.flashinfer import FlashInferMetadataBuilder
    from vllm.v1.utils import CpuGpuBuffer

    from vllm_pcp.backend import PCPFlashInferMetadataBuilder

    stock, _, config = make_builder(FlashInferMetadataBuilder, prefill_context_parallel_size=2)
    rows = config.scheduler_config.max_num_seqs
    pages = -(-config.model_config.max_model_len // 16)
    for name in ("paged_kv_indptr", "paged_kv_indices", "paged_kv_last_page_len"):
        assert isinstance(getattr(stock, name), CpuGpuBuffer), name
    assert stock.paged_kv_indptr.cpu.shape == (rows + 1,)
    assert stock.paged_kv_indptr_cpu_buffer.shape == (rows + 1,)
    assert stock.paged_kv_indices.cpu.shape == (rows * pages,)
    assert stock.paged_kv_last_page_len.cpu.shape == (rows,)
    assert isinstance(stock.pin_memory, bool)
    grown, _, _ = make_builder(PCPFlashInferMetadataBuilder, prefill_context_parallel_size=2)
    assert grown.paged_kv_indptr.cpu.shape == (2 * rows + 1,)
    assert grown.paged_kv_indptr_cpu_buffer.shape == (2 * rows + 1,)
    assert grown.paged_kv_indices.cpu.shape == (2 * rows * pages,)
    assert grown.paged_kv_last_page_len.cpu.shape == (2 * rows,)
    assert isinstance(grown.paged_kv_indptr.np, np.ndarray)


def test_real_builder_has_what_the_plugins_builder_reads(make_builder):
    """README: FlashInferMetadataBuilder attributes. Every ``self.X`` that
    PCPFlashInferMetadataBuilder reads and does not define, and every ``builder.X`` of
    vllm_pcp/backend.py's helpers, is on vLLM's real builder (grown at PCP > 1), with
    the values build_dcp plans with."""
    from vllm_pcp.backend import PCPFlashInferImpl, PCPFlashInferMetadataBuilder

    tree = _tree("vllm_pcp.backend")
    plugin = _class(tree, "PCPFlashInferMetadataBuilder")
    own = _self_stores(plugin) | _methods(plugin) | {"_dcp_attention"}
    read = (_self_loads(plugin) - own) | _param_loads(tree, "builder")
    builder, _, _ = make_builder(PCPFlashInferMetadataBuilder, prefill_context_parallel_size=2)
    assert read and not {n for n in read if not hasattr(builder, n)}
    assert (builder.num_qo_heads, builder.num_kv_heads, builder.head_dim,
            builder.page_size) == (8, 2, 64, 16)
    assert builder.q_data_type_prefill == torch.bfloat16
    assert builder.global_hyperparameters.sm_scale == 0.125
    assert builder.global_hyperparameters.has_same_all_params is True  # one layer
    assert builder.dcp_world_size == 1 and builder.reorder_batch_threshold == 1
    assert builder.vllm_config.parallel_config.prefill_context_parallel_size == 2
    # what decides the ragged kernel of fresh split steps (vllm_pcp.pcp.ragged)
    assert (builder.cache_dtype, builder.window_left, builder.logits_soft_cap,
            builder.has_sinks) == ("auto", -1, None, False)
    assert builder.can_attend_ragged() and builder.device.type in ("cpu", "cuda")
    assert list(inspect.signature(builder._get_workspace_buffer).parameters) == []
    from vllm.v1.attention.backends.utils import get_per_layer_parameters

    assert list(inspect.signature(get_per_layer_parameters).parameters) == [
        "vllm_config", "layer_names", "cls_"]
    [params] = get_per_layer_parameters(builder.vllm_config, ["layers.0.attn"],
                                        PCPFlashInferImpl).values()
    assert params.sm_scale == 0.125


def test_flashinfer_metadata_counts_the_local_rows():
    """README: FlashInferMetadata. vLLM's builder returns FlashInferMetadata, whose
    ``num_actual_tokens`` the plugin's split metadata reports as the local rows."""
    from vllm.v1.attention.backends.flashinfer import (FlashInferMetadata,
                                                       FlashInferMetadataBuilder)

    assert dataclasses.is_dataclass(FlashInferMetadata)
    assert "num_actual_tokens" in {f.name for f in dataclasses.fields(FlashInferMetadata)}
    assert inspect.signature(FlashInferMetadataBuilder.build).return_annotation in (
        FlashInferMetadata, "FlashInferMetadata")


def test_real_impl_has_the_settings_the_plugin_checks(make_builder):
    """README: FlashInferImpl attributes. What PCPFlashInferImpl and the helpers taking
    ``impl`` read is on vLLM's impl, in the encoding they test (no window
    ``(-1, -1)``, a window of W ``(W - 1, 0)``)."""
    from vllm_pcp.backend import PCPFlashInferImpl, PCPFlashInferMetadataBuilder

    tree = _tree("vllm_pcp.backend")
    plugin = _class(tree, "PCPFlashInferImpl")
    read = (_self_loads(plugin) - _self_stores(plugin) - _methods(plugin)) | \
        _param_loads(tree, "impl")
    _, impl, _ = make_builder(PCPFlashInferMetadataBuilder, prefill_context_parallel_size=2)
    assert read and not {n for n in read if not hasattr(impl, n)}
    assert (impl.dcp_world_size, impl.pcp_world_size) == (1, 1)  # no groups in a test
    assert impl.sliding_window == (-1, -1) and impl.sinks is None
    assert impl.logits_soft_cap is None and impl.head_size == 64
    assert impl.alibi_slopes is None and impl.kv_sharing_target_layer_name is None
    assert impl.kv_cache_dtype == "auto"
    assert isinstance(impl, PCPFlashInferImpl) and impl.supports_pcp
    _, windowed, _ = make_builder(PCPFlashInferMetadataBuilder, sliding_window=16,
                                  prefill_context_parallel_size=2)
    assert windowed.sliding_window == (15, 0)


def test_attention_layer_calls_the_methods_the_impl_overrides():
    """README: do_kv_cache_update, FlashInferImpl.forward. FlashInfer leaves the cache
    write to the layer (``forward_includes_kv_cache_update`` False), and the calls vLLM's
    attention layer makes bind to the plugin's overrides; the layer's name is the key of
    the forward context's per-layer dicts."""
    from vllm.v1.attention.backends.flashinfer import FlashInferBackend

    from vllm_pcp.backend import PCPFlashInferBackend, PCPFlashInferImpl

    assert FlashInferBackend.forward_includes_kv_cache_update is False
    assert PCPFlashInferBackend.forward_includes_kv_cache_update is False
    tree = _tree("vllm.model_executor.layers.attention.attention")
    [update] = _calls(tree, "attn_layer.impl.do_kv_cache_update")
    _bind(PCPFlashInferImpl.do_kv_cache_update, update, bound_self=True)
    [forward] = _calls(tree, "self.impl.forward")
    _bind(PCPFlashInferImpl.forward, forward, bound_self=True)
    layer = _class(tree, "Attention")
    assert "not self.attn_backend.forward_includes_kv_cache_update" in \
        ast.unparse(_func(layer, "forward"))
    assert "self.layer_name = prefix" in ast.unparse(_func(layer, "__init__"))
    context = ast.unparse(_func(tree, "get_attention_context"))
    assert "attn_metadata_raw[layer_name]" in context
    assert "slot_mapping.get(layer_name)" in context


def test_kv_cache_layout_the_plugin_views(make_builder, monkeypatch):
    """README: KV cache layout. FlashInfer's cache is ``(B, H, N, 2 * head)`` permuted
    by ``get_kv_cache_stride_order``; the plugin's K/V views of it are the K/V that
    vLLM's own ``do_kv_cache_update`` writes."""
    import vllm.v1.attention.backends.flashinfer as flashinfer
    from vllm.utils.torch_utils import canonicalize_singleton_dim_strides

    from vllm_pcp.backend import PCPFlashInferMetadataBuilder

    assert flashinfer.FlashInferBackend.get_kv_cache_shape(5, 16, 2, 64) == (5, 2, 16, 128)
    assert list(inspect.signature(
        flashinfer.FlashInferBackend.get_kv_cache_stride_order).parameters) == [
        "include_num_layers_dimension"]
    assert list(inspect.signature(canonicalize_singleton_dim_strides).parameters) == ["t"]
    # the layout the plugin plans DCP attention with is the one the stride order reads
    from vllm.v1.attention.backends.utils import get_kv_cache_layout

    assert flashinfer.get_kv_cache_layout is get_kv_cache_layout
    assert list(inspect.signature(get_kv_cache_layout).parameters) == []
    update = ast.unparse(_func(_class(_tree("vllm.v1.attention.backends.flashinfer"),
                                      "FlashInferImpl"), "do_kv_cache_update"))
    assert "kv_cache.transpose(1, 2).split(self.head_size, dim=-1)" in update
    _, impl, _ = make_builder(PCPFlashInferMetadataBuilder, prefill_context_parallel_size=2)
    for layout, order in (("NHD", (0, 2, 1, 3)), ("HND", (0, 1, 2, 3))):
        monkeypatch.setattr(flashinfer, "get_kv_cache_layout", lambda: layout)
        assert flashinfer.FlashInferBackend.get_kv_cache_stride_order() == order
        shape = flashinfer.FlashInferBackend.get_kv_cache_shape(5, 16, 2, 64)
        # as vLLM allocates it: memory in stride order, seen as (B, H, N, 2 * head)
        inverse = [order.index(i) for i in range(4)]
        cache = torch.randn([shape[i] for i in order]).permute(*inverse)
        k, v = impl._kv_views(cache)
        written_k, written_v = cache.transpose(1, 2).split(64, dim=-1)  # (B, N, H, D)
        if layout == "HND":  # the plugin's views are (B, H, N, D) there
            written_k, written_v = written_k.transpose(1, 2), written_v.transpose(1, 2)
        assert torch.equal(k, written_k) and torch.equal(v, written_v)
        assert k.data_ptr() == cache.data_ptr()  # zero-copy


def _dcp_attention_names() -> dict[str, tuple[str, str]]:
    """What DCPAttention.__init__ keeps: ``self.X`` -> ``("instance", "flashinfer.C")``
    for a wrapper it builds, ``("alias", "flashinfer.f")`` for a FlashInfer class or
    function it keeps, ``("alias", "fast_plan_decode")``."""
    init = _func(_class(_tree("vllm_pcp.dcp.attention"), "DCPAttention"), "__init__")
    kept = {}
    for n in ast.walk(init):
        if not isinstance(n, ast.Assign):
            continue
        for target in n.targets:
            pairs = (zip(target.elts, n.value.elts) if isinstance(target, ast.Tuple)
                     else [(target, n.value)])
            for t, v in pairs:
                if not (isinstance(t, ast.Attribute) and ast.unparse(t.value) == "self"):
                    continue
                text = ast.unparse(v.func if isinstance(v, ast.Call) else v)
                if isinstance(v, ast.Call) and text.startswith("flashinfer."):
                    kept[t.attr] = ("instance", text)
                elif isinstance(v, ast.Call) and text.startswith("self.") and \
                        kept.get(text[5:], ("",))[0] == "alias":
                    kept[t.attr] = ("instance", kept[text[5:]][1])
                elif text.startswith("flashinfer.") or text == "fast_plan_decode":
                    kept[t.attr] = ("alias", text)
    return kept


def _resolve(text: str):
    import flashinfer
    from vllm.v1.attention.backends import flashinfer as vllm_flashinfer

    if text == "fast_plan_decode":
        return vllm_flashinfer.fast_plan_decode
    return getattr(flashinfer, text.split(".", 1)[1])


def test_fast_plan_decode_takes_the_dcp_attention_arguments():
    """README: fast_plan_decode. Every call of it in vllm_pcp/dcp/attention.py binds to
    vLLM's signature (the decode wrapper passed as its ``self``)."""
    from vllm.v1.attention.backends.flashinfer import fast_plan_decode

    names = [f"self.{k}" for k, v in _dcp_attention_names().items()
             if v == ("alias", "fast_plan_decode")] + ["fast_plan_decode"]
    tree = _tree("vllm_pcp.dcp.attention")
    calls = [c for name in names for c in _calls(tree, name)]
    assert calls, "vllm_pcp/dcp/attention.py no longer calls fast_plan_decode"
    for call in calls:
        _bind(fast_plan_decode, call)
    params = inspect.signature(fast_plan_decode).parameters
    assert list(params)[:8] == ["self", "indptr_cpu", "indices", "last_page_len_cpu",
                                "num_qo_heads", "num_kv_heads", "head_dim", "page_size"]


def test_flashinfer_wrappers_take_the_dcp_attention_arguments():
    """README: FlashInfer wrappers (vLLM 0.26.0 pins flashinfer-python 0.6.14). Every
    FlashInfer call of vllm_pcp/dcp/attention.py binds: constructors and the
    ``plan``/``run`` of the wrappers DCPAttention builds to that wrapper's method; kept
    functions (merges) to theirs; ``plan``/``run`` on a wrapper the source does not
    name (a parameter, a step's wrapper) to one of FlashInfer's three wrappers."""
    import flashinfer

    assert flashinfer.__version__ == "0.6.14"
    wrappers = [flashinfer.BatchPrefillWithRaggedKVCacheWrapper,
                flashinfer.BatchPrefillWithPagedKVCacheWrapper,
                flashinfer.BatchDecodeWithPagedKVCacheWrapper]
    kept = _dcp_attention_names()
    assert {v[1] for v in kept.values() if v[0] == "instance"} >= {
        "flashinfer.BatchPrefillWithRaggedKVCacheWrapper",
        "flashinfer.BatchPrefillWithPagedKVCacheWrapper",
        "flashinfer.BatchDecodeWithPagedKVCacheWrapper"}
    bound = 0
    for call in ast.walk(_tree("vllm_pcp.dcp.attention")):
        if not isinstance(call, ast.Call):
            continue
        callee = ast.unparse(call.func)
        head, _, method = callee.rpartition(".")
        attr = callee[5:] if callee.startswith("self.") else None
        if callee.startswith("flashinfer."):
            _bind(_resolve(callee).__init__, call, bound_self=True)
        elif attr in kept and kept[attr][1] != "fast_plan_decode":
            target = _resolve(kept[attr][1])
            if inspect.isclass(target):
                _bind(target.__init__, call, bound_self=True)
            else:
                _bind(target, call)
        elif method in ("plan", "run") and head.startswith("self.") and \
                head[5:] in kept and kept[head[5:]][0] == "instance":
            _bind(getattr(_resolve(kept[head[5:]][1]), method), call, bound_self=True)
        elif method in ("plan", "run") and head not in ("self", ""):
            errors = []
            for cls in wrappers:
                try:
                    _bind(getattr(cls, method), call, bound_self=True)
                    break
                except TypeError as exc:
                    errors.append(exc)
            else:
                raise AssertionError(f"{ast.unparse(call)} binds to no FlashInfer "
                                     f"wrapper's {method}: {errors}")
        else:
            continue
        bound += 1
    assert bound >= 10


# -- the forward context ------------------------------------------------------------------

def _forward_context_writes() -> set[str]:
    """Fields PCPModelRunner assigns on the object ``get_forward_context()`` returns."""
    plugin = _class(_tree("vllm_pcp.runner"), "PCPModelRunner")
    out = set()
    for fn in ast.walk(plugin):
        if not isinstance(fn, ast.FunctionDef):
            continue
        names = {t.id for n in ast.walk(fn) if isinstance(n, ast.Assign)
                 and ast.unparse(n.value) == "get_forward_context()"
                 for t in n.targets if isinstance(t, ast.Name)}
        for name in names:
            out |= _self_stores(fn, name)
    assert out, "found no forward-context write in PCPModelRunner"
    return out


def test_forward_context_takes_the_runners_writes(make_config):
    """README: ForwardContext fields. The fields the runner writes are ForwardContext's;
    written into vLLM's real context they take (``cudagraph_runtime_mode`` is
    validated), vLLM's own ``get_attention_context`` still finds the layer's metadata
    and slot mapping by layer name, and so does the backend's metadata lookup."""
    from vllm.config import CUDAGraphMode
    from vllm.forward_context import ForwardContext, get_forward_context, set_forward_context
    from vllm.model_executor.layers.attention.attention import get_attention_context

    from vllm_pcp import backend

    lookups = [fn.name for fn in _tree("vllm_pcp.backend").body
               if isinstance(fn, ast.FunctionDef)
               and "get_forward_context().attn_metadata" in ast.unparse(fn)]
    assert len(lookups) == 1, lookups
    layer_metadata = getattr(backend, lookups[0])
    writes = _forward_context_writes()
    fields = {f.name for f in dataclasses.fields(ForwardContext)}
    assert writes <= fields, writes - fields
    assert {"attn_metadata", "no_compile_layers"} <= fields
    assert {"NONE", "FULL_DECODE_ONLY"} <= set(CUDAGraphMode.__members__)
    config = make_config(prefill_context_parallel_size=2)
    layer = SimpleNamespace(layer_name="layers.0.attn", kv_cache=torch.zeros(1))
    config.compilation_config.static_forward_context[layer.layer_name] = layer
    metadata = SimpleNamespace(exchange="exchange")
    stock, gathered = torch.arange(4), torch.arange(8)
    with set_forward_context({layer.layer_name: metadata}, config,
                             slot_mapping={layer.layer_name: stock},
                             cudagraph_runtime_mode=CUDAGraphMode.NONE):
        ctx = get_forward_context()
        assert isinstance(ctx, ForwardContext)
        values = dict(slot_mapping={layer.layer_name: gathered},
                      cudagraph_runtime_mode=CUDAGraphMode.NONE, batch_descriptor=None,
                      is_padding=None)
        for name in writes:  # what the runner writes, as it writes it
            setattr(ctx, name, values[name])
        md, attn_layer, kv_cache, slots = get_attention_context(layer.layer_name)
        assert md is metadata and attn_layer is layer
        assert slots is (gathered if "slot_mapping" in writes else stock)
        assert layer_metadata(layer) is metadata


# -- CommonAttentionMetadata --------------------------------------------------------------

def _common_metadata_keywords() -> list[set[str]]:
    """Keyword names of each CommonAttentionMetadata(...) call in vllm_pcp/runner.py,
    ``**name`` expanded where ``name = dict(...)`` in the same function."""
    out = []
    for fn in ast.walk(_tree("vllm_pcp.runner")):
        if not isinstance(fn, ast.FunctionDef):
            continue
        dicts = {n.targets[0].id: {k.arg for k in n.value.keywords}
                 for n in ast.walk(fn) if isinstance(n, ast.Assign)
                 and isinstance(n.targets[0], ast.Name) and isinstance(n.value, ast.Call)
                 and ast.unparse(n.value.func) == "dict"}
        for call in _calls(fn, "CommonAttentionMetadata"):
            names = set()
            for k in call.keywords:
                names |= {k.arg} if k.arg else dicts[ast.unparse(k.value)]
            out.append(names)
    return out


def test_common_attention_metadata_takes_the_runners_keywords():
    """README: CommonAttentionMetadata fields. Each of the runner's calls names only
    fields of vLLM's dataclass and every field without a default, and builds a real
    one."""
    from vllm.v1.attention.backend import CommonAttentionMetadata

    calls = _common_metadata_keywords()
    assert calls, "found no CommonAttentionMetadata(...) call in vllm_pcp/runner.py"
    fields = dataclasses.fields(CommonAttentionMetadata)
    names = {f.name for f in fields if f.init}
    required = {f.name for f in fields if f.init and f.default is dataclasses.MISSING
                and f.default_factory is dataclasses.MISSING}
    for keywords in calls:
        assert keywords <= names, keywords - names
        assert required <= keywords, required - keywords
        values = {k: torch.zeros(2, dtype=torch.int32) for k in keywords}
        values.update({k: 2 for k in keywords & {"num_reqs", "num_actual_tokens",
                                                 "max_query_len", "max_seq_len"}})
        values.update({k: True for k in keywords & {"causal"}})
        assert CommonAttentionMetadata(**values).num_reqs == 2


# -- process groups -----------------------------------------------------------------------

def test_group_coordinator_has_what_the_exchanges_use():
    """README: GroupCoordinator. ``world_size``, ``rank_in_group``, ``ranks``,
    ``all_gather(x, dim)``, ``device_group``; and no ``all_to_all`` of its own:
    vllm_pcp.pcp.exchange.all_to_all then runs torch's on ``device_group``."""
    from vllm.distributed import parallel_state
    from vllm.distributed.parallel_state import GroupCoordinator

    init = _func(_class(_tree("vllm.distributed.parallel_state"), "GroupCoordinator"),
                 "__init__")
    assert {"world_size", "rank_in_group", "ranks", "device_group"} <= _self_stores(init)
    assert list(inspect.signature(GroupCoordinator.all_gather).parameters) == [
        "self", "input_", "dim"]
    assert not hasattr(GroupCoordinator, "all_to_all")
    for name in ("get_pcp_group", "get_dcp_group"):
        assert list(inspect.signature(getattr(parallel_state, name)).parameters) == []


# -- config fields ------------------------------------------------------------------------

_PARAM_ROOTS = {"vllm_config": (), "model": ("model_config",)}


def _config_path(node, aliases):
    """The VllmConfig attribute path ``node`` reads, or None: ``vllm_config.a.b``,
    ``self.vllm_config.a``, ``getattr(x, "a", ...)``, names assigned from such paths."""
    if isinstance(node, ast.Name):
        return aliases.get(node.id)
    if isinstance(node, ast.Attribute):
        if node.attr == "vllm_config" and isinstance(node.value, ast.Name):
            return ()
        base = _config_path(node.value, aliases)
        return None if base is None else base + (node.attr,)
    if isinstance(node, ast.Call) and ast.unparse(node.func) == "getattr" and \
            len(node.args) >= 2 and isinstance(node.args[1], ast.Constant):
        base = _config_path(node.args[0], aliases)
        return None if base is None else base + (node.args[1].value,)
    return None


def _config_paths(module: str) -> set[tuple[str, ...]]:
    paths = set()
    for fn in ast.walk(_tree(module)):
        if not isinstance(fn, ast.FunctionDef):
            continue
        aliases = {a.arg: _PARAM_ROOTS[a.arg] for a in fn.args.args if a.arg in _PARAM_ROOTS}
        for _ in range(3):  # aliases of aliases
            for n in ast.walk(fn):
                if not isinstance(n, ast.Assign) or len(n.targets) != 1:
                    continue
                target, value = n.targets[0], n.value
                pairs = (zip(target.elts, value.elts) if isinstance(target, ast.Tuple)
                         and isinstance(value, ast.Tuple) else [(target, value)])
                for t, v in pairs:
                    path = _config_path(v, aliases)
                    if isinstance(t, ast.Name) and path is not None:
                        aliases[t.id] = path
        for n in ast.walk(fn):
            path = _config_path(n, aliases)
            if path:
                paths.add(path)
    return paths


def _optional_class(owner: type, name: str):
    """The config class of ``owner``'s field ``name`` typed ``X | None``, else None."""
    import typing

    try:
        hint = typing.get_type_hints(owner).get(name)
    except Exception:  # noqa: BLE001 - an unresolvable annotation: no class
        return None
    classes = [a for a in typing.get_args(hint) if inspect.isclass(a) and a is not type(None)]
    return classes[0] if len(classes) == 1 and dataclasses.is_dataclass(classes[0]) else None


def test_config_fields_the_plugin_reads_exist(make_config):
    """README: config fields. Every VllmConfig attribute path the plugin reads (many
    with ``getattr(..., default)``, which would pass silently if vLLM renamed the
    field) resolves on vLLM's real config; below a field the test config leaves None
    (an optional sub-config), on that field's declared class."""
    config = make_config(prefill_context_parallel_size=2)
    paths = set()
    for module in ("vllm_pcp.config", "vllm_pcp.runner", "vllm_pcp.backend",
                   "vllm_pcp.worker", "vllm_pcp.pcp.memory"):
        paths |= _config_paths(module)
    assert ("parallel_config", "dcp_comm_backend") in paths  # the parser still works
    unresolved = []
    for path in sorted(paths):
        obj, owner = config, None
        for name in path:
            if obj is None:  # an optional sub-config left unset: check its class
                cls = _optional_class(*owner)
                if cls is None or not (name in {f.name for f in dataclasses.fields(cls)}
                                       or hasattr(cls, name)):
                    unresolved.append(path)
                break
            if not hasattr(obj, name):
                unresolved.append(path)
                break
            owner, obj = (type(obj), name), getattr(obj, name)
    assert not unresolved, unresolved


def test_vllm_sizes_the_kv_cache_from_the_profile_runs_torch_peak():
    """README: I25. ``Worker.determine_available_memory`` runs the runner's
    ``profile_run`` inside ``memory_profiling`` and then reads the torch peak: memory the
    override holds through the run counts against the KV cache."""
    fn = _func(_class(_tree("vllm.v1.worker.gpu_worker"), "Worker"),
               "determine_available_memory")
    profiling = next(n for n in ast.walk(fn) if isinstance(n, ast.With)
                     and "memory_profiling" in ast.unparse(n.items[0].context_expr))
    assert _calls(profiling, "self.model_runner.profile_run")
    assert "allocated_bytes.all.peak" in ast.unparse(profiling)
    runner = _class(_tree("vllm.v1.worker.gpu_model_runner"), "GPUModelRunner")
    assert [a.arg for a in _func(runner, "profile_run").args.args] == ["self"]
    # memory_profiling resets the peak and measures right before the run: resetting it
    # again at the run's start changes nothing in vLLM's count
    body = ast.unparse(_func(_tree("vllm.utils.mem_utils"), "memory_profiling"))
    reset, measure = body.index("reset_peak_memory_stats"), body.index("before_profile.measure")
    assert reset < measure < body.index("yield result")


def test_moe_layers_sum_the_pcp_ranks_parts_with_a_reduce_scatter():
    """README: the MoE refusal (vllm_pcp.config._moe_refusal). vLLM combines an expert
    layer's parts over the PCP ranks with a reduce-scatter, whose per-slice order differs
    from rank to rank; ``ModelConfig.is_moe`` says which models have such layers."""
    from vllm.config import ModelConfig

    runner = _class(_tree("vllm.model_executor.layers.fused_moe.runner.moe_runner"), "MoERunner")
    assert _calls(_func(runner, "_maybe_combine"), "get_pcp_group().reduce_scatter")
    assert _calls(_func(runner, "_maybe_dispatch"), "get_pcp_group().all_gather")
    assert isinstance(inspect.getattr_static(ModelConfig, "is_moe"), property)
