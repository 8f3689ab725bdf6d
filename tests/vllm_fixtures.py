"""Shared by tests/test_vllm_seams.py and tests/test_vllm_internals.py: vLLM's and the
plugin's modules read with ``ast`` (without importing them); real vLLM 0.33.0 objects built
on the CPU (a ``VllmConfig``, the FlashInfer builder and impl, a global ``InputBatch`` of a
scheduler step, a ``PCPManager``); what the plugin keeps of FlashInfer, imports from vLLM
and reads of its config, collected from the plugin's source."""
from __future__ import annotations

import ast
import dataclasses
import functools
import importlib
import importlib.util
import inspect
import pkgutil
from types import SimpleNamespace

import pytest
import torch

# -- source helpers -----------------------------------------------------------------------


@functools.lru_cache(maxsize=None)
def tree(module: str) -> ast.Module:
    """The AST of ``module``'s file, read without importing it (shared: not to be edited)."""
    with open(importlib.util.find_spec(module).origin) as f:
        return ast.parse(f.read())


def cls(node: ast.AST, name: str) -> ast.ClassDef:
    return next(n for n in ast.walk(node) if isinstance(n, ast.ClassDef) and n.name == name)


def func(node: ast.AST, name: str) -> ast.FunctionDef:
    """The function ``name`` defined directly in a class or module body."""
    return next(n for n in node.body if isinstance(n, ast.FunctionDef) and n.name == name)


def calls(node: ast.AST, dotted: str) -> list[ast.Call]:
    """Calls in ``node`` whose callee reads ``dotted`` (e.g. ``self.pcp_manager.foo``)."""
    return [n for n in ast.walk(node)
            if isinstance(n, ast.Call) and ast.unparse(n.func) == dotted]


def self_stores(node: ast.AST, name: str = "self") -> set[str]:
    """Attributes ``name.X`` assigned anywhere in ``node``."""
    return {n.attr for n in ast.walk(node)
            if isinstance(n, ast.Attribute) and isinstance(n.ctx, ast.Store)
            and isinstance(n.value, ast.Name) and n.value.id == name}


def self_loads(node: ast.AST, name: str = "self") -> set[str]:
    """Attributes ``name.X`` read anywhere in ``node``."""
    return {n.attr for n in ast.walk(node)
            if isinstance(n, ast.Attribute) and isinstance(n.ctx, ast.Load)
            and isinstance(n.value, ast.Name) and n.value.id == name}


def param_loads(module: ast.Module, param: str) -> set[str]:
    """``param.X`` read by the module-level functions that take ``param``."""
    out = set()
    for fn in module.body:
        if isinstance(fn, ast.FunctionDef) and param in {a.arg for a in fn.args.args}:
            out |= self_loads(fn, param)
    return out


def methods(node: ast.ClassDef) -> set[str]:
    return {n.name for n in node.body if isinstance(n, ast.FunctionDef)}


def bind(fn, call: ast.Call, bound_self: bool = False) -> inspect.BoundArguments:
    """Bind ``call``'s argument shape (positional count, keyword names) to ``fn``'s
    signature; raises TypeError if ``fn`` no longer takes them."""
    assert not any(isinstance(a, ast.Starred) for a in call.args), ast.unparse(call)
    assert all(k.arg is not None for k in call.keywords), ast.unparse(call)
    args = [None] * (len(call.args) + bound_self)
    return inspect.signature(fn).bind(*args, **{k.arg: None for k in call.keywords})


def params(fn) -> list[str]:
    return list(inspect.signature(fn).parameters)


def run_statements(statements: list[ast.stmt], env: dict) -> dict:
    """Execute statements taken from vLLM's source in ``env`` (their names bound there)."""
    for stmt in statements:
        exec(compile(ast.Module([stmt], []), "<vllm source>", "exec"), {}, env)
    return env


# -- real vLLM objects on the CPU ---------------------------------------------------------

@pytest.fixture
def make_config(tmp_path, monkeypatch):
    """``make(hf=None, **parallel)``: vLLM's own VllmConfig of a tiny Qwen2 model (8 query
    heads, 2 KV heads; ``hf`` overrides its config), attention on FLASHINFER, the plugin
    registered, Triton shown as present, as on a GPU host."""
    from vllm.config import AttentionConfig

    from helpers import real_vllm_config

    def make(hf=None, **parallel):
        return real_vllm_config(tmp_path, monkeypatch, parallel,
                                hf=dict(hidden_size=512, num_hidden_layers=1, **(hf or {})),
                                attention_config=AttentionConfig(backend="FLASHINFER"))

    return make


def flashinfer_on_cpu(monkeypatch) -> None:
    """vLLM's FlashInfer builder and impl as on a GPU that is not SM90, on the CPU: no
    trtllm-gen kernels, no pinned memory, no device query for the impl's scratch."""
    import vllm.v1.attention.backends.flashinfer as flashinfer

    from helpers import flashinfer_on_cpu as base

    base(monkeypatch)
    monkeypatch.setattr(flashinfer, "get_device_sm_count", lambda device: 132)
    monkeypatch.setattr(flashinfer, "_get_multi_ctas_kv_counter_buffer", lambda *a: None)


def group(world_size: int, rank: int = 0, **kw) -> SimpleNamespace:
    """A stand-in for vLLM's GroupCoordinator of ``world_size`` ranks."""
    return SimpleNamespace(world_size=world_size, rank_in_group=rank, **kw)


@pytest.fixture
def make_builder(make_config, monkeypatch):
    """``make(cls, dcp=1, pcp=2, **impl_kwargs)``: a real FlashInfer metadata builder of
    ``cls`` over one layer (8 query heads, 2 KV heads, head size 64, pages of 16) and the
    layer's PCPFlashInferImpl, built as vLLM builds them: the impl inside the current
    config, with the PCP and DCP groups of those sizes."""
    import vllm.distributed.parallel_state as parallel_state
    from vllm.config import set_current_vllm_config
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    from vllm.v1.attention.backends.utils import (get_supported_kv_cache_layouts,
                                                  resolve_kv_cache_layout)

    from helpers import attention_layer
    from vllm_pcp.backend import PCPFlashInferBackend, PCPFlashInferImpl

    flashinfer_on_cpu(monkeypatch)

    def make(builder_cls, dcp=1, pcp=2, **impl_kwargs):
        # vLLM reads the groups' sizes from these globals (AttentionImplBase.__new__,
        # get_dcp_world_size_and_rank); no torch.distributed group is made
        monkeypatch.setattr(parallel_state, "_DCP", group(dcp) if dcp > 1 else None)
        monkeypatch.setattr(parallel_state, "_PCP", group(pcp))
        config = make_config(prefill_context_parallel_size=pcp,
                             decode_context_parallel_size=dcp)
        # the layout the engine core resolves for this backend (cache_config keeps it)
        layouts = get_supported_kv_cache_layouts([PCPFlashInferBackend])
        resolve_kv_cache_layout(config, [[layout.name for layout in layouts]])
        spec = FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=64,
                                 dtype=torch.bfloat16)
        kwargs = dict(alibi_slopes=None, sliding_window=None, kv_cache_dtype="auto")
        with set_current_vllm_config(config):
            impl = PCPFlashInferImpl(8, 64, 0.125, 2, **{**kwargs, **impl_kwargs})
            config.compilation_config.static_forward_context["layers.0.attn"] = \
                attention_layer(impl)
            builder = builder_cls(spec, ["layers.0.attn"], config, torch.device("cpu"))
        return builder, impl, config

    return make


# -- the PCP manager on the CPU -----------------------------------------------------------

from manager_harness import MAX_REQS, MAX_TOKENS, global_batch  # noqa: E402,F401


def block_tables(num_groups: int = 1) -> SimpleNamespace:
    """What PCPManager.set_block_tables reads of vLLM's BlockTables."""
    return SimpleNamespace(num_kv_cache_groups=num_groups, cp_interleave=1,
                           input_block_tables=tuple(torch.zeros(MAX_REQS, 8, dtype=torch.int32)
                                                    for _ in range(num_groups)))


def manager_kwargs(pcp: int, rank: int, shard_decodes: bool = False) -> dict:
    """PCPManager's constructor arguments on the CPU."""
    return dict(pcp_world_size=pcp, pcp_rank=rank, device=torch.device("cpu"),
                shard_decode_requests=shard_decodes, max_num_reqs=MAX_REQS,
                max_num_tokens=MAX_TOKENS, block_tables=block_tables())


def settings(pcp: int, policy: str = "replicate", min_split_tokens: int = 8):
    """The plugin's settings of ``-pcp`` ``pcp`` at DCP = 1."""
    from vllm_pcp.knobs import PCPSettings

    return PCPSettings(pcp_world_size=pcp, dcp_world_size=1,
                       min_split_tokens=max(min_split_tokens, 2 * pcp),
                       min_chunk_tokens=4 * pcp, decode_threshold=1, decode_policy=policy,
                       split_attention="paged", dcp_context_exchange="auto")


def eager(num_tokens: int | None = None):
    """vLLM's batch descriptor of an eager step, or of a piecewise graph of
    ``num_tokens`` rows."""
    from vllm.config import CUDAGraphMode
    from vllm.v1.worker.gpu.cudagraph_utils import BatchExecutionDescriptor

    mode = CUDAGraphMode.NONE if num_tokens is None else CUDAGraphMode.PIECEWISE
    return BatchExecutionDescriptor(cg_mode=mode, num_tokens=num_tokens or 0, num_reqs=None)


# -- FlashInfer's wrappers, as the plugin keeps them ---------------------------------------

DECODE = "BatchDecodeWithPagedKVCacheWrapper"
WRAPPERS = ("BatchPrefillWithRaggedKVCacheWrapper", "BatchPrefillWithPagedKVCacheWrapper", DECODE)


def flashinfer_method(name: str, method: str):
    """FlashInfer's wrapper method; the decode wrapper's ``plan`` takes ``**kwargs`` and
    hands them to ``_plan_impl``, whose signature is the one that binds."""
    import flashinfer

    if name == DECODE and method == "plan":
        method = "_plan_impl"
    return getattr(getattr(flashinfer, name), method)


def kept(module: str) -> dict[str, tuple[str, str]]:
    """What the ``__init__`` methods of ``module`` keep on ``self``: ``X -> ("instance",
    "C")`` for a FlashInfer wrapper C it builds, ``("alias", "f")`` for a FlashInfer
    function or vLLM's ``fast_plan_decode``."""
    out = {}
    for init in (n for n in ast.walk(tree(module)) if isinstance(n, ast.FunctionDef)
                 and n.name == "__init__"):
        for n in (n for n in ast.walk(init) if isinstance(n, ast.Assign)):
            for target in n.targets:
                pairs = (zip(target.elts, n.value.elts) if isinstance(target, ast.Tuple)
                         else [(target, n.value)])
                for t, v in pairs:
                    text = ast.unparse(v.func if isinstance(v, ast.Call) else v)
                    if not ast.unparse(t).startswith("self.") or not (
                            text.startswith("flashinfer.") or text == "fast_plan_decode"):
                        continue
                    kind = "instance" if isinstance(v, ast.Call) else "alias"
                    out[t.attr] = (kind, text.removeprefix("flashinfer."))
    return out


# -- the plugin's modules, names and config reads -----------------------------------------

def plugin_modules() -> list[str]:
    import vllm_pcp

    return ["vllm_pcp"] + [m.name for m in pkgutil.walk_packages(vllm_pcp.__path__, "vllm_pcp.")]


def resolve(module: str, name: str):
    """``module.name`` of vLLM or FlashInfer; a module that needs CUDA to import (the CUDA
    platform) is read with ``ast`` instead: a stand-in for each name it defines."""
    try:
        return getattr(importlib.import_module(module), name)
    except ImportError as exc:
        if "libcuda" not in str(exc):
            raise
        defined = {n.name for n in tree(module).body if hasattr(n, "name")}
        if name not in defined:
            raise AttributeError(f"{module} defines no {name}") from None
        return SimpleNamespace()


PARAM_ROOTS = {"vllm_config": (), "model": ("model_config",)}


def config_path(node, aliases):
    """The VllmConfig attribute path ``node`` reads, or None: ``vllm_config.a.b``,
    ``self.vllm_config.a``, ``getattr(x, "a", ...)``, names assigned from such paths."""
    if isinstance(node, ast.Name):
        return aliases.get(node.id)
    if isinstance(node, ast.Attribute):
        if node.attr == "vllm_config" and isinstance(node.value, ast.Name):
            return ()
        base = config_path(node.value, aliases)
        return None if base is None else base + (node.attr,)
    if isinstance(node, ast.Call) and ast.unparse(node.func) == "getattr" and \
            len(node.args) >= 2 and isinstance(node.args[1], ast.Constant):
        base = config_path(node.args[0], aliases)
        return None if base is None else base + (node.args[1].value,)
    return None


def config_paths(module: str) -> set[tuple[str, ...]]:
    paths = set()
    for fn in (n for n in ast.walk(tree(module)) if isinstance(n, ast.FunctionDef)):
        aliases = {a.arg: PARAM_ROOTS[a.arg] for a in fn.args.args if a.arg in PARAM_ROOTS}
        for _ in range(3):  # aliases of aliases
            for n in (n for n in ast.walk(fn) if isinstance(n, ast.Assign)
                      and len(n.targets) == 1):
                target, value = n.targets[0], n.value
                pairs = (zip(target.elts, value.elts) if isinstance(target, ast.Tuple)
                         and isinstance(value, ast.Tuple) else [(target, value)])
                for t, v in pairs:
                    path = config_path(v, aliases)
                    if isinstance(t, ast.Name) and path is not None:
                        aliases[t.id] = path
        paths |= {p for n in ast.walk(fn) if (p := config_path(n, aliases))}
    return paths


def optional_class(owner: type, name: str):
    """The config class of ``owner``'s field ``name`` typed ``X | None``, else None."""
    import typing

    try:
        hint = typing.get_type_hints(owner).get(name)
    except Exception:  # noqa: BLE001 - an unresolvable annotation: no class
        return None
    classes = [a for a in typing.get_args(hint) if inspect.isclass(a) and a is not type(None)]
    return classes[0] if len(classes) == 1 and dataclasses.is_dataclass(classes[0]) else None
