"""Host work of one PCP x DCP attention layer, counted on PyTorch's meta device (no GPU).

    python benchmarks/dcp_host.py --out dcp-host-layer.json

Rank 0 of 2 (bench model heads, interleave 8) runs one layer's plugin work on meta tensors
with FlashInfer and the process group stood in for: aten ops (``kernel_ops``: less views and
allocations), collectives, FlashInfer calls, in the step's first layer and again in a later
layer (``later_layer``: a model's other layers run the same planned step). Each step is split
by the plugin's PCP manager on the CPU, as an engine splits it. Steps: ``mixed`` (15 decodes
at 16K context beside the second 8K chunk of a 16K prompt), ``prefill`` (that chunk),
``decode``. Host times (median, ms, this CPU): ``partition_host_ms``, the manager's partition
of the global batch (vLLM's, with the plugin's split); ``plan_host_ms``, the step's DCP plan
and index work (``build_dcp_plan`` and ``DCPAttention.plan``), FlashInfer's own plans stood
in for; torch's CPU ops run on one thread, as vLLM runs them while serving.
"""
from __future__ import annotations

import os
import shlex
import statistics
import sys
import time
from argparse import ArgumentParser, RawDescriptionHelpFormatter
from types import SimpleNamespace
from unittest.mock import patch

import torch
from torch.utils._python_dispatch import TorchDispatchMode

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "tests", "engine")]
import results  # noqa: E402
from kernel_choice import HEAD_DIM, HEADS, PAGE  # noqa: E402

WORLD, RANK, INTERLEAVE = 2, 0, 8
NO_KERNEL = {"view", "slice", "select", "detach", "transpose", "as_strided", "unsqueeze",
             "expand", "permute", "split", "t", "alias", "_unsafe_view", "empty",
             "new_empty", "empty_like", "split_with_sizes", "unbind"}
DECODES, CONTEXT, PROMPT, CHUNK = 15, 16000, 16384, 8192
STEPS = (("mixed", "keys"), ("mixed", "queries"), ("prefill", "keys"), ("decode", "keys"))
PLAN_RUNS = 50


class Count(TorchDispatchMode):
    """Counts the aten ops dispatched outside stand-ins (``ops``) and stand-ins' ``calls``."""

    ops, calls, paused = {}, {}, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not self.paused:
            name = func.overloadpacket.__name__
            self.ops[name] = self.ops.get(name, 0) + 1
        return func(*args, **(kwargs or {}))


COUNT = Count()


def standin(fn, counter: str = "merges"):
    """``fn`` as a stand-in: its ops are not counted, its calls are (``COUNT.calls``)."""
    def run(*args, **kwargs):
        COUNT.calls[counter] = COUNT.calls.get(counter, 0) + 1
        COUNT.paused += 1
        out = fn(*args, **kwargs)
        COUNT.paused -= 1
        return out
    return run


def _run(q, *args, out=None, lse=None, return_lse=False, **kwargs):
    out = torch.empty_like(q) if out is None else out
    lse = torch.empty(q.shape[:2], dtype=torch.float32, device=q.device) if lse is None else lse
    return (out, lse) if return_lse else out


def wrapper(*args, **kwargs) -> SimpleNamespace:
    """A FlashInfer wrapper: plans nothing, runs give outputs (and LSEs) of the right shape."""
    return SimpleNamespace(plan=lambda *args, **kwargs: None, run=standin(_run, "flashinfer"))


GROUP = SimpleNamespace(  # rank 0 of WORLD: collectives give tensors of the gathered shape
    world_size=WORLD, rank_in_group=RANK,
    all_gather=standin(lambda x, dim=0: x.new_empty(
        [n * WORLD if d == dim % x.dim() else n for d, n in enumerate(x.shape)]), "collectives"),
    all_to_all=standin(torch.empty_like, "collectives"))
FLASHINFER = SimpleNamespace(
    BatchPrefillWithRaggedKVCacheWrapper=wrapper, BatchPrefillWithPagedKVCacheWrapper=wrapper,
    BatchDecodeWithPagedKVCacheWrapper=wrapper,
    merge_state=standin(lambda va, sa, vb, sb: (torch.empty_like(va), torch.empty_like(sa))),
    merge_states=standin(lambda v, s: (torch.empty_like(v[:, 0]), torch.empty_like(s[:, 0]))),
    merge_state_in_place=lambda *args: None)


def step_batch(step: str, scale: int = 1) -> tuple[list[int], list[int], list[int]]:
    """``(computed, scheduled, prompt lengths)`` of each request of ``step``, its lengths
    divided by ``scale`` (a CPU test's small copy). A decoding request's prompt is its
    context (it is past its prefill)."""
    context, prompt, chunk = CONTEXT // scale, PROMPT // scale, CHUNK // scale
    dec = [context + i for i in range(DECODES)]
    return {"mixed": (dec + [chunk], [1] * DECODES + [prompt - chunk - DECODES],
                      dec + [prompt]),
            "prefill": ([chunk], [prompt - chunk], [prompt]),
            "decode": (dec, [1] * DECODES, dec)}[step]


def split_step(step: str, exchange: str = "auto"):
    """Rank ``RANK``'s split of ``step`` at -pcp 2 -dcp 2 by the plugin's manager (CPU);
    ``(step's split, partition())``, the latter partitioning the step again."""
    from bench_steps import eager, partition, settings

    computed, scheduled, prompts = step_batch(step)
    s = settings(WORLD, WORLD, CHUNK, context_exchange=exchange)
    p = partition(s, RANK, computed, scheduled, prompts, interleave=INTERLEAVE)
    return p.step, lambda: p.manager.partition_batch(p.batch, eager())


def _host_ms(fn) -> float:
    """Median host time (ms) of ``fn()`` over :data:`PLAN_RUNS` calls, after a few."""
    for _ in range(5):
        fn()
    times = []
    for _ in range(PLAN_RUNS):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e3)
    return round(statistics.median(times), 4)


def _counts() -> dict:
    ops = dict(sorted(COUNT.ops.items()))
    return {"aten_ops": sum(ops.values()),
            "kernel_ops": sum(n for op, n in ops.items() if op not in NO_KERNEL), "ops": ops,
            "flashinfer_runs": COUNT.calls.get("flashinfer", 0),
            "collectives": COUNT.calls.get("collectives", 0)}


def _attention(table: torch.Tensor):
    """DCPAttention on the stand-ins, and its cache (meta tensors)."""
    from vllm_pcp.dcp.attention import DCPAttention

    (hq, hkv), meta = HEADS, torch.device("meta")
    # vLLM's FlashInfer cache: K and V packed in the last dim, read as two views
    cache = torch.empty(table.numel(), PAGE, hkv, 2 * HEAD_DIM, dtype=torch.bfloat16,
                        device=meta).split(HEAD_DIM, dim=-1)
    with patch.dict(sys.modules, flashinfer=FLASHINFER):  # DCPAttention takes its kernels
        attn = DCPAttention(torch.empty(1, dtype=torch.uint8, device=meta), hq, hkv, HEAD_DIM,
                            PAGE, torch.bfloat16, HEAD_DIM ** -0.5, "NHD")
    attn._fast_plan_decode = lambda *args, **kwargs: None
    return attn, cache


def _layer(attn, cache, step, plan, planned):
    """One layer of ``PCPFlashInferImpl``'s forward under -dcp on meta tensors, less
    vLLM's cache write."""
    from vllm_pcp.pcp.exchange import gather_kv

    (hq, hkv), meta = HEADS, torch.device("meta")
    n, padded = plan.num_local_tokens, step.plan.num_padded_tokens_per_rank
    tokens = max(padded, n)
    q, out = (torch.empty(tokens, hq, HEAD_DIM, dtype=torch.bfloat16, device=meta)
              for _ in range(2))
    k = torch.empty(tokens, hkv, HEAD_DIM, dtype=torch.bfloat16, device=meta)
    ctx_rows = 0 if plan.ctx_gather is None else plan.ctx_gather.num_padded

    def layer():
        if step.gathered:  # the context read before this step's write
            k_step, v_step = gather_kv(GROUP, k[:padded], k[:padded], padded,
                                       planned.read_context(cache), ctx_rows)
        else:
            k_step = v_step = k[:n]
        return attn.run(planned, GROUP, q[:n], k_step, v_step, cache, out=out[:n])
    return layer


def measure(step: str, exchange: str) -> dict:
    """One layer's counts at ``step`` and context exchange ``exchange``, the first and a
    later layer's; the host time of the step's partition (``partition_host_ms``: the
    plugin's manager) and of its DCP plan (``plan_host_ms``: ``build_dcp_plan`` and
    ``DCPAttention.plan``)."""
    import vllm.v1.attention.backends.flashinfer  # noqa: F401  (before the stand-ins)
    from bench_steps import unpin_host_memory_without_cuda
    from vllm_pcp.dcp.plan import build_dcp_plan

    unpin_host_memory_without_cuda()
    computed, scheduled, _ = step_batch(step)
    (hq, hkv), meta = HEADS, torch.device("meta")
    pages = -(-(max(computed) + max(scheduled)) // (PAGE * WORLD)) + 1
    table = torch.arange(len(computed) * pages, dtype=torch.int32).view(-1, pages)
    attn, cache = _attention(table)
    s, partition = split_step(step, exchange)

    def plan():
        return build_dcp_plan(s, INTERLEAVE, context_exchange=exchange, kv_to_q_heads=hkv / hq)
    partition_ms = _host_ms(partition)
    plan_ms = _host_ms(lambda: attn.plan(plan(), table))  # CPU table: index work only
    p = plan()
    layer = _layer(attn, cache, s, p, attn.plan(p, table.to(meta), kv_gathered=s.gathered))
    counted = []
    for _ in range(2):  # the step's first layer, then a later one
        COUNT.ops, COUNT.calls = {}, {}
        with COUNT:
            layer()
        counted.append(_counts())
    return {"step": step, "exchange": exchange, "interleave": INTERLEAVE,
            "gathered": s.gathered, **counted[0], "later_layer": counted[1],
            "partition_host_ms": partition_ms, "plan_host_ms": plan_ms}


if __name__ == "__main__":
    from vllm.utils.torch_utils import set_torch_threads_for_runtime

    ap = ArgumentParser(description=__doc__, formatter_class=RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    set_torch_threads_for_runtime()
    rows = [measure(step, exchange) for step, exchange in STEPS]
    meta = results.meta(shlex.join(["python", "benchmarks/dcp_host.py", *sys.argv[1:]]),
                        device="CPU, meta tensors (no GPU)")
    results.write(os.path.dirname(os.path.abspath(args.out)), os.path.basename(args.out),
                  {"meta": meta, "runs": [{"git_rev": meta["git_rev"][:7], "rows": rows}]})
