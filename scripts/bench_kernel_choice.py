"""FlashInfer kernel choices for one PCP rank's new-token attention, timed on one GPU.

    python scripts/bench_kernel_choice.py --out kernel-choice.json

One attention layer of the Qwen2.5-3B shape (16 query heads, 2 kv heads, head_dim 128,
bf16, page size 16) on an unchunked prompt with no context, split as ``-pcp N`` splits
it (DualChunkSwap, :mod:`vllm_pcp.pcp.partition`): 2N chunks, rank r owns chunks r and
2N-1-r, each a row attending causally (bottom-right) to its request's first ``seq_len``
tokens. Per case ``NxP`` (N ranks, a P-token prompt) and rank, rows of the output:

    paged      BatchPrefillWithPagedKVCacheWrapper over a paged cache holding the whole
               prompt, causal=True: what -pcp N runs at DCP = 1 (vLLM's FlashInfer prefill)
    ragged     BatchPrefillWithRaggedKVCacheWrapper over each row's K/V (the prompt's
               first seq_len tokens, contiguous), causal: what -dcp runs for new tokens
    kv_gather  the two index_selects that build the ragged rows' K/V from the prompt's
               (DCP's layer does them before the ragged kernel)
    kv_copy    one device copy of the rank's K/V, P/N * 2 * kv_heads * head_dim * 2
               bytes: a stand-in for the K/V exchange

each attention kernel with FlashInfer's backends fa2, fa3 and auto, planned once and run
many times (CUDA events, warm-up, median / p10 / p90 of ``--runs`` runs); the N = 1 row of
a prompt is the one-GPU whole-prompt attention (paged, auto: stock vLLM). ``exact``: the
row's output equals the rank's paged auto output (torch.testing.assert_close, the bf16
tolerances of tests/gpu); the paged auto row's, that it equals the one-GPU output at the
rank's tokens. Queries are scaled so that each row's softmax falls on a few keys: a wrong
mask or head mapping then moves outputs by O(1), far past the tolerance, and rounding
stays far below it.

The summary, per case: every choice's time on the slowest rank (a step waits for it), the
fastest exact choice and its speed-up over paged auto, the kv_gather a ragged kernel
would add at DCP = 1, kv_copy, and the one-GPU time over the best.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import time
from dataclasses import dataclass

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
from kernel_choice_lib import (ATTENTION_KERNELS, HEAD_DIM, HEADS, PAGE,  # noqa: E402
                               RankRows, build_result, git_rev, kv_exchange_bytes,
                               paged_layout, parse_cases, ragged_layout, rank_rows, spread,
                               whole_prompt_rows)

DEFAULT_CASES = "2x32768,4x32768,2x131072"
BACKENDS = ("fa2", "fa3", "auto")
TOL = dict(atol=3e-2, rtol=3e-2)  # bf16 inputs, as tests/gpu
QUERY_SCALE = 4.0  # scores of std 4: each row's softmax falls on a few keys
WORKSPACE_BYTES = 394 << 20  # vLLM's FlashInfer workspace


def time_ms(fn, runs: int, warmup: int) -> list[float]:
    """``runs`` times of ``fn()`` in milliseconds, CUDA events around each, after
    ``warmup`` untimed runs. The GPU first sleeps a little so that the host queues
    the runs ahead of it: short kernels are timed without launch gaps."""
    import torch

    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
              for _ in range(runs)]
    if hasattr(torch.cuda, "_sleep"):
        torch.cuda._sleep(20_000_000)  # about 10 ms
    for start, end in events:
        start.record()
        fn()
        end.record()
    torch.cuda.synchronize()
    return [start.elapsed_time(end) for start, end in events]


@dataclass
class Prompt:
    """One prompt's tensors on the GPU: ``q [P, Hq, D]``, ``k``/``v [P, Hkv, D]``, and the
    paged cache ``[pages, 2, PAGE, Hkv, D]`` (vLLM's NHD layout) holding K/V in order."""

    q: object
    k: object
    v: object
    cache: object


def make_prompt(prompt_len: int, seed: int) -> Prompt:
    """Random bf16 queries (scaled by QUERY_SCALE), keys and values of one prompt."""
    import torch

    hq, hkv = HEADS
    gen = torch.Generator(device="cuda").manual_seed(seed)

    def randn(*shape):
        return torch.randn(*shape, generator=gen, device="cuda", dtype=torch.bfloat16)

    q = randn(prompt_len, hq, HEAD_DIM) * QUERY_SCALE
    k, v = randn(prompt_len, hkv, HEAD_DIM), randn(prompt_len, hkv, HEAD_DIM)
    pages = -(-prompt_len // PAGE)
    cache = torch.zeros(pages * PAGE, 2, hkv, HEAD_DIM, dtype=torch.bfloat16, device="cuda")
    cache[:prompt_len, 0], cache[:prompt_len, 1] = k, v
    cache = cache.view(pages, PAGE, 2, hkv, HEAD_DIM).transpose(1, 2).contiguous()
    return Prompt(q=q, k=k, v=v, cache=cache)


def _plan_kwargs() -> dict:
    import torch

    return dict(causal=True, sm_scale=HEAD_DIM ** -0.5, q_data_type=torch.bfloat16,
                kv_data_type=torch.bfloat16, o_data_type=torch.bfloat16)


def paged_attention(rows: RankRows, prompt: Prompt, backend: str, workspace):
    """A planned paged prefill over the prompt's cache: a function writing ``[L, Hq, D]``."""
    import flashinfer
    import torch

    indptr, indices, last = paged_layout(rows.kv_lens)
    wrapper = flashinfer.BatchPrefillWithPagedKVCacheWrapper(workspace, "NHD", backend=backend)
    wrapper.plan(torch.from_numpy(rows.qo_indptr), torch.from_numpy(indptr),
                 torch.from_numpy(indices).cuda(), torch.from_numpy(last), *HEADS, HEAD_DIM,
                 PAGE, **_plan_kwargs())
    q = prompt.q.index_select(0, torch.from_numpy(rows.local_tokens).cuda())
    out = torch.empty_like(q)
    return lambda: wrapper.run(q, prompt.cache, out=out)


def ragged_attention(rows: RankRows, prompt: Prompt, backend: str, workspace):
    """A planned ragged prefill over each row's contiguous K/V: a function writing
    ``[L, Hq, D]``; and the K/V gather it reads (a function, timed on its own)."""
    import flashinfer
    import torch

    kv_indptr, kv_index = ragged_layout(rows.kv_lens)
    index = torch.from_numpy(kv_index).cuda()
    k_rows, v_rows = prompt.k.index_select(0, index), prompt.v.index_select(0, index)

    def gather():
        torch.index_select(prompt.k, 0, index, out=k_rows)
        torch.index_select(prompt.v, 0, index, out=v_rows)

    wrapper = flashinfer.BatchPrefillWithRaggedKVCacheWrapper(workspace, "NHD", backend=backend)
    wrapper.plan(torch.from_numpy(rows.qo_indptr), torch.from_numpy(kv_indptr), *HEADS,
                 HEAD_DIM, **_plan_kwargs())
    q = prompt.q.index_select(0, torch.from_numpy(rows.local_tokens).cuda())
    out = torch.empty_like(q)
    return (lambda: wrapper.run(q, k_rows, v_rows, out=out)), gather


def is_close(out, expect) -> bool:
    """``out`` equals ``expect`` at TOL (torch.testing.assert_close)."""
    import torch

    try:
        torch.testing.assert_close(out, expect, **TOL)
        return True
    except AssertionError:
        return False


def _row(world: int, prompt_len: int, rank: int, kernel: str, backend: str,
         times: list[float], exact: bool | None, **extra) -> dict:
    return {"N": world, "prompt_len": prompt_len, "rank": rank, "kernel": kernel,
            "backend": backend, **spread(times), "exact": exact, **extra}


def first_call(key: str, make_run, first_call_s: dict):
    """``make_run()`` (plan) and one run of what it returns, the seconds of both kept
    in ``first_call_s[key]`` the first time (FlashInfer's JIT compile on a fresh host):
    ``(made, output)``."""
    import torch

    start = time.perf_counter()
    made = make_run()
    out = (made[0] if isinstance(made, tuple) else made)()
    torch.cuda.synchronize()
    first_call_s.setdefault(key, round(time.perf_counter() - start, 1))
    return made, out


def measure_one_gpu(prompt: Prompt, prompt_len: int, args, workspace, first_call_s: dict):
    """The one-GPU row of a prompt and its output ``[P, Hq, D]``."""
    run, out = first_call("one_gpu-paged-auto", lambda: paged_attention(
        whole_prompt_rows(prompt_len), prompt, "auto", workspace), first_call_s)
    out = out.clone()
    times = time_ms(run, args.runs, args.warmup)
    return _row(1, prompt_len, 0, "paged", "auto", times, None), out


def _choices(backends: tuple[str, ...]) -> list[tuple[str, str]]:
    """(kernel, backend) in the order timed: paged auto first (the reference), then the
    other backends' paged, then ragged."""
    rest = [(k, b) for k in ATTENTION_KERNELS for b in backends if (k, b) != ("paged", "auto")]
    return [("paged", "auto"), *rest]


def measure_attention(rows: RankRows, prompt: Prompt, case: tuple[int, int, int], args,
                      workspace, one_gpu_out, first_call_s: dict) -> list[dict]:
    """The rows of one rank: each (kernel, backend), then the K/V gather.
    ``case``: (N, prompt length, rank). ``first_call_s`` gathers each choice's first
    plan-and-run seconds (FlashInfer's JIT compile on a fresh host)."""
    import torch

    local = torch.from_numpy(rows.local_tokens).cuda()
    expect, out_rows, gather = one_gpu_out.index_select(0, local), [], None
    for kernel, backend in _choices(args.backends):
        make = paged_attention if kernel == "paged" else ragged_attention
        made, out = first_call(f"{kernel}-{backend}",
                               lambda: make(rows, prompt, backend, workspace), first_call_s)
        run, gather = made if kernel == "ragged" else (made, gather)
        exact = is_close(out, expect)
        diff = float((out.float() - expect.float()).abs().max())
        out_rows.append(_row(*case, kernel, backend, time_ms(run, args.runs, args.warmup),
                             exact, max_abs_diff=round(diff, 5)))
        if (kernel, backend) == ("paged", "auto"):  # the others must equal -pcp N's own
            expect = out.clone()
    if gather is not None:
        out_rows.append(_row(*case, "kv_gather", "torch",
                             time_ms(gather, args.runs, args.warmup), None))
    return out_rows


def measure_copy(case: tuple[int, int, int], args) -> dict:
    """The kv_copy row: one device copy of the rank's K/V exchange bytes."""
    import torch

    world, prompt_len, _ = case
    padded = -(-prompt_len // world)  # the largest rank's local tokens
    size = kv_exchange_bytes(padded)
    src = torch.empty(size, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    times = time_ms(lambda: dst.copy_(src), args.runs, args.warmup)
    return _row(*case, "kv_copy", "torch", times, None, bytes=size)


def measure(cases: list[tuple[int, int]], args, first_call_s: dict) -> list[dict]:
    """Every row: per prompt length, its one-GPU row, then each case's ranks."""
    import torch

    workspace = torch.empty(WORKSPACE_BYTES, dtype=torch.uint8, device="cuda")
    rows = []
    for prompt_len in sorted({length for _, length in cases}):
        prompt = make_prompt(prompt_len, args.seed)
        one_gpu, one_gpu_out = measure_one_gpu(prompt, prompt_len, args, workspace,
                                               first_call_s)
        rows.append(one_gpu)
        _log(f"one GPU {prompt_len}: {one_gpu['median_ms']} ms")
        for world in [w for w, length in cases if length == prompt_len]:
            for rank in range(world):
                case, layout = (world, prompt_len, rank), rank_rows(prompt_len, world, rank)
                rank_out = measure_attention(layout, prompt, case, args, workspace, one_gpu_out,
                                             first_call_s)
                rows += rank_out + [measure_copy(case, args)]
                _log(f"N={world} P={prompt_len} rank {rank}: " + ", ".join(
                    f"{r['kernel']}-{r['backend']} {r['median_ms']}" for r in rank_out))
        del prompt, one_gpu_out
        torch.cuda.empty_cache()
    return rows


START = time.perf_counter()


def _log(text: str) -> None:
    print(f"[{time.perf_counter() - START:6.1f} s] {text}", flush=True)


def gpu_meta(args, first_call_s: dict) -> dict:
    """What the run was: command, revision, GPU, versions, date, shape, settings."""
    import flashinfer
    import torch

    return {"command": " ".join(["python", "scripts/bench_kernel_choice.py", *sys.argv[1:]]),
            "git_rev": git_rev(), "gpu": torch.cuda.get_device_name(0),
            "torch": torch.__version__, "flashinfer": flashinfer.__version__,
            "cuda": torch.version.cuda, "date": datetime.date.today().isoformat(),
            "shape": {"q_heads": HEADS[0], "kv_heads": HEADS[1], "head_dim": HEAD_DIM,
                      "dtype": "bfloat16", "page_size": PAGE, "kv_layout": "NHD"},
            "runs": args.runs, "warmup": args.warmup, "tolerance": TOL,
            "query_scale": QUERY_SCALE, "first_call_s": first_call_s,
            "wall_s": round(time.perf_counter() - START, 1)}


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, help="the JSON file to write")
    ap.add_argument("--cases", default=DEFAULT_CASES,
                    help=f"NxPROMPT_LEN, comma-separated (default {DEFAULT_CASES})")
    ap.add_argument("--backends", default=",".join(BACKENDS),
                    help="FlashInfer backends to time (default fa2,fa3,auto)")
    ap.add_argument("--runs", type=int, default=25, help="timed runs per row (default 25)")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    args.backends = tuple(b.strip() for b in args.backends.split(",") if b.strip())
    if args.runs < 2:
        ap.error("--runs must be at least 2")
    return args


def main(argv=None) -> None:
    args = parse_args(argv)
    cases = parse_cases(args.cases)
    first_call_s: dict = {}
    rows = measure(cases, args, first_call_s)
    result = build_result(rows, gpu_meta(args, first_call_s))
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    for s in result["summary"]:
        best = s["best"] or {}
        _log(f"N={s['N']} P={s['prompt_len']}: best {best.get('kernel')}-{best.get('backend')} "
             f"{best.get('ms')} ms, {s['speedup_over_paged_auto']}x paged auto "
             f"({s['paged_auto_ms']} ms); one GPU {s['one_gpu_ms']} ms")


if __name__ == "__main__":
    main()
