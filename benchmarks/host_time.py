"""Host time of one attention layer's plugin work on one GPU: -pcp 2 -dcp 2 against -pcp 2.

    python benchmarks/host_time.py --out host-time.json

Rank 0 of 2 on the steps of ``benchmarks/dcp_host.py`` (``mixed``: 15 decodes at a 16K
context beside the second 8K chunk of a 16K prompt; ``prefill``: that chunk alone;
``decode``: the decodes alone), the bench model's heads, real tensors and FlashInfer kernels.
The other rank is stood in: its collectives give this rank's tensors back (copies), so no
NCCL time is in the figures. Per step and layout:

    plan_ms    the step's plan on the host, once per step: the split (or the DCP plan) and
               its FlashInfer plans, timed with the GPU idle (mean of RUNS)
    plan_parts_ms  where the plan's host time goes (the same calls, GPU idle): ``split``, the
               plugin's split (``build_pcp_metadata``, ``build_dcp_plan``); ``flashinfer``,
               FlashInfer's ``plan`` calls; ``rest``, the plugin's index work and its copies
               to the device
    plan_top   the plan's functions with the most own host time (cProfile over RUNS plans,
               GPU idle): ``[function, calls per plan, ms per plan]``
    plan_waits whether the plan waits for the GPU: queued behind a GPU sleep of about a
               second, its first call takes more than half of it (a plan that waits cannot
               run ahead of the step before it)
    layer_ms   host time of one layer: the K/V all-gather, the cache write and attention,
               launched while the GPU is kept busy, so no launch waits for it (mean of RUNS)
    gpu_ms     the same layer's GPU time (CUDA events), for scale
    layer_top  the same for the layer, launched while the GPU is kept busy
    syncs      host-device synchronizations in one layer call (torch's sync debug mode; the
               second of two calls), and ``sync_sites`` where they are

-pcp 2's layer is the plugin's K/V gather and write and the paged prefill and decode calls
vLLM's FlashInfer forward makes for its rows; vLLM's own Python around them is not in it.
"""
from __future__ import annotations

import contextlib
import os
import shlex
import statistics
import sys
import time
import warnings
from argparse import ArgumentParser, RawDescriptionHelpFormatter
from types import SimpleNamespace

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from dcp_host import CHUNK, INTERLEAVE, STEPS, WORLD, step_batch  # noqa: E402
from kernel_choice import HEAD_DIM, HEADS, PAGE, WORKSPACE_BYTES  # noqa: E402
import results  # noqa: E402  (kernel_choice put tests/engine on the path)

RUNS, WARMUP = 10, 3
PLAN_PARTS = ("split", "flashinfer")  # plan_parts_ms, less "rest"
_OPEN = "open"  # key of ``parts`` set while a timed call runs
_clock = time.perf_counter


def _timed(fn, parts: dict, part: str):
    """``fn`` adding its host time (ms) to ``parts[part]``, unless it runs inside another
    timed call of ``parts`` (vLLM's ``fast_plan_decode`` calls the wrapper's ``plan``),
    whose time holds it already."""
    def run(*args, **kwargs):
        if parts.get(_OPEN):
            return fn(*args, **kwargs)
        parts[_OPEN] = True
        start = _clock()
        try:
            return fn(*args, **kwargs)
        finally:
            parts[part] = parts.get(part, 0.0) + (_clock() - start) * 1e3
            parts[_OPEN] = False
    return run


GROUP = SimpleNamespace(  # rank 0 of WORLD: every rank's tensors are this rank's
    world_size=WORLD, rank_in_group=0,
    all_gather=lambda x, dim=0: torch.cat([x] * WORLD, dim=dim),
    all_to_all=lambda x: x.clone())


def _cache_write(device):
    """vLLM's cache write (``reshape_and_cache_flash``; plain torch off the GPU)."""
    if device.type == "cuda":
        from vllm import _custom_ops as ops

        one = torch.ones(1, device=device)
        return lambda k, v, cache, slots: ops.reshape_and_cache_flash(
            k, v, cache[0], cache[1], slots, "auto", one, one)

    def write(k, v, cache, slots):
        keep = slots >= 0
        for view, x in zip(cache, (k, v)):
            view.view(-1, *x.shape[1:])[slots[keep]] = x[keep]
    return write


def _setup(computed, scheduled, device, shard: int):
    """The batch's block table, a cache holding ``1 / shard`` of each sequence, q, k, v."""
    (hq, hkv), dtype = HEADS, torch.bfloat16
    pages = -(-(max(computed) + max(scheduled)) // (PAGE * shard)) + 1
    table = torch.arange(len(computed) * pages, dtype=torch.int32, device=device).view(-1, pages)
    # vLLM's FlashInfer cache: K and V packed in the last dim, read as two views
    cache = torch.randn(table.numel(), PAGE, hkv, 2 * HEAD_DIM, dtype=dtype,
                        device=device).split(HEAD_DIM, dim=-1)
    tokens = sum(scheduled)
    q, k, v = (torch.randn(tokens, h, HEAD_DIM, dtype=dtype, device=device) for h in (hq, hkv, hkv))
    return table, cache, q, k, v


def dcp_layer(step: str, exchange: str, device, scale: int = 1):
    """``(plan(), layer())`` of -pcp 2 -dcp 2 rank 0: the step's plan, one layer's work."""
    from vllm_pcp.dcp.attention import DCPAttention
    from vllm_pcp.dcp.plan import build_dcp_plan
    from vllm_pcp.pcp.exchange import gather_kv

    computed, scheduled, prompts = step_batch(step, scale)
    table, cache, q, k, v = _setup(computed, scheduled, device, WORLD)
    (hq, hkv), write = HEADS, _cache_write(device)
    attn = DCPAttention(torch.empty(WORKSPACE_BYTES, dtype=torch.uint8, device=device), hq, hkv,
                        HEAD_DIM, PAGE, torch.bfloat16, HEAD_DIM ** -0.5, "NHD")
    state, parts = {}, {}
    split = _timed(build_dcp_plan, parts, "split")
    for wrapper in (attn._new, attn._split, attn._replicated, attn._decode):
        wrapper.plan = _timed(wrapper.plan, parts, "flashinfer")
    attn._fast_plan_decode = _timed(attn._fast_plan_decode, parts, "flashinfer")

    def plan():
        p = split(computed, scheduled, WORLD, 0, INTERLEAVE, min_split_tokens=CHUNK // scale,
                  prefill_lens=prompts, context_exchange=exchange, kv_to_q_heads=hkv / hq)
        state.update(plan=p, planned=attn.plan(p, table))
    plan.parts = parts

    def layer():
        p, planned = state["plan"], state["planned"]
        if p.decode is not None:  # vLLM's write of the owned tokens, then the shard
            write(k, v, cache, _slots(len(k), table, device))
            return attn.run(planned, GROUP, q, None, None, cache)
        m, padded = len(p.pcp.local_token_indices), p.pcp.num_padded_tokens_per_rank
        rows = 0 if p.ctx_gather is None else p.ctx_gather.num_padded
        context = planned.read_context(cache)
        k_buf, v_buf = gather_kv(GROUP, k[:m], v[:m], padded,
                                 *((context, rows) if context is not None else ()))
        write(k_buf, v_buf, cache, _slots(len(k_buf), table, device))
        return attn.run(planned, GROUP, q[:m], k_buf, v_buf, cache)
    return plan, layer


def pcp_layer(step: str, device, scale: int = 1):
    """``(plan(), layer())`` of -pcp 2 rank 0 (DCP = 1): the split and FlashInfer's plans of
    its decode and prefill rows, as vLLM's FlashInfer forward calls them."""
    import flashinfer

    from vllm_pcp.dcp.index import paged_kv_layout
    from vllm_pcp.pcp.exchange import gather_kv
    from vllm_pcp.pcp.partition import build_pcp_metadata, min_chunk_tokens

    computed, scheduled, prompts = step_batch(step, scale)
    table, cache, q, k, v = _setup(computed, scheduled, device, 1)
    (hq, hkv), write, dtype = HEADS, _cache_write(device), torch.bfloat16
    workspace = torch.empty(WORKSPACE_BYTES, dtype=torch.uint8, device=device)
    decode = flashinfer.BatchDecodeWithPagedKVCacheWrapper(workspace, "NHD",
                                                           use_tensor_cores=True)
    prefill = flashinfer.BatchPrefillWithPagedKVCacheWrapper(workspace, "NHD", backend="auto")
    state, parts = {}, {}
    split = _timed(build_pcp_metadata, parts, "split")
    decode.plan = _timed(decode.plan, parts, "flashinfer")
    prefill.plan = _timed(prefill.plan, parts, "flashinfer")

    def plan():
        p = split(computed, scheduled, WORLD, 0, min_split_tokens=CHUNK // scale,
                  prefill_lens=prompts, min_chunk_tokens=min_chunk_tokens(WORLD, 1))
        rows = table.index_select(0, p.row_req_indices.to(device, torch.int64, non_blocking=True))
        indptr, indices, last = paged_kv_layout(p.seq_lens, rows, PAGE)
        nd, qsl = p.num_decode_rows, p.query_start_loc
        kw = dict(q_data_type=dtype, kv_data_type=dtype, sm_scale=HEAD_DIM ** -0.5)
        pages = indptr[nd:] - indptr[nd]
        if nd:
            decode.plan(indptr[:nd + 1], indices[:int(indptr[nd])], last[:nd], hq, hkv,
                        HEAD_DIM, PAGE, **kw)
        if p.num_rows > nd:
            prefill.plan(qsl[nd:] - qsl[nd], pages, indices[int(indptr[nd]):], last[nd:], hq,
                         hkv, HEAD_DIM, PAGE, causal=True, **kw)
        state.update(plan=p, decodes=p.num_decode_tokens)
    plan.parts = parts

    def layer():
        p, nd = state["plan"], state["decodes"]
        m = p.num_local_tokens
        k_buf, v_buf = gather_kv(GROUP, k[:m], v[:m], p.num_padded_tokens_per_rank)
        write(k_buf, v_buf, cache, _slots(len(k_buf), table, device))
        out = torch.empty_like(q[:m])
        if nd:
            decode.run(q[:nd], cache, out=out[:nd])
        if m > nd:
            prefill.run(q[nd:m], cache, out=out[nd:])
        return out
    return plan, layer


def _slots(rows: int, table: torch.Tensor, device) -> torch.Tensor:
    """Slots for ``rows`` written rows, every other one -1 (another rank's token)."""
    slots = torch.arange(rows, device=device) % (table.numel() * PAGE)
    return torch.where(slots % 2 == 0, slots, torch.full_like(slots, -1))


SLEEP_CYCLES = 2_000_000_000  # about a second of GPU time on an H200


@contextlib.contextmanager
def _gpu_queue(device, busy: bool):
    """On a GPU: the GPU idle, then (``busy``) a GPU sleep queued, so that no launch inside
    waits for the GPU; synchronized again after."""
    if device.type == "cuda":
        torch.cuda.synchronize()
        if busy:
            torch.cuda._sleep(SLEEP_CYCLES)
    yield
    if device.type == "cuda":
        torch.cuda.synchronize()


def _host_ms(fn, device, runs: int = RUNS) -> float:
    """Mean host time of ``runs`` calls of ``fn``, queued behind a GPU sleep on a GPU, so
    that no launch waits for the GPU."""
    for _ in range(WARMUP):
        fn()
    with _gpu_queue(device, busy=True):
        start = time.perf_counter()
        for _ in range(runs):
            fn()
        host = (time.perf_counter() - start) * 1e3 / runs
    return round(host, 4)


def _sleep_ms(device) -> float | None:
    """GPU time of one ``torch.cuda._sleep(SLEEP_CYCLES)`` (ms)."""
    if device.type != "cuda":
        return None
    start, end = (torch.cuda.Event(enable_timing=True) for _ in range(2))
    start.record()
    torch.cuda._sleep(SLEEP_CYCLES)
    end.record()
    end.synchronize()
    return start.elapsed_time(end)


def _plan_ms(plan, device, runs: int = RUNS) -> tuple[float, dict]:
    """Mean host ms of ``runs`` plans with the GPU idle, and of their parts
    (:data:`PLAN_PARTS`, then ``rest``: the plan's time less theirs) in the same runs."""
    for _ in range(WARMUP):
        plan()
    with _gpu_queue(device, busy=False):
        plan.parts.clear()
        start = time.perf_counter()
        for _ in range(runs):
            plan()
        total = (time.perf_counter() - start) * 1e3
    parts = {name: plan.parts.get(name, 0.0) for name in PLAN_PARTS}
    parts["rest"] = total - sum(parts.values())
    return round(total / runs, 4), {name: round(ms / runs, 4) for name, ms in parts.items()}


def _top(fn, device, busy: bool, runs: int = RUNS, top: int = 12) -> list:
    """The functions with the most own host time over ``runs`` calls of ``fn`` (cProfile;
    behind a GPU sleep if ``busy``): ``[[function, calls per run, ms per run], ...]``."""
    import cProfile
    import pstats

    fn()
    profile = cProfile.Profile()
    with _gpu_queue(device, busy):
        profile.enable()
        for _ in range(runs):
            fn()
        profile.disable()
    stats = sorted(pstats.Stats(profile).stats.items(), key=lambda kv: -kv[1][2])[:top]
    return [[f"{os.path.basename(path)}:{line}({name})", round(calls / runs, 2),
             round(own * 1e3 / runs, 4)] for (path, line, name), (_, calls, own, _, _) in stats]


def _waits_for_gpu(fn, device, sleep_ms: float | None) -> bool | None:
    """Whether one call of ``fn`` queued behind a GPU sleep lasts more than half of it."""
    if sleep_ms is None:
        return None
    return _host_ms(fn, device, runs=1) > sleep_ms / 2


def _gpu_ms(fn, device) -> float | None:
    if device.type != "cuda":
        return None
    from kernel_choice import time_ms

    return round(statistics.median(time_ms(fn)), 4)


def _syncs(fn, device) -> tuple[int | None, list[str]]:
    """Synchronizing calls in one ``fn()``, as torch's sync debug mode warns of them, and
    where (``file:line``). The call is made twice and the second counted: the first may
    meet a one-time synchronization of the process, which belongs to no layer."""
    if device.type != "cuda":
        return None, []
    caught = []
    for _ in range(2):
        torch.cuda.synchronize()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                fn()
            finally:
                torch.cuda.set_sync_debug_mode("default")
    synced = [w for w in caught if "synchroniz" in str(w.message)]
    return len(synced), sorted({f"{os.path.basename(w.filename)}:{w.lineno}" for w in synced})


def measure(device: torch.device, scale: int = 1) -> list[dict]:
    """A row per step and layout: plan_ms, plan_parts_ms, plan_top, plan_waits, layer_ms,
    layer_top, gpu_ms, syncs."""
    out, sleep_ms = [], _sleep_ms(device)
    for step, exchange in STEPS:
        for layout, (plan, layer) in (
                (f"pcp2-dcp2-i{INTERLEAVE}-{exchange}", dcp_layer(step, exchange, device, scale)),
                ("pcp2", pcp_layer(step, device, scale) if exchange == "keys" else (None, None))):
            if plan is None:
                continue
            plan_ms, parts = _plan_ms(plan, device)
            waits = _waits_for_gpu(plan, device, sleep_ms)
            out.append({"step": step, "layout": layout, "plan_ms": plan_ms,
                        "plan_parts_ms": parts, "plan_top": _top(plan, device, busy=False),
                        "plan_waits": waits, "layer_ms": _host_ms(layer, device),
                        "layer_top": _top(layer, device, busy=True),
                        "gpu_ms": _gpu_ms(layer, device),
                        **dict(zip(("syncs", "sync_sites"), _syncs(layer, device)))})
    return out


def ratios(rows: list[dict]) -> list[dict]:
    """Per step: each DCP layout's host time (a step's plan plus 36 layers) over -pcp 2's."""
    def step_ms(r):
        return r["plan_ms"] + 36 * r["layer_ms"]
    base = {r["step"]: step_ms(r) for r in rows if r["layout"] == "pcp2"}
    return [{"step": r["step"], "layout": r["layout"], "host_ms_per_step": round(step_ms(r), 3),
             "over_pcp2": round(step_ms(r) / base[r["step"]], 3) if base.get(r["step"]) else None}
            for r in rows if r["layout"] != "pcp2"]


if __name__ == "__main__":
    ap = ArgumentParser(description=__doc__, formatter_class=RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    rows = measure(torch.device("cuda"))
    meta = results.meta(shlex.join(["python", "benchmarks/host_time.py", *sys.argv[1:]]),
                        runs=RUNS, warmup=WARMUP, layers=36,
                        stood_in="the other rank: its collectives give this rank's tensors")
    results.write(os.path.dirname(os.path.abspath(args.out)), os.path.basename(args.out),
                  {"meta": meta, "rows": rows, "summary": ratios(rows)})
