"""A one-GPU projection of a split prefill's TTFT: what the slowest rank computes, timed.

    python benchmarks/projection.py --out projection.json [--cases 2x32768,4x131072]

A projection, not a TTFT: per case ``NxT`` (a T-token prompt split over N ranks), one GPU
times, for each rank, one layer of the bench model as that rank runs it on a split step, with
the other ranks' K/V given rather than gathered:

    gemms      the layer's projections and MLP (QKV, O, gate-up, down: cuBLAS through torch)
               and its norms and activation, on the rank's P = T / N rows
    attention  its rows (chunks r and 2N-1-r) over the paged cache on the engine's kernel
               (``paged``, FlashInfer auto), and on the ragged kernel over the step's K/V
               with its gather (``ragged``, the faster choice of benchmarks/kernel_choice.py)
    write      the cache write of all T tokens' K/V (every rank keeps the whole cache)

against one GPU's layer over the whole prompt (the same pieces at N = 1), both times the
model's layers. Left out: the all-gathers, whose bytes per layer and per step are listed
(``kv_gather_bytes_per_layer``, ``restore_bytes``) so that a run on N GPUs can check the
projection; the embedding and the final norm and logits (one row). ``goal`` and ``goal_met``:
the projected speed-up a case is held to on the ragged kernel (:data:`GOALS`).
"""
from __future__ import annotations

import os
import shlex
import statistics
import sys
import time
from argparse import ArgumentParser, RawDescriptionHelpFormatter
from types import SimpleNamespace

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import kernel_choice as kc  # noqa: E402
import results  # noqa: E402  (kernel_choice put tests/engine on the path)

HIDDEN, FFN = kc.HF["hidden_size"], kc.HF["intermediate_size"]
LAYERS = kc.HF["num_hidden_layers"]
QKV = (kc.HEADS[0] + 2 * kc.HEADS[1]) * kc.HEAD_DIM
PIECES = ("gemms", "attention", "write")
# the projected speed-up each case is held to, on the ragged kernel (what fresh split
# prompts take at pcp_split_attention auto): (N, prompt length) -> at least
GOALS = {(2, 32768): 2.10, (2, 131072): 2.15, (4, 131072): 4.0}


def gemms(rows: int, weights: SimpleNamespace):
    """One layer's GEMMs, norms and activation on ``rows`` tokens (bf16; the query part of
    the QKV output stands in for the attention output the O projection takes)."""
    x = torch.randn(rows, HIDDEN, device="cuda", dtype=torch.bfloat16)
    norm = torch.nn.functional.rms_norm

    def run():
        h = norm(x, (HIDDEN,), weights.norm)
        h = (h @ weights.qkv)[:, : kc.HEADS[0] * kc.HEAD_DIM] @ weights.o + x
        up = norm(h, (HIDDEN,), weights.norm) @ weights.gate_up
        return (torch.nn.functional.silu(up[:, :FFN]) * up[:, FFN:]) @ weights.down + h
    return run


def layer_weights() -> SimpleNamespace:
    """One layer's weights of the bench model (bf16, random) on the GPU, for :func:`gemms`."""
    bf16 = dict(device="cuda", dtype=torch.bfloat16)
    return SimpleNamespace(norm=torch.ones(HIDDEN, **bf16),
                           qkv=torch.randn(HIDDEN, QKV, **bf16) * 0.02,
                           o=torch.randn(kc.HEADS[0] * kc.HEAD_DIM, HIDDEN, **bf16) * 0.02,
                           gate_up=torch.randn(HIDDEN, 2 * FFN, **bf16) * 0.02,
                           down=torch.randn(FFN, HIDDEN, **bf16) * 0.02)


def cache_write(prompt, tokens: int):
    """The write of ``tokens`` tokens' K and V into the paged cache, token t at slot t (the
    paged layout of :func:`kernel_choice.make_prompt`)."""
    pages, slots = (torch.arange(tokens, device="cuda") // kc.PAGE,
                    torch.arange(tokens, device="cuda") % kc.PAGE)
    k, v = prompt.k[:tokens], prompt.v[:tokens]

    def run():
        prompt.cache[pages, 0, slots] = k
        prompt.cache[pages, 1, slots] = v
    return run


def _ms(fn) -> float:
    return round(statistics.median(kc.time_ms(fn)), 4)


def measure(cases: list[tuple[int, int]]) -> list[dict]:
    """Per prompt length its one-GPU pieces, then per case and rank the rank's pieces (ms)."""
    workspace = torch.empty(kc.WORKSPACE_BYTES, dtype=torch.uint8, device="cuda")
    weights, out = layer_weights(), []
    for prompt_len in sorted({p for _, p in cases}):
        prompt = kc.make_prompt(prompt_len)
        write = _ms(cache_write(prompt, prompt_len))
        for world, rank in [(1, 0)] + [(w, r) for w, p in cases if p == prompt_len
                                       for r in range(w)]:
            rows = kc.rank_rows(prompt_len, world, rank)
            local = int(rows.qo_indptr[-1])
            paged, _ = kc.attention("paged", rows, prompt, "auto", workspace)
            ragged, gather = kc.attention("ragged", rows, prompt, "auto", workspace)
            out.append({"N": world, "prompt_len": prompt_len, "rank": rank, "rows": local,
                        "gemms": _ms(gemms(local, weights)), "attention_paged": _ms(paged),
                        "attention_ragged": _ms(ragged), "ragged_gather": _ms(gather),
                        "write": write})
        del prompt
        torch.cuda.empty_cache()
    return out


def project(rows: list[dict], layers: int = LAYERS) -> list[dict]:
    """Per case (N > 1): the slowest rank's layer on each attention kernel, times ``layers``,
    against one GPU's (paged) model; the all-gather bytes a run on N GPUs adds; the
    case's goal (:data:`GOALS`) and whether the ragged kernel's projection meets it."""
    def layer_ms(r: dict, kernel: str) -> float:
        attention = r["attention_paged"] if kernel == "paged" else (
            r["attention_ragged"] + r["ragged_gather"])
        return r["gemms"] + attention + r["write"]

    one = {r["prompt_len"]: layer_ms(r, "paged") * layers for r in rows if r["N"] == 1}
    out = []
    for world, length in dict.fromkeys((r["N"], r["prompt_len"]) for r in rows if r["N"] > 1):
        ranks = [r for r in rows if (r["N"], r["prompt_len"]) == (world, length)]
        per_rank = -(-length // world)  # P: the padded rows each rank sends
        kernels = {k: round(max(layer_ms(r, k) for r in ranks) * layers, 3)
                   for k in ("paged", "ragged")}
        out.append({
            "N": world, "prompt_len": length, "one_gpu_ms": round(one[length], 3),
            "slowest_rank_ms": kernels,
            "projected_speedup": {k: round(one[length] / ms, 3) for k, ms in kernels.items()},
            "kv_gather_bytes_per_layer": world * per_rank * 2 * kc.HEADS[1] * kc.HEAD_DIM * 2,
            "restore_bytes": world * per_rank * HIDDEN * 2, "layers": layers,
            **_goal(world, length, one[length] / kernels["ragged"])})
    return out


def _goal(world: int, length: int, speedup: float) -> dict:
    """``goal`` and ``goal_met`` of a case with a goal; nothing for the others."""
    goal = GOALS.get((world, length))
    return {} if goal is None else {"goal": goal, "goal_met": round(speedup, 3) >= goal}


if __name__ == "__main__":
    ap = ArgumentParser(description=__doc__, formatter_class=RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--cases", default="2x32768,2x131072,4x32768,4x131072", help="NxT,...")
    args = ap.parse_args()
    cases = kc.parse_cases(args.cases)
    start = time.perf_counter()
    rows = measure(cases)
    meta = results.meta(shlex.join(["python", "benchmarks/projection.py", *sys.argv[1:]]),
                        label="a projection from one GPU, not a TTFT", runs=kc.RUNS,
                        pieces=list(PIECES), wall_s=round(time.perf_counter() - start, 1))
    results.write(os.path.dirname(os.path.abspath(args.out)), os.path.basename(args.out),
                  {"meta": meta, "rows": rows, "summary": project(rows)})
