"""Host time of one attention layer's plugin work on one GPU: -pcp 2 -dcp 2 against -pcp 2.

    python benchmarks/host_time.py --out host-time.json

Rank 0 of 2 on the steps of ``benchmarks/dcp_host.py`` (``mixed``: 15 decodes at a 16K
context beside the second 8K chunk of a 16K prompt; ``prefill``: that chunk alone;
``decode``: the decodes alone), the bench model's heads, real tensors and FlashInfer kernels.
Each step is split by the plugin's PCP manager on the GPU, as in an engine, torch's CPU ops
on one thread as vLLM runs them while serving. The other rank is stood in: its collectives
give this rank's tensors back (copies), so no NCCL time is in the figures. Per step and
layout:

    plan_ms    the step's plan on the host, once per step: the manager's partition of the
               global batch and its slot mapping, the DCP plan, FlashInfer's plans, timed
               with the GPU idle (mean of RUNS)
    plan_parts_ms  where the plan's host time goes (the same calls, GPU idle):
               ``partition``, the manager (``GQAPCPManager.partition_batch``, vLLM's with
               the plugin's split, and its slot mapping); ``dcp_plan``, ``build_dcp_plan``;
               ``flashinfer``, FlashInfer's ``plan`` calls; ``rest``, the plugin's index
               work and its copies to the device
    plan_top   the plan's functions with the most own host time (cProfile over RUNS plans,
               GPU idle): ``[function, calls per plan, ms per plan]``
    plan_waits whether the plan waits for the GPU: queued behind a GPU sleep of about a
               second, its first call takes more than half of it (a plan that waits cannot
               run ahead of the step before it)
    layer_ms   host time of one layer: the K/V all-gather (where the step gathers), the
               cache write and attention, launched while the GPU is kept busy, so no
               launch waits for it (mean of RUNS)
    gpu_ms     the same layer's GPU time (CUDA events), for scale
    layer_top  the same for the layer, launched while the GPU is kept busy
    syncs      host-device synchronizations in one layer call (torch's sync debug mode; the
               second of two calls), and ``sync_sites`` where they are

-pcp 2's layer is the plugin's K/V gather and vLLM's cache write and the paged prefill and
decode calls vLLM's FlashInfer forward makes for its rows (every step here has cached
context, so no ragged kernel); vLLM's own Python around them is not in it.
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
from bench_steps import (cache_write, dcp_slots, eager, global_batch, manager,  # noqa: E402
                         settings)
from dcp_host import CHUNK, INTERLEAVE, STEPS, WORLD, step_batch  # noqa: E402
from kernel_choice import HEAD_DIM, HEADS, PAGE, WORKSPACE_BYTES  # noqa: E402
import results  # noqa: E402  (kernel_choice put tests/engine on the path)

RUNS, WARMUP, LAYERS = 10, 3, 36
PLAN_PARTS = ("partition", "dcp_plan", "flashinfer")  # plan_parts_ms, less "rest"
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


def _setup(computed, scheduled, device, shard: int) -> SimpleNamespace:
    """The batch's block table, a cache holding ``1 / shard`` of each sequence, q, k, v
    of every step token, a layer output buffer."""
    (hq, hkv), dtype = HEADS, torch.bfloat16
    pages = -(-(max(computed) + max(scheduled)) // (PAGE * shard)) + 1
    table = torch.arange(len(computed) * pages, dtype=torch.int32, device=device).view(-1, pages)
    # vLLM's FlashInfer cache: K and V packed in the last dim, read as two views
    cache = torch.randn(table.numel(), PAGE, hkv, 2 * HEAD_DIM, dtype=dtype,
                        device=device).split(HEAD_DIM, dim=-1)
    tokens = sum(scheduled)
    q, k, v = (torch.randn(tokens, h, HEAD_DIM, dtype=dtype, device=device) for h in (hq, hkv, hkv))
    return SimpleNamespace(table=table, cache=cache, q=q, k=k, v=v, out=torch.empty_like(q))


def _split(step: str, device, scale: int, dcp: int, exchange: str = "auto"):
    """The step's global batch and rank 0's manager at -pcp 2 (-dcp ``dcp``)."""
    computed, scheduled, prompts = step_batch(step, scale)
    s = settings(WORLD, dcp, CHUNK // scale, context_exchange=exchange)
    batch = global_batch(computed, scheduled, prompts, device)
    m = manager(s, 0, device, len(computed), sum(scheduled), INTERLEAVE if dcp > 1 else 1)
    return (computed, scheduled), batch, m


def _timed_manager(m, parts: dict):
    """The manager's partition and slot mapping, timed into ``parts["partition"]``."""
    partition = _timed(m.partition_batch, parts, "partition")
    convert = _timed(m._convert_to_gathered_slot_mappings, parts, "partition")
    return partition, (lambda slots: convert(slots.unsqueeze(0))[0])


def dcp_layer(step: str, exchange: str, device, scale: int = 1):
    """``(plan(), layer())`` of -pcp 2 -dcp 2 rank 0: the step's plan, one layer's work
    (``PCPFlashInferImpl``'s forward under -dcp)."""
    from vllm_pcp.dcp.attention import DCPAttention
    from vllm_pcp.dcp.plan import build_dcp_plan
    from vllm_pcp.pcp.exchange import gather_kv, with_context_rows

    (computed, scheduled), batch, m = _split(step, device, scale, WORLD, exchange)
    t, (hq, hkv), write = _setup(computed, scheduled, device, WORLD), HEADS, cache_write(device)
    slots = dcp_slots(computed, scheduled, t.table, PAGE, WORLD, INTERLEAVE)
    attn = DCPAttention(torch.empty(WORKSPACE_BYTES, dtype=torch.uint8, device=device), hq, hkv,
                        HEAD_DIM, PAGE, torch.bfloat16, HEAD_DIM ** -0.5, "NHD")
    state, parts, desc = {}, {}, eager()
    partition, slot_mapping = _timed_manager(m, parts)
    dcp_plan = _timed(build_dcp_plan, parts, "dcp_plan")
    for wrapper in (attn._new, attn._split, attn._replicated, attn._decode):
        wrapper.plan = _timed(wrapper.plan, parts, "flashinfer")
    attn._fast_plan_decode = _timed(attn._fast_plan_decode, parts, "flashinfer")

    def plan():
        s = partition(batch, desc).pcp.step
        p = dcp_plan(s, INTERLEAVE, context_exchange=exchange, kv_to_q_heads=hkv / hq)
        local_table = t.table.index_select(0, s.plan.row_req_indices.to(device, torch.int64))
        rows = torch.from_numpy(s.first_local_row()).to(device, non_blocking=True)
        planned = attn.plan(p, local_table.index_select(0, rows), kv_gathered=s.gathered)
        ctx = 0 if p.ctx_gather is None else p.ctx_gather.num_padded
        slot = slot_mapping(slots)
        if s.gathered and ctx:
            slot = with_context_rows(slot, s.plan.num_padded_tokens_per_rank, ctx)
        state.update(step=s, plan=p, planned=planned, slots=slot, context_rows=ctx)
    plan.parts = parts

    def layer():
        s, p, planned = state["step"], state["plan"], state["planned"]
        n, padded = p.num_local_tokens, s.plan.num_padded_tokens_per_rank
        if s.gathered:  # the context read before this step's write
            k, v = gather_kv(GROUP, t.k[:padded], t.v[:padded], padded,
                             planned.read_context(t.cache), state["context_rows"])
            write(k, v, t.cache, state["slots"])
        else:  # vLLM's write of this rank's rows; every rank holds the step's tokens
            write(t.k[:padded], t.v[:padded], t.cache, state["slots"])
            k, v = t.k[:n], t.v[:n]
        return attn.run(planned, GROUP, t.q[:n], k, v, t.cache, out=t.out[:n])
    return plan, layer


def _flashinfer_dcp1(workspace, parts: dict) -> SimpleNamespace:
    """vLLM's FlashInfer wrappers at DCP = 1 (decode on tensor cores, paged prefill) and
    its ``fast_plan_decode``, their plans timed into ``parts["flashinfer"]``."""
    import flashinfer
    from vllm.v1.attention.backends.flashinfer import fast_plan_decode

    decode = flashinfer.BatchDecodeWithPagedKVCacheWrapper(workspace, "NHD",
                                                           use_tensor_cores=True)
    prefill = flashinfer.BatchPrefillWithPagedKVCacheWrapper(workspace, "NHD", backend="auto")
    decode.plan = _timed(decode.plan, parts, "flashinfer")
    prefill.plan = _timed(prefill.plan, parts, "flashinfer")
    return SimpleNamespace(decode=decode, prefill=prefill,
                           fast_plan_decode=_timed(fast_plan_decode, parts, "flashinfer"))


def _plan_rows(fi: SimpleNamespace, p, table: torch.Tensor) -> None:
    """Plan a rank's rows as vLLM's FlashInfer builder does: decode rows first, on the
    decode kernel, the others on the paged prefill kernel."""
    from vllm_pcp.dcp.index import paged_kv_layout

    (hq, hkv), dtype = HEADS, torch.bfloat16
    rows = table.index_select(0, p.row_req_indices.to(table.device, torch.int64,
                                                      non_blocking=True))
    indptr, indices, last = paged_kv_layout(p.seq_lens, rows, PAGE)
    nd, qsl = p.num_decode_rows, p.query_start_loc
    kw = dict(q_data_type=dtype, kv_data_type=dtype, o_data_type=dtype,
              sm_scale=HEAD_DIM ** -0.5)
    if nd:
        fi.fast_plan_decode(fi.decode, indptr[:nd + 1], indices, last[:nd], p.seq_lens[:nd],
                            hq, hkv, HEAD_DIM, PAGE, **kw)
    if p.num_rows > nd:
        fi.prefill.plan(qsl[nd:] - qsl[nd], indptr[nd:] - indptr[nd],
                        indices[int(indptr[nd]):], last[nd:], hq, hkv, HEAD_DIM, PAGE,
                        causal=True, seq_lens=p.seq_lens[nd:], **kw)


def pcp_layer(step: str, device, scale: int = 1):
    """``(plan(), layer())`` of -pcp 2 rank 0 (DCP = 1): the manager's split and
    FlashInfer's plans of its rows; the layer's K/V all-gather (where the step gathers),
    cache write, decode and prefill calls."""
    from vllm_pcp.pcp.exchange import gather_kv

    (computed, scheduled), batch, m = _split(step, device, scale, 1)
    t, write = _setup(computed, scheduled, device, 1), cache_write(device)
    slots = dcp_slots(computed, scheduled, t.table, PAGE)
    state, parts, desc = {}, {}, eager()
    partition, slot_mapping = _timed_manager(m, parts)
    fi = _flashinfer_dcp1(torch.empty(WORKSPACE_BYTES, dtype=torch.uint8, device=device), parts)

    def plan():
        s = partition(batch, desc).pcp.step
        _plan_rows(fi, s.plan, t.table)
        state.update(step=s, slots=slot_mapping(slots))
    plan.parts = parts

    def layer():
        s = state["step"]
        p = s.plan
        n, nd, padded = p.num_local_tokens, p.num_decode_tokens, p.num_padded_tokens_per_rank
        k, v = t.k[:padded], t.v[:padded]
        if s.gathered:  # the slot mapping covers every rank's rows
            k, v = gather_kv(GROUP, k, v, padded)
        write(k, v, t.cache, state["slots"])
        if nd:
            fi.decode.run(t.q[:nd], t.cache, out=t.out[:nd])
        if n > nd:
            fi.prefill.run(t.q[nd:n], t.cache, out=t.out[nd:n])
        return t.out[:n]
    return plan, layer


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


def _row(step: str, layout: str, plan, layer, device, sleep_ms) -> dict:
    plan_ms, parts = _plan_ms(plan, device)
    waits = _waits_for_gpu(plan, device, sleep_ms)
    return {"step": step, "layout": layout, "plan_ms": plan_ms, "plan_parts_ms": parts,
            "plan_top": _top(plan, device, busy=False), "plan_waits": waits,
            "layer_ms": _host_ms(layer, device), "layer_top": _top(layer, device, busy=True),
            "gpu_ms": _gpu_ms(layer, device),
            **dict(zip(("syncs", "sync_sites"), _syncs(layer, device)))}


def measure(device: torch.device, scale: int = 1) -> list[dict]:
    """A row per step and layout: plan_ms, plan_parts_ms, plan_top, plan_waits, layer_ms,
    layer_top, gpu_ms, syncs; -pcp 2 once per step (beside its ``keys`` row)."""
    out, sleep_ms = [], _sleep_ms(device)
    for step, exchange in STEPS:
        out.append(_row(step, f"pcp2-dcp2-i{INTERLEAVE}-{exchange}",
                        *dcp_layer(step, exchange, device, scale), device, sleep_ms))
        if exchange == "keys":
            out.append(_row(step, "pcp2", *pcp_layer(step, device, scale), device, sleep_ms))
    return out


def ratios(rows: list[dict], layers: int = LAYERS) -> list[dict]:
    """Per step: each DCP layout's host time (a step's plan plus ``layers`` layers) over
    -pcp 2's."""
    def step_ms(r):
        return r["plan_ms"] + layers * r["layer_ms"]
    base = {r["step"]: step_ms(r) for r in rows if r["layout"] == "pcp2"}
    return [{"step": r["step"], "layout": r["layout"], "host_ms_per_step": round(step_ms(r), 3),
             "over_pcp2": round(step_ms(r) / base[r["step"]], 3) if base.get(r["step"]) else None}
            for r in rows if r["layout"] != "pcp2"]


if __name__ == "__main__":
    from vllm.utils.torch_utils import set_torch_threads_for_runtime

    ap = ArgumentParser(description=__doc__, formatter_class=RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    set_torch_threads_for_runtime()
    rows = measure(torch.device("cuda"))
    meta = results.meta(shlex.join(["python", "benchmarks/host_time.py", *sys.argv[1:]]),
                        runs=RUNS, warmup=WARMUP, layers=LAYERS,
                        stood_in="the other rank: its collectives give this rank's tensors")
    results.write(os.path.dirname(os.path.abspath(args.out)), os.path.basename(args.out),
                  {"meta": meta, "rows": rows, "summary": ratios(rows)})
