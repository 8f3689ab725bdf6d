"""The named engine layouts the checks and benchmarks run, defined once.

A layout is what a user passes to ``vllm serve``: the parallel sizes, the KV interleave,
the plugin's knobs (``--additional-config``) and a few engine switches. Two forms:

- :func:`serve_flags`: ``vllm serve`` / ``vllm bench latency`` / ``vllm bench serve`` flags;
- :func:`engine_kwargs`: ``vllm.LLM(...)`` keyword arguments.

``pcp1-stock`` is vLLM without the plugin (``VLLM_PLUGINS=none``). Every other layout
loads it; at PCP = 1 it changes nothing. :func:`baseline` names the one-GPU layout a
layout is held to.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field

# vLLM's all-reduce + RMSNorm fusion (torch.compile at TP > 1) fails vLLM's memory profiling
# on hosts with NVLink multicast off: engines at TP > 1 with CUDA graphs run without it
NO_ALLREDUCE_FUSION = {"pass_config": {"fuse_allreduce_rms": False}}
CONTEXT_EXCHANGES = ("auto", "queries", "keys")  # vllm_pcp.knobs.CONTEXT_EXCHANGES
# vLLM 0.26.0 runs its Model Runner V2 at PCP = 1 and the plugin the V1 runner at PCP > 1;
# the two draw a seeded request's random numbers differently
V1_RUNNER_ENV = {"VLLM_USE_V2_MODEL_RUNNER": "0"}
# the preemption case's scheduler pool, in tokens (a DCP rank holds 1/DCP of it), and the
# max_model_len under it (vLLM refuses a pool smaller than one request of max_model_len)
PREEMPT_POOL_TOKENS = 12288
PREEMPT_MAX_MODEL_LEN = 4096
# pcp2-dcp2-i8-smallpool's pool per rank: smaller than the longest exactness prompt (32768)
SMALL_POOL_TOKENS = 20480


@dataclass(frozen=True)
class Layout:
    pcp: int = 1  # --prefill-context-parallel-size
    dcp: int = 1  # --decode-context-parallel-size
    tp: int = 1  # --tensor-parallel-size
    interleave: int = 1  # --cp-kv-cache-interleave-size
    knobs: dict = field(default_factory=dict)  # --additional-config
    env: dict = field(default_factory=dict)
    cuda_graphs: bool = False  # False: --enforce-eager (the checks); the benchmarks pick
    ray: bool = False  # --distributed-executor-backend ray
    attention_backend: str = "FLASHINFER"
    kv_cache_dtype: str = "auto"  # --kv-cache-dtype
    pool_tokens: int = 0  # a fixed KV pool of this many tokens per rank (0: the caller's)
    max_model_len: int = 0  # 0: what the caller's cases need
    # > 0: no fixed pool; vLLM sizes the KV cache from its profile run at this share of each
    # GPU (--gpu-memory-utilization), as a user would run it: needs a GPU per rank
    gpu_memory_utilization: float = 0.0

    @property
    def v1_runner(self) -> bool:
        return self.env.get("VLLM_USE_V2_MODEL_RUNNER") == "0"


def _dcp(i: int, **kw) -> Layout:
    return Layout(pcp=2, dcp=2, interleave=i, **kw)


def _v1(**kw) -> Layout:
    return Layout(env=dict(V1_RUNNER_ENV), **kw)


def _preempt(lay: Layout) -> Layout:
    return Layout(**{**lay.__dict__, "pool_tokens": PREEMPT_POOL_TOKENS // lay.dcp,
                     "max_model_len": PREEMPT_MAX_MODEL_LEN})


def _fp8(lay: Layout) -> Layout:
    return Layout(**{**lay.__dict__, "kv_cache_dtype": "fp8"})


LAYOUTS: dict[str, Layout] = {
    # one GPU: stock vLLM, then the plugin loaded
    "pcp1-stock": Layout(env={"VLLM_PLUGINS": "none"}),
    "pcp1": Layout(),
    "pcp1-graphs": Layout(cuda_graphs=True),
    # one GPU on the V1 runner the plugin subclasses: the checks' baseline
    "pcp1-v1": _v1(),
    "pcp1-v1-graphs": _v1(cuda_graphs=True),
    # the one-GPU noise floor: another attention kernel (FlashAttention) against FlashInfer
    "pcp1-flash-attn": Layout(attention_backend="FLASH_ATTN"),
    "pcp2": Layout(pcp=2),
    # every split row on the paged kernel: one GPU's FlashInfer prefill, bit for bit
    "pcp2-paged": Layout(pcp=2, knobs={"pcp_split_attention": "paged"}),
    "pcp2-graphs": Layout(pcp=2, cuda_graphs=True),
    "pcp2-ray": Layout(pcp=2, ray=True),
    "pcp2-dcp2-i1-ray": _dcp(1, ray=True),
    "pcp2-min8k": Layout(pcp=2, knobs={"pcp_min_split_tokens": 8192}),
    # every prompt split, the short chat and gsm8k prompts too (the default keeps them whole)
    "pcp2-split-all": Layout(pcp=2, knobs={"pcp_min_split_tokens": 2}),
    "pcp2-dcp2-split-all": _dcp(1, knobs={"pcp_min_split_tokens": 2}),
    "tp2-pcp2-split-all": Layout(tp=2, pcp=2, knobs={"pcp_min_split_tokens": 2}),
    "tp2": Layout(tp=2),
    "pcp2-dcp2": _dcp(1),
    **{f"pcp2-dcp2-{way}": _dcp(1, knobs={"pcp_dcp_context_exchange": way})
       for way in ("queries", "keys")},
    **{f"pcp2-dcp2-i{i}": _dcp(i) for i in (1, 8, 16)},
    # full CUDA graphs of the decode steps (FULL_DECODE_ONLY), torch.compile on
    "pcp2-dcp2-i8-graphs": _dcp(8, cuda_graphs=True),
    # each way a split chunk reaches its context, forced (the default picks per step)
    **{f"pcp2-dcp2-i{i}-{way}": _dcp(i, knobs={"pcp_dcp_context_exchange": way})
       for i in (1, 8, 16) for way in CONTEXT_EXCHANGES},
    # DCP inside TP (PCP = 1): models with fewer KV heads than -tp
    **{f"tp2-dcp2-i{i}": Layout(tp=2, dcp=2, interleave=i) for i in (1, 8, 16)},
    "tp2-dcp2-i8-graphs": Layout(tp=2, dcp=2, interleave=8, cuda_graphs=True),
    # more ranks, and -tp with -pcp (the plugin's DCP then spans the PCP ranks of a TP rank)
    "pcp4": Layout(pcp=4),
    **{f"pcp4-dcp4-i{i}": Layout(pcp=4, dcp=4, interleave=i) for i in (1, 8)},
    "pcp8": Layout(pcp=8),
    "tp2-pcp2": Layout(tp=2, pcp=2),
    "tp2-pcp2-dcp2-i1": Layout(tp=2, pcp=2, dcp=2, interleave=1),
    # the test plan of vLLM's GQA FlashInfer PCP pull request: 8 ranks
    "tp4-pcp2-dcp2-i8": Layout(tp=4, pcp=2, dcp=2, interleave=8),
    # a per-rank KV pool smaller than the longest prompt: only the sharded cache holds it
    "pcp2-dcp2-i8-smallpool": _dcp(8, pool_tokens=SMALL_POOL_TOKENS),
}
# fp8 KV caches against one GPU's fp8 (refused with -dcp: its path runs unquantized caches)
LAYOUTS.update({f"{name}-fp8": _fp8(LAYOUTS[name])
                for name in ("pcp1-v1", "pcp2", "pcp4", "pcp2-dcp2-i1")})
# the memory budget: vLLM's own KV sizing at 0.9 of each GPU, split steps of the longest prompt
LAYOUTS.update({f"{name}-budget": Layout(**{**LAYOUTS[name].__dict__,
                                             "gpu_memory_utilization": 0.9})
                for name in ("pcp2", "pcp2-dcp2-i1-queries", "pcp2-dcp2-i1-keys", "pcp4")})
# preemption: the same scheduler pool everywhere
LAYOUTS.update({f"{name}-preempt": _preempt(LAYOUTS[name])
                for name in ("pcp1-v1", "pcp2", "pcp4", "pcp2-dcp2-i1", "pcp2-dcp2-i16")})


def serve_flags(name: str, cuda_graphs: bool | None = None) -> list[str]:
    """``vllm serve`` flags of a layout (also ``vllm bench``'s); ``cuda_graphs`` overrides
    the layout's choice. The environment (:attr:`Layout.env`) and a fixed pool are the
    caller's."""
    lay = LAYOUTS[name]
    flags = ["--attention-backend", lay.attention_backend,
             "--prefill-context-parallel-size", str(lay.pcp)]  # 1 too: the plugin's flag
    for flag, value in (("--decode-context-parallel-size", lay.dcp),
                        ("--tensor-parallel-size", lay.tp)):
        if value > 1:
            flags += [flag, str(value)]
    if lay.dcp > 1:
        flags += ["--cp-kv-cache-interleave-size", str(lay.interleave)]
    if lay.knobs:
        flags += ["--additional-config", json.dumps(lay.knobs)]
    if lay.ray:
        flags += ["--distributed-executor-backend", "ray"]
    if lay.kv_cache_dtype != "auto":
        flags += ["--kv-cache-dtype", lay.kv_cache_dtype]
    graphs = lay.cuda_graphs if cuda_graphs is None else cuda_graphs
    if not graphs:
        flags.append("--enforce-eager")
    elif lay.tp > 1:
        flags += ["--compilation-config", json.dumps(NO_ALLREDUCE_FUSION)]
    return flags


def engine_kwargs(name: str) -> dict:
    """``vllm.LLM`` keyword arguments of a layout: everything :func:`serve_flags` says,
    in the engine's own names (the pool, model length and environment are the caller's)."""
    lay = LAYOUTS[name]
    kwargs = {"prefill_context_parallel_size": lay.pcp, "tensor_parallel_size": lay.tp,
              "decode_context_parallel_size": lay.dcp,
              "cp_kv_cache_interleave_size": lay.interleave,
              "attention_backend": lay.attention_backend, "enforce_eager": not lay.cuda_graphs,
              "kv_cache_dtype": lay.kv_cache_dtype}
    if lay.knobs:
        kwargs["additional_config"] = dict(lay.knobs)
    if lay.ray:
        kwargs["distributed_executor_backend"] = "ray"
    if lay.tp > 1 and lay.cuda_graphs:
        kwargs["compilation_config"] = NO_ALLREDUCE_FUSION
    return kwargs


def gpus(name: str) -> int:
    """GPUs one engine of a layout takes (DCP splits the ranks PCP or TP already has)."""
    lay = LAYOUTS[name]
    return lay.pcp * lay.tp


def takes_ragged(name: str) -> bool:
    """Whether a layout's fresh split steps attend with the ragged kernel (DCP = 1 at PCP > 1,
    ``pcp_split_attention`` auto, an unquantized cache: ``vllm_pcp.pcp.ragged``)."""
    lay = LAYOUTS[name]
    return (lay.pcp > 1 and lay.dcp == 1 and lay.kv_cache_dtype == "auto"
            and lay.knobs.get("pcp_split_attention", "auto") == "auto")


def baseline(name: str) -> str | None:
    """The one-GPU layout ``name`` is held to, on the V1 runner the plugin runs (CUDA
    graphs against CUDA graphs, fp8 against fp8, the same preemption pool); None for a
    one-GPU layout."""
    if gpus(name) == 1:
        return None
    base = "pcp1-v1-graphs" if LAYOUTS[name].cuda_graphs else "pcp1-v1"
    for suffix in ("-fp8", "-preempt"):
        if name.endswith(suffix):
            base = "pcp1-v1" + suffix
    return base
