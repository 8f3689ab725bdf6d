"""Host work of one PCP x DCP attention layer, measured without a GPU.

    python scripts/bench_dcp_host.py --out host.json

A step is planned as the engine plans it (``build_dcp_plan`` on rank 0 of 2, the
Qwen2.5-3B shape: 16 query / 2 kv heads, head_dim 128) and one layer's plugin
work runs on PyTorch's meta device: the context read, the K/V exchange's buffer
(:func:`vllm_pcp.pcp.exchange.gather_kv`) and :meth:`DCPAttention.run`. FlashInfer's
wrappers and merges and the process group are stand-ins that only return
tensors of the right shape, so what is left is the plugin's own per-layer host
work: the aten ops it dispatches, ``kernel_ops`` of them leaving out views and
allocations (which launch nothing on a GPU), its collectives and FlashInfer calls.
Counts only: the meta device runs some ops through Python implementations, so
its times say nothing of a GPU host's. FlashInfer's own work, the collectives
and the cache write are not in the counts.

Steps: ``mixed`` (15 decoding requests at 16K context beside the second 8K chunk
of a 16K prompt, with each context exchange), ``prefill`` (that chunk alone),
``decode`` (the 15 decodes alone, the folded decode step).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from types import SimpleNamespace

import torch
from torch.utils._python_dispatch import TorchDispatchMode

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)
import kernel_choice_lib  # noqa: E402

HEADS = (*kernel_choice_lib.HEADS, kernel_choice_lib.HEAD_DIM)  # the bench model's
PAGE, WORLD, RANK = kernel_choice_lib.PAGE, 2, 0
# ops that launch nothing on a GPU: views and allocations
NO_KERNEL = {"view", "slice", "select", "detach", "transpose", "as_strided", "unsqueeze",
             "expand", "permute", "split", "t", "alias", "_unsafe_view", "empty",
             "new_empty", "empty_like", "split_with_sizes", "unbind"}
DECODES, CONTEXT, PROMPT, CHUNK = 15, 16000, 16384, 8192


class _Count(TorchDispatchMode):
    """Counts the aten ops dispatched outside the stand-ins."""

    def __init__(self):
        super().__init__()
        self.ops, self.paused = {}, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not self.paused:
            name = func.overloadpacket.__name__
            self.ops[name] = self.ops.get(name, 0) + 1
        return func(*args, **(kwargs or {}))


COUNT: _Count | None = None


def _standin(fn):
    """Run ``fn`` with op counting paused: the stand-in's tensors are not plugin work."""
    def run(*args, **kwargs):
        if COUNT is not None:
            COUNT.paused += 1
        try:
            return fn(*args, **kwargs)
        finally:
            if COUNT is not None:
                COUNT.paused -= 1
    return run


class _Wrapper:
    """A FlashInfer wrapper that plans nothing and returns outputs of the right shape."""

    def __init__(self, *args, **kwargs):
        self.runs = 0

    def plan(self, *args, **kwargs):
        pass

    @_standin
    def run(self, q, *args, out=None, lse=None, return_lse=False, **kwargs):
        self.runs += 1
        out = torch.empty_like(q) if out is None else out
        lse = torch.empty(q.shape[:2], dtype=torch.float32, device=q.device) if lse is None else lse
        return (out, lse) if return_lse else out


@_standin
def _merge_state(v_a, s_a, v_b, s_b):
    return torch.empty_like(v_a), torch.empty_like(s_a)


@_standin
def _merge_states(v, s):
    return torch.empty_like(v[:, 0]), torch.empty_like(s[:, 0])


def _merge_state_in_place(v, s, v_other, s_other):
    pass


class _Group:
    """Rank 0 of ``WORLD``: collectives return tensors of the gathered shape."""

    world_size, rank_in_group = WORLD, RANK

    def __init__(self):
        self.calls = 0

    @_standin
    def all_gather(self, x, dim=0):
        self.calls += 1
        shape = list(x.shape)
        shape[dim] *= self.world_size
        return x.new_empty(shape)

    @_standin
    def all_to_all(self, x):
        self.calls += 1
        return torch.empty_like(x)


def _steps() -> dict[str, tuple[list[int], list[int], list[int]]]:
    """(computed, scheduled, prompt lengths) of each step."""
    dec_c = [CONTEXT + i for i in range(DECODES)]
    return {"mixed": (dec_c + [CHUNK], [1] * DECODES + [PROMPT - CHUNK - DECODES],
                      [c + 1 for c in dec_c] + [PROMPT]),
            "prefill": ([CHUNK], [PROMPT - CHUNK], [PROMPT]),
            "decode": (dec_c, [1] * DECODES, [c + 1 for c in dec_c])}


def _layer(step: str, exchange: str, interleave: int):
    """A DCPAttention, the step it planned and a function running one layer's plugin work."""
    import vllm.v1.attention.backends.flashinfer  # noqa: F401  (before the stand-ins)
    from vllm_pcp.dcp.attention import DCPAttention
    from vllm_pcp.dcp.plan import build_dcp_plan
    from vllm_pcp.pcp.exchange import gather_kv

    computed, scheduled, prompts = _steps()[step]
    hq, hkv, dim = HEADS
    meta, dtype = torch.device("meta"), torch.bfloat16
    plan = build_dcp_plan(computed, scheduled, WORLD, RANK, interleave, min_split_tokens=CHUNK,
                          prefill_lens=prompts, context_exchange=exchange,
                          kv_to_q_heads=hkv / hq)
    pages = -(-(max(computed) + max(scheduled)) // (PAGE * WORLD)) + 1
    table = torch.arange(len(computed) * pages, dtype=torch.int32).view(-1, pages).to(meta)
    cache = tuple(torch.empty(len(computed) * pages, PAGE, hkv, dim, dtype=dtype, device=meta)
                  for _ in range(2))
    real = sys.modules.get("flashinfer")
    sys.modules["flashinfer"] = SimpleNamespace(  # DCPAttention takes its kernels at init
        BatchPrefillWithRaggedKVCacheWrapper=_Wrapper, BatchPrefillWithPagedKVCacheWrapper=_Wrapper,
        BatchDecodeWithPagedKVCacheWrapper=_Wrapper, merge_state=_merge_state,
        merge_states=_merge_states, merge_state_in_place=_merge_state_in_place)
    try:
        attn = DCPAttention(torch.empty(1, dtype=torch.uint8, device=meta), hq, hkv, dim, PAGE,
                            dtype, dim ** -0.5, "NHD")
    finally:
        sys.modules["flashinfer"] = real
    attn._fast_plan_decode = lambda *args, **kwargs: None
    planned = attn.plan(plan, table)
    group, tokens = _Group(), sum(scheduled)
    q = torch.empty(tokens, hq, dim, dtype=dtype, device=meta)
    k = torch.empty(tokens, hkv, dim, dtype=dtype, device=meta)
    if plan.decode is not None:
        return attn, planned, group, lambda: attn.run(planned, group, q, None, None, cache)
    local = plan.pcp.local_token_indices
    n, padded = len(local), plan.pcp.num_padded_tokens_per_rank
    ctx_rows = 0 if plan.ctx_gather is None else plan.ctx_gather.num_padded

    def layer():
        context = planned.read_context(cache)
        args = (context, ctx_rows) if context is not None else ()
        k_buf, v_buf = gather_kv(group, k[:n], k[:n], padded, *args)
        return attn.run(planned, group, q[:n], k_buf, v_buf, cache)

    return attn, planned, group, layer


def measure(step: str, exchange: str, interleave: int) -> dict:
    global COUNT
    attn, planned, group, layer = _layer(step, exchange, interleave)
    COUNT = _Count()
    with COUNT:
        layer()
    ops, COUNT = COUNT.ops, None
    wrappers = {id(w): w for w in (attn._new, attn._split, attn._replicated, attn._decode,
                                   planned.decode_wrapper) if w is not None}
    runs = sum(w.runs for w in wrappers.values())
    return {"step": step, "exchange": exchange, "interleave": interleave,
            "aten_ops": sum(ops.values()),
            "kernel_ops": sum(n for op, n in ops.items() if op not in NO_KERNEL),
            "ops": dict(sorted(ops.items())),
            "flashinfer_runs": runs, "collectives": group.calls}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--interleave", type=int, default=8)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    rows = [measure(step, exchange, args.interleave)
            for step, exchange in (("mixed", "keys"), ("mixed", "queries"),
                                   ("prefill", "keys"), ("decode", "keys"))]
    meta = {"git_rev": kernel_choice_lib.git_rev(),
            "command": " ".join([os.path.basename(sys.argv[0]), *sys.argv[1:]]),
            "torch": torch.__version__, "cpu": os.cpu_count()}
    with open(args.out, "w") as f:
        json.dump({"meta": meta, "rows": rows}, f, indent=1)
    for r in rows:
        print(r["step"], r["exchange"], "aten ops", r["aten_ops"], "kernel ops", r["kernel_ops"],
              "collectives", r["collectives"], "flashinfer runs", r["flashinfer_runs"])


if __name__ == "__main__":
    main()
