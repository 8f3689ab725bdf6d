"""The named configurations the checks and benchmarks run, defined once.

A layout is what a user passes to ``vllm serve``: the parallel sizes, the KV
interleave, the plugin's knobs (``--additional-config``) and a few engine
switches. Each script reads it in the form it needs:

- :func:`serve_flags`: ``vllm serve`` / ``vllm bench latency`` flags;
- :func:`engine_kwargs`: ``vllm.LLM(...)`` keyword arguments;
- :func:`worker_flags`: the flags of ``scripts/exactness_worker.py``.

``pcp1-stock`` is vLLM without the plugin (``VLLM_PLUGINS=none``).

The shell scripts read the same layouts from the command line:

    python3 scripts/layouts.py serve-flags NAME [--cuda-graphs | --eager]  # one flag a line
    python3 scripts/layouts.py env NAME    # KEY=VALUE lines of the layout's environment
    python3 scripts/layouts.py gpus NAME   # GPUs one engine of the layout takes
"""
from __future__ import annotations

import argparse
import json
from dataclasses import dataclass, field

# vLLM's all-reduce + RMSNorm fusion (torch.compile at TP > 1) fails vLLM's memory profiling
# on hosts with NVLink multicast off: engines at TP > 1 run with this compilation_config
NO_ALLREDUCE_FUSION = {"pass_config": {"fuse_allreduce_rms": False}}
CONTEXT_EXCHANGES = ("auto", "queries", "keys")  # vllm_pcp.config.CONTEXT_EXCHANGES
# pcp2-dcp2-i8-smallpool's KV pool per rank: smaller than the longest exactness prompt (32768)
SMALL_POOL_TOKENS = 20480
V1_RUNNER_ENV = {"VLLM_USE_V2_MODEL_RUNNER": "0"}


@dataclass(frozen=True)
class Layout:
    pcp: int = 1  # --prefill-context-parallel-size
    dcp: int = 1  # --decode-context-parallel-size
    tp: int = 1  # --tensor-parallel-size
    interleave: int = 1  # --cp-kv-cache-interleave-size
    knobs: dict = field(default_factory=dict)  # --additional-config
    env: dict = field(default_factory=dict)
    cuda_graphs: bool = False  # False: --enforce-eager (the checks); the benches pick
    ray: bool = False  # --distributed-executor-backend ray
    v1_runner: bool = False  # VLLM_USE_V2_MODEL_RUNNER=0: the V1 runner the plugin runs on
    attention_backend: str = "FLASHINFER"
    worker_extra: tuple[str, ...] = ()  # exactness_worker flags with no vllm serve form


def _dcp(i: int, **kw) -> Layout:
    return Layout(pcp=2, dcp=2, interleave=i, **kw)


LAYOUTS: dict[str, Layout] = {
    # one GPU: stock vLLM, then the plugin loaded (it changes nothing at PCP = 1)
    "pcp1-stock": Layout(env={"VLLM_PLUGINS": "none"}),
    "pcp1": Layout(),
    "pcp1-graphs": Layout(cuda_graphs=True),
    # one GPU on vLLM's V1 model runner, the one the plugin subclasses (vLLM 0.26.0 runs
    # V2 at PCP = 1; the two draw seeded samples differently): the checks' baseline
    "pcp1-v1": Layout(v1_runner=True, env=V1_RUNNER_ENV),
    "pcp1-v1-graphs": Layout(v1_runner=True, env=V1_RUNNER_ENV, cuda_graphs=True),
    # the one-GPU noise floor: another attention kernel (FlashAttention) against FlashInfer
    "pcp1-flash-attn": Layout(attention_backend="FLASH_ATTN"),
    "pcp2": Layout(pcp=2),
    "pcp2-graphs": Layout(pcp=2, cuda_graphs=True),
    "pcp2-ray": Layout(pcp=2, ray=True),
    "pcp2-min8k": Layout(pcp=2, knobs={"pcp_min_split_tokens": 8192}),
    "pcp2-split-all": Layout(pcp=2, knobs={"pcp_min_split_tokens": 2}),
    # every prompt split, the short chat and gsm8k prompts too (the default keeps them whole)
    "pcp2-dcp2-split-all": _dcp(1, knobs={"pcp_min_split_tokens": 2}),
    "tp2": Layout(tp=2),
    "tp2-pcp2-split-all": Layout(tp=2, pcp=2, knobs={"pcp_min_split_tokens": 2}),
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
    # a per-rank KV pool smaller than the longest prompt: only the sharded cache fits it
    "pcp2-dcp2-i8-smallpool": _dcp(8, worker_extra=("--kv-pool-tokens", str(SMALL_POOL_TOKENS))),
}


def serve_flags(name: str, cuda_graphs: bool | None = None) -> list[str]:
    """``vllm serve`` flags of a layout (also ``vllm bench latency``'s). ``cuda_graphs``
    overrides the layout's choice."""
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
    graphs = lay.cuda_graphs if cuda_graphs is None else cuda_graphs
    if not graphs:
        flags.append("--enforce-eager")
    elif lay.tp > 1:
        flags += ["--compilation-config", json.dumps(NO_ALLREDUCE_FUSION)]
    return flags


def engine_kwargs(name: str) -> dict:
    """``vllm.LLM`` keyword arguments of a layout's parallel sizes and knobs (the caller
    chooses eager or graphs, the attention backend and the rest)."""
    lay = LAYOUTS[name]
    kwargs = {"prefill_context_parallel_size": lay.pcp}
    if lay.dcp > 1:
        kwargs.update(decode_context_parallel_size=lay.dcp,
                      cp_kv_cache_interleave_size=lay.interleave)
    if lay.tp > 1:
        kwargs.update(tensor_parallel_size=lay.tp, compilation_config=NO_ALLREDUCE_FUSION)
    if lay.knobs:
        kwargs["additional_config"] = dict(lay.knobs)
    if lay.ray:
        kwargs["distributed_executor_backend"] = "ray"
    return kwargs


def worker_flags(name: str) -> list[str]:
    """``scripts/exactness_worker.py`` flags of a layout."""
    lay = LAYOUTS[name]
    flags = ["--pcp", str(lay.pcp)] if lay.pcp > 1 or lay.tp == 1 else []
    if lay.tp > 1:
        flags += ["--tp", str(lay.tp)]
    if lay.dcp > 1:
        flags += ["--dcp", str(lay.dcp), "--interleave", str(lay.interleave)]
    if "pcp_dcp_context_exchange" in lay.knobs:
        flags += ["--dcp-context-exchange", lay.knobs["pcp_dcp_context_exchange"]]
    if lay.cuda_graphs:
        flags.append("--cuda-graphs")
    if lay.ray:
        flags.append("--ray")
    if lay.v1_runner:
        flags.append("--v1-runner")
    if lay.attention_backend != "FLASHINFER":
        flags += ["--attention-backend", lay.attention_backend]
    return [*flags, *lay.worker_extra]


def gpus(name: str) -> int:
    """GPUs one engine of a layout takes (DCP splits the ranks PCP or TP already has)."""
    lay = LAYOUTS[name]
    return lay.pcp * lay.tp


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description="the named configurations, as the shell "
                                             "scripts take them")
    sub = ap.add_subparsers(dest="cmd", required=True)
    flags = sub.add_parser("serve-flags", help="vllm serve flags, one a line")
    flags.add_argument("name", choices=LAYOUTS, metavar="NAME")
    graphs = flags.add_mutually_exclusive_group()
    graphs.add_argument("--cuda-graphs", dest="graphs", action="store_const", const=True)
    graphs.add_argument("--eager", dest="graphs", action="store_const", const=False)
    for cmd, text in (("env", "KEY=VALUE lines of the environment"), ("gpus", "GPU count")):
        sub.add_parser(cmd, help=text).add_argument("name", choices=LAYOUTS, metavar="NAME")
    args = ap.parse_args(argv)
    if args.cmd == "serve-flags":
        lines = serve_flags(args.name, args.graphs)
    elif args.cmd == "env":
        lines = [f"{k}={v}" for k, v in LAYOUTS[args.name].env.items()]
    else:
        lines = [str(gpus(args.name))]
    for line in lines:
        print(line)


if __name__ == "__main__":
    main()
