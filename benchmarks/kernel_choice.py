"""FlashInfer kernel choices for one PCP rank's new-token attention, timed on one GPU.

    python benchmarks/kernel_choice.py --out kernel-choice.json [--cases 2x32768,4x32768]
        [--context C]

The bench model's attention (bf16, page 16) on a prompt split as ``-pcp N`` splits it: per
case ``NxS`` and rank, FlashInfer's ``paged`` prefill over the cache and ``ragged`` prefill
over the step's K/V (every key the rows read) with fa2, fa3 and auto, ragged's
``kv_gather``, a ``kv_copy`` of the rank's K/V. ``exact``: equal to paged auto's output,
held to one GPU's (queries scaled: a wrong mask moves outputs by O(1)).

``--context C``: the S tokens are a chunk after C tokens of the prompt already in the cache
(chunked prefill). Then also ``ragged+paged``: the rows' new keys (``C ..`` the row's end) on
the ragged kernel, causal, their context ``0 .. C`` on the paged kernel, the two merged by
LSE (``merge_state``), with the gather of the new keys (``kv_gather_new``).
"""
from __future__ import annotations

import json
import os
import shlex
import statistics
import sys
import time
from argparse import ArgumentParser, RawDescriptionHelpFormatter
from types import SimpleNamespace

import numpy as np
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tests", "engine"))
import results  # noqa: E402

with open(os.path.join(ROOT, "configs", "models", "qwen2.5-3b-shape.json")) as _f:
    HF = json.load(_f)
HEADS = (HF["num_attention_heads"], HF["num_key_value_heads"])  # (query heads, kv heads)
HEAD_DIM, PAGE = HF["head_dim"], 16  # PAGE: vLLM's default block size
CHOICES = [("paged", "auto"), ("paged", "fa2"), ("paged", "fa3"), ("ragged", "fa2"),
           ("ragged", "fa3"), ("ragged", "auto")]  # paged auto first: the others' reference
TOL, QUERY_SCALE = dict(atol=3e-2, rtol=3e-2), 4.0
RUNS, WARMUP, WORKSPACE_BYTES = 25, 3, 394 << 20  # vLLM's FlashInfer workspace


def rank_rows(prompt_len: int, world: int, rank: int, context: int = 0) -> SimpleNamespace:
    """Rank ``rank``'s rows of a chunk of ``prompt_len`` tokens after ``context`` cached ones
    (chunks ``rank`` and ``2N-1-rank`` of 2N; the whole chunk at N = 1), each attending to
    the prompt up to its end: ``qo_indptr`` [R + 1], ``kv_lens`` [R] int32, ``local_tokens``
    [L] int64 (positions in the prompt)."""
    n = 2 * world
    chunks = [(0, prompt_len)] if world == 1 else [
        (prompt_len * c // n, prompt_len * (c + 1) // n) for c in (rank, n - 1 - rank)]
    chunks = [(context + lo, context + hi) for lo, hi in chunks]
    return SimpleNamespace(
        kv_lens=np.array([hi for _, hi in chunks], np.int32),
        qo_indptr=np.cumsum([0] + [hi - lo for lo, hi in chunks]).astype(np.int32),
        local_tokens=np.concatenate([np.arange(lo, hi, dtype=np.int64) for lo, hi in chunks]))


def row(world: int, prompt_len: int, rank: int, kernel: str, backend: str,
        times: list[float], exact: bool | None, **extra) -> dict:
    """One timed row: ``median_ms``, ``p10_ms``, ``p90_ms`` of ``times``."""
    deciles = statistics.quantiles(times, n=10, method="inclusive")
    return {"N": world, "prompt_len": prompt_len, "rank": rank, "kernel": kernel,
            "backend": backend, "median_ms": round(statistics.median(times), 4),
            "p10_ms": round(deciles[0], 4), "p90_ms": round(deciles[-1], 4),
            "exact": exact, **extra}


def _slowest(rows: list[dict], choice: str) -> float | None:
    ms = [r["median_ms"] for r in rows if f"{r['kernel']}-{r['backend']}" == choice]
    return max(ms) if ms else None


def _ratio(num: float | None, den: float | None) -> float | None:
    return round(num / den, 3) if num is not None and den else None


def summarize(rows: list[dict]) -> list[dict]:
    """Per (N, prompt) with N > 1: each choice on its slowest rank, the fastest choice exact
    on every rank, one GPU's time (the N = 1 row) over it."""
    one_gpu = {r["prompt_len"]: r["median_ms"] for r in rows if r["N"] == 1}
    out = []
    for world, length in dict.fromkeys((r["N"], r["prompt_len"]) for r in rows if r["N"] > 1):
        case = [r for r in rows if (r["N"], r["prompt_len"]) == (world, length)]
        names = [f"{k}-{b}" for k in ("paged", "ragged", "ragged+paged")
                 for b in sorted({r["backend"] for r in case if r["kernel"] == k})]
        choices = {c: _slowest(case, c) for c in names}
        exact = {c: all(r["exact"] is True for r in case
                        if f"{r['kernel']}-{r['backend']}" == c) for c in names}
        ok = [c for c in names if exact[c]]
        best = min(ok, key=choices.get) if ok else None
        best_ms, paged_ms, one = choices.get(best), choices.get("paged-auto"), one_gpu.get(length)
        ragged = [choices[c] for c in ok if c.startswith("ragged-")]
        gather_ms = _slowest(case, "kv_gather-torch")
        out.append({
            "N": world, "prompt_len": length, "slowest_rank_ms": choices, "exact": exact,
            "best": best and dict(zip(("kernel", "backend"), best.split("-", 1)), ms=best_ms),
            "paged_auto_ms": paged_ms, "speedup_over_paged_auto": _ratio(paged_ms, best_ms),
            "kv_gather_ms": gather_ms,
            "best_ragged_with_gather_ms": (round(min(ragged) + gather_ms, 4)
                                           if ragged and gather_ms is not None else None),
            **({"kv_gather_new_ms": new_ms, "ragged_paged_with_gather_ms": round(
                choices["ragged+paged-auto"] + new_ms, 4)}
               if (new_ms := _slowest(case, "kv_gather_new-torch")) is not None else {}),
            "kv_copy_ms": _slowest(case, "kv_copy-torch"), "one_gpu_ms": one,
            "one_gpu_over_best": _ratio(one, best_ms),
            "one_gpu_over_paged_auto": _ratio(one, paged_ms)})
    return out


def time_ms(fn) -> list[float]:
    """CUDA-event times of ``RUNS`` calls of ``fn()``, queued behind a GPU sleep (no gaps)."""
    for _ in range(WARMUP):
        fn()
    torch.cuda.synchronize()
    events = [[torch.cuda.Event(enable_timing=True) for _ in range(2)] for _ in range(RUNS)]
    torch.cuda._sleep(20_000_000)
    for start, end in events:
        start.record()
        fn()
        end.record()
    torch.cuda.synchronize()
    return [start.elapsed_time(end) for start, end in events]


def _paged(rows, kv_lens: np.ndarray, backend: str, workspace, plan: dict):
    """A paged prefill wrapper planned for ``rows`` reading ``kv_lens`` keys each: row j
    pages 0 .. ceil(kv_lens[j] / PAGE) - 1 of the one request."""
    import flashinfer

    t, pages = torch.from_numpy, -(-kv_lens // PAGE)
    indices = t(np.concatenate([np.arange(n, dtype=np.int32) for n in pages])).cuda()
    w = flashinfer.BatchPrefillWithPagedKVCacheWrapper(workspace, "NHD", backend=backend)
    w.plan(t(rows.qo_indptr), t(np.concatenate([[0], np.cumsum(pages)]).astype(np.int32)),
           indices, t((kv_lens - (pages - 1) * PAGE).astype(np.int32)), *HEADS, HEAD_DIM, PAGE,
           **plan)
    return w


def attention(kernel: str, rows: SimpleNamespace, prompt, backend: str, workspace,
              context: int = 0):
    """A planned prefill: ``(run, gather)``, gather the K/V copies ragged reads (or None).
    ``ragged+paged``: keys from ``context`` on on the ragged kernel, the context paged."""
    import flashinfer

    t, dtype = torch.from_numpy, torch.bfloat16
    plan = dict(causal=True, sm_scale=HEAD_DIM ** -0.5, q_data_type=dtype, kv_data_type=dtype,
                o_data_type=dtype)
    q = prompt.q.index_select(0, t(rows.local_tokens).cuda())
    out = torch.empty_like(q)
    if kernel == "paged":
        w = _paged(rows, rows.kv_lens, backend, workspace, plan)
        return (lambda: w.run(q, prompt.cache, out=out)), None
    first = context if kernel == "ragged+paged" else 0
    index = t(np.concatenate([np.arange(first, n) for n in rows.kv_lens])).cuda()
    k, v = prompt.k.index_select(0, index), prompt.v.index_select(0, index)

    def gather():
        torch.index_select(prompt.k, 0, index, out=k)
        torch.index_select(prompt.v, 0, index, out=v)

    w = flashinfer.BatchPrefillWithRaggedKVCacheWrapper(workspace, "NHD", backend=backend)
    w.plan(t(rows.qo_indptr),
           t(np.concatenate([[0], np.cumsum(rows.kv_lens - first)]).astype(np.int32)),
           *HEADS, HEAD_DIM, **plan)
    if kernel == "ragged":
        return (lambda: w.run(q, k, v, out=out)), gather
    ctx = _paged(rows, np.full_like(rows.kv_lens, context), backend, workspace,
                 {**plan, "causal": False})
    lse = torch.empty(q.shape[:2], dtype=torch.float32, device=q.device)
    ctx_out, ctx_lse = torch.empty_like(q), torch.empty_like(lse)

    def run():
        w.run(q, k, v, out=out, lse=lse, return_lse=True)
        ctx.run(q, prompt.cache, out=ctx_out, lse=ctx_lse, return_lse=True)
        return flashinfer.merge_state(out, lse, ctx_out, ctx_lse)[0]
    return run, gather


def make_prompt(prompt_len: int) -> SimpleNamespace:
    """A prompt's random ``q`` (scaled), ``k``, ``v`` [T, H, D] and its paged ``cache``
    [pages, 2, PAGE, Hkv, D] (NHD pages) holding k and v (bf16, seed 0)."""
    gen = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(prompt_len, h, HEAD_DIM, generator=gen, device="cuda",
                           dtype=torch.bfloat16) for h in (HEADS[0], HEADS[1], HEADS[1]))
    pages = -(-prompt_len // PAGE)
    cache = k.new_zeros(pages * PAGE, 2, HEADS[1], HEAD_DIM)
    cache[:prompt_len, 0], cache[:prompt_len, 1] = k, v
    cache = cache.view(pages, PAGE, 2, HEADS[1], HEAD_DIM).transpose(1, 2).contiguous()
    return SimpleNamespace(q=q * QUERY_SCALE, k=k, v=v, cache=cache)


def measure(cases: list[tuple[int, int]], context: int = 0) -> list[dict]:
    """Per prompt length its one-GPU row, then per case and rank: each choice (paged auto
    first, the others' reference), the gathers, the copy of the largest rank's K/V."""
    workspace = torch.empty(WORKSPACE_BYTES, dtype=torch.uint8, device="cuda")
    choices = CHOICES + ([("ragged+paged", "auto")] if context else [])
    out = []
    for prompt_len in sorted({p for _, p in cases}):
        prompt = make_prompt(context + prompt_len)
        run, _ = attention("paged", rank_rows(prompt_len, 1, 0, context), prompt, "auto",
                           workspace)
        one_gpu_out = run().clone()
        out.append(row(1, prompt_len, 0, "paged", "auto", time_ms(run), None))
        for case in [(w, prompt_len, r) for w, p in cases if p == prompt_len for r in range(w)]:
            rows = rank_rows(prompt_len, case[0], case[2], context)
            expect = one_gpu_out.index_select(
                0, torch.from_numpy(rows.local_tokens - context).cuda())
            gathers = {}
            for kernel, backend in choices:
                run, gathers[kernel] = attention(kernel, rows, prompt, backend, workspace,
                                                 context)
                got = run()
                diff = round(float((got.float() - expect.float()).abs().max()), 5)
                out.append(row(*case, kernel, backend, time_ms(run),
                               torch.allclose(got, expect, **TOL), max_abs_diff=diff))
                expect = got.clone() if (kernel, backend) == choices[0] else expect
            size = -(-prompt_len // case[0]) * 2 * HEADS[1] * HEAD_DIM * 2  # bytes of K, V
            src, dst = (torch.empty(size, dtype=torch.uint8, device="cuda") for _ in range(2))
            out += [row(*case, "kv_gather", "torch", time_ms(gathers["ragged"]), None),
                    row(*case, "kv_copy", "torch", time_ms(lambda: dst.copy_(src)), None,
                        bytes=size)]
            if context:
                out.append(row(*case, "kv_gather_new", "torch",
                               time_ms(gathers["ragged+paged"]), None))
        del prompt, one_gpu_out
        torch.cuda.empty_cache()
    return out


def parse_cases(text: str) -> list[tuple[int, int]]:
    """``"2x32768,4x131072"`` as ``[(N, prompt_len), ...]``; exits on N < 2 or a prompt
    shorter than 4N tokens."""
    cases = [tuple(int(x) for x in c.lower().split("x")) for c in text.split(",")]
    if bad := [c for c in cases if c[0] < 2 or c[1] < 4 * c[0]]:
        raise SystemExit(f"cases {bad}: need N >= 2 and a prompt of >= 4N tokens")
    return cases


if __name__ == "__main__":
    ap = ArgumentParser(description=__doc__, formatter_class=RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--cases", default="2x32768,4x32768,2x131072", help="NxPROMPT_LEN,...")
    ap.add_argument("--context", type=int, default=0,
                    help="tokens of the prompt cached before the chunk (a multiple of 16)")
    args = ap.parse_args()
    cases = parse_cases(args.cases)
    if args.context % PAGE:
        raise SystemExit(f"--context {args.context}: a multiple of {PAGE}")
    start = time.perf_counter()
    rows = measure(cases, args.context)
    meta = results.meta(
        shlex.join(["python", "benchmarks/kernel_choice.py", *sys.argv[1:]]),
        shape={"q_heads": HEADS[0], "kv_heads": HEADS[1], "head_dim": HEAD_DIM,
               "dtype": "bfloat16", "page_size": PAGE, "kv_layout": "NHD"},
        runs=RUNS, warmup=WARMUP, tolerance=TOL, query_scale=QUERY_SCALE, context=args.context,
        wall_s=round(time.perf_counter() - start, 1))
    results.write(os.path.dirname(os.path.abspath(args.out)), os.path.basename(args.out),
                  {"meta": meta, "rows": rows, "summary": summarize(rows)})
