"""The named engine layouts the checks and benchmarks run, defined once.

A layout is what a user passes to ``vllm serve``: the parallel sizes, the KV interleave,
the plugin's knobs (``--additional-config``) and a few engine switches. Two forms:

- :func:`serve_flags`: ``vllm serve`` / ``vllm bench latency`` / ``vllm bench serve`` flags;
- :func:`engine_kwargs`: ``vllm.LLM(...)`` keyword arguments.

Every engine runs vLLM's Model Runner V2 (:func:`engine_env`). ``pcp1`` is one GPU on
FlashInfer with the plugin loaded, which at PCP = 1 leaves vLLM's FlashInfer as it is: the
baseline of every check (:func:`baseline`). A ``stock`` layout runs vLLM without the
plugin (``pcp1-stock``; vLLM's own ``-tp`` and its own DCP inside TP).
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field

# vLLM's all-reduce + RMSNorm fusion (torch.compile at TP > 1) fails vLLM's memory profiling
# on hosts with NVLink multicast off: engines at TP > 1 with CUDA graphs run without it
NO_ALLREDUCE_FUSION = {"pass_config": {"fuse_allreduce_rms": False}}
CONTEXT_EXCHANGES = ("auto", "queries", "keys")  # vllm_pcp.knobs.CONTEXT_EXCHANGES
# the plugins a stock engine loads (VLLM_PLUGINS): the test harness's own, never vllm-pcp;
# where the harness is not on the path (the benchmarks) none
STOCK_PLUGINS = "vllm_pcp_shared_gpu"
# the variable that would pick vLLM's runner; left unset, vLLM runs Model Runner V2
RUNNER_VAR = "VLLM_USE_V2_MODEL_RUNNER"
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
    def stock(self) -> bool:
        """vLLM without vllm-pcp (only :data:`STOCK_PLUGINS` load)."""
        return self.env.get("VLLM_PLUGINS") == STOCK_PLUGINS


def _dcp(i: int, **kw) -> Layout:
    return Layout(pcp=2, dcp=2, interleave=i, **kw)


def _stock(**kw) -> Layout:
    return Layout(env={"VLLM_PLUGINS": STOCK_PLUGINS}, **kw)


def _preempt(lay: Layout) -> Layout:
    return Layout(**{**lay.__dict__, "pool_tokens": PREEMPT_POOL_TOKENS // lay.dcp,
                     "max_model_len": PREEMPT_MAX_MODEL_LEN})


def _fp8(lay: Layout) -> Layout:
    return Layout(**{**lay.__dict__, "kv_cache_dtype": "fp8"})


LAYOUTS: dict[str, Layout] = {
    # one GPU: stock vLLM, then the plugin loaded (the checks' baseline)
    "pcp1-stock": _stock(),
    "pcp1": Layout(),
    "pcp1-graphs": Layout(cuda_graphs=True),
    # the one-GPU noise floor: another attention kernel (FlashAttention) against FlashInfer
    "pcp1-flash-attn": Layout(attention_backend="FLASH_ATTN"),
    "pcp2": Layout(pcp=2),
    # every split row on the paged kernel: one GPU's FlashInfer prefill, bit for bit
    "pcp2-paged": Layout(pcp=2, knobs={"pcp_split_attention": "paged"}),
    "pcp2-graphs": Layout(pcp=2, cuda_graphs=True),
    # each decode on one rank, its K/V and hidden states all-gathered every step
    "pcp2-shard": Layout(pcp=2, knobs={"pcp_decode_policy": "shard"}),
    "pcp2-ray": Layout(pcp=2, ray=True),
    "pcp2-dcp2-i1-ray": _dcp(1, ray=True),
    "pcp2-min8k": Layout(pcp=2, knobs={"pcp_min_split_tokens": 8192}),
    # every prompt split, the short chat and gsm8k prompts too (the default keeps them whole)
    "pcp2-split-all": Layout(pcp=2, knobs={"pcp_min_split_tokens": 2}),
    "pcp2-dcp2-split-all": _dcp(1, knobs={"pcp_min_split_tokens": 2}),
    "tp2-pcp2-split-all": Layout(tp=2, pcp=2, knobs={"pcp_min_split_tokens": 2}),
    "tp2": _stock(tp=2),  # vLLM's own -tp 2: a MoE model's experts sharded as -pcp 2 does
    "pcp2-dcp2": _dcp(1),
    **{f"pcp2-dcp2-{way}": _dcp(1, knobs={"pcp_dcp_context_exchange": way})
       for way in ("queries", "keys")},
    **{f"pcp2-dcp2-i{i}": _dcp(i) for i in (1, 8, 16)},
    # CUDA graphs and torch.compile (the plugin plans -dcp's attention outside the graphs)
    "pcp2-dcp2-i8-graphs": _dcp(8, cuda_graphs=True),
    # each way a split chunk reaches its context, forced (the default picks per step)
    **{f"pcp2-dcp2-i{i}-{way}": _dcp(i, knobs={"pcp_dcp_context_exchange": way})
       for i in (1, 8, 16) for way in CONTEXT_EXCHANGES},
    # vLLM's own DCP inside TP (PCP = 1, FlashInfer): models with fewer KV heads than -tp
    **{f"tp2-dcp2-i{i}": _stock(tp=2, dcp=2, interleave=i) for i in (1, 8, 16)},
    "tp2-dcp2-i8-graphs": _stock(tp=2, dcp=2, interleave=8, cuda_graphs=True),
    # more ranks, and -tp with -pcp (the plugin's DCP then spans the PCP ranks of a TP rank)
    "pcp4": Layout(pcp=4),
    # decodes on every rank: refused for a MoE model at -pcp > 2 (its default shards them)
    "pcp4-replicate": Layout(pcp=4, knobs={"pcp_decode_policy": "replicate"}),
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
                for name in ("pcp1", "pcp2", "pcp4", "pcp2-dcp2-i1")})
# the memory budget: vLLM's own KV sizing at 0.9 of each GPU, split steps of the longest prompt
LAYOUTS.update({f"{name}-budget": Layout(**{**LAYOUTS[name].__dict__,
                                             "gpu_memory_utilization": 0.9})
                for name in ("pcp2", "pcp2-dcp2-i1-queries", "pcp2-dcp2-i1-keys", "pcp4")})
# preemption: the same scheduler pool everywhere
LAYOUTS.update({f"{name}-preempt": _preempt(LAYOUTS[name])
                for name in ("pcp1", "pcp2", "pcp4", "pcp2-dcp2-i1", "pcp2-dcp2-i16")})


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
              "attention_backend": lay.attention_backend, "enforce_eager": not lay.cuda_graphs,
              "kv_cache_dtype": lay.kv_cache_dtype}
    if lay.dcp > 1:
        kwargs["cp_kv_cache_interleave_size"] = lay.interleave
    if lay.knobs:
        kwargs["additional_config"] = dict(lay.knobs)
    if lay.ray:
        kwargs["distributed_executor_backend"] = "ray"
    if lay.tp > 1 and lay.cuda_graphs:
        kwargs["compilation_config"] = NO_ALLREDUCE_FUSION
    return kwargs


def engine_env(name: str, base: dict) -> dict:
    """``base`` (an environment) for an engine of ``name``: its layout's variables over it,
    without :data:`RUNNER_VAR`, so that one GPU runs vLLM's Model Runner V2 as every
    ``-pcp`` engine does (the two then draw a seeded request's random numbers alike)."""
    env = {k: v for k, v in base.items() if k != RUNNER_VAR}
    return {**env, **LAYOUTS[name].env}


def gpus(name: str) -> int:
    """GPUs one engine of a layout takes (DCP splits the ranks PCP or TP already has)."""
    lay = LAYOUTS[name]
    return lay.pcp * lay.tp


def decode_policy(name: str, moe: bool) -> str | None:
    """Which ranks compute a decode in an engine of ``name`` (``replicate`` or ``shard``;
    None at PCP = 1): the layout's ``pcp_decode_policy``, ``auto`` sharding a
    mixture-of-experts model's decodes at ``-pcp`` > 2; with ``-dcp`` every rank attends
    its shard of each decode (docs/design.md, "Decode steps")."""
    lay = LAYOUTS[name]
    if lay.pcp == 1:
        return None
    policy = lay.knobs.get("pcp_decode_policy", "auto")
    if lay.dcp > 1:
        return "replicate"
    if policy == "auto":
        return "shard" if moe and lay.pcp > 2 else "replicate"
    return policy


def exact_sampling(name: str) -> bool:
    """Whether seeded samples of ``name`` must equal one GPU's token for token: at DCP = 1
    with ``pcp_split_attention`` ``paged`` every split row attends with one GPU's
    FlashInfer prefill kernel, and Model Runner V2 draws alike on both sides. Not with
    ``-tp``, whose all-reduce sums otherwise than one GPU."""
    lay = LAYOUTS[name]
    return (lay.pcp > 1 and lay.dcp == 1 and lay.tp == 1
            and lay.knobs.get("pcp_split_attention") == "paged")


def baseline(name: str) -> str | None:
    """The one-GPU layout ``name`` is held to: ``pcp1`` (CUDA graphs against CUDA graphs,
    fp8 against fp8, the same preemption pool); None for a one-GPU layout."""
    if gpus(name) == 1:
        return None
    base = "pcp1-graphs" if LAYOUTS[name].cuda_graphs else "pcp1"
    for suffix in ("-fp8", "-preempt"):
        if name.endswith(suffix):
            base = "pcp1" + suffix
    return base
