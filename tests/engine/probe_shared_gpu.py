"""How fast ranks that share one GPU talk, time-sliced and under MPS: the harness's transport.

Pairs of processes on GPU 0, each rank with an NCCL host id of its own (as the harness gives
them: shared_gpu.py), so NCCL talks over its network transport on the loopback interface.
Each rank times a 1 KiB ``all_reduce``, a 4 MiB ``all_gather`` and a layer-like step (30 small
matmuls, each followed by a 1 KiB ``all_reduce``), with 1 pair and with 3 pairs at once, first
without MPS (the GPU time-slices between the processes), then under an MPS control daemon
started for the probe (their kernels side by side). It measures the test harness, not
vllm-pcp: it tells how long engine checks on one GPU take, never how fast the plugin is.

    python3 tests/engine/probe_shared_gpu.py --out tests/gpu/results/shared-gpu-mps.json
        [--mps-pipe DIR] [--keep-mps]   # leave the daemon running for the engines after it
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time

import results
import shared_gpu

SHAPES = {"all_reduce_1KiB": 256, "all_gather_4MiB": 1 << 20}  # float32 elements


def _timed(fn, sync, n: int) -> list[float]:
    for _ in range(5):
        fn()
    sync()
    times = []
    for _ in range(n):
        start = time.perf_counter()
        fn()
        sync()
        times.append(1e3 * (time.perf_counter() - start))
    return times


def rank_main(pair: int, rank: int, port: int, queue, backend: str = "nccl") -> None:
    """One rank: its collectives' median and p90 milliseconds and a 30-layer step's median
    (``backend`` gloo: the same on the CPU, for the probe's own test)."""
    import torch
    import torch.distributed as dist

    shared_gpu.give_nccl_own_host()  # as the harness's plugin does in every engine process
    os.environ.update(NCCL_SOCKET_IFNAME="lo", NCCL_NVLS_ENABLE="0")
    device, sync = ("cuda", torch.cuda.synchronize) if backend == "nccl" else ("cpu", lambda: 0)
    if device == "cuda":
        torch.cuda.set_device(0)
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=2)
    small, big = (torch.ones(n, device=device) for n in SHAPES.values())
    gathered = [torch.empty_like(big) for _ in range(2)]
    ops = {"all_reduce_1KiB": (lambda: dist.all_reduce(small), 200),
           "all_gather_4MiB": (lambda: dist.all_gather(gathered, big), 30)}
    row = {"pair": pair, "rank": rank}
    for name, (fn, n) in ops.items():
        times = sorted(_timed(fn, sync, n))
        row[name] = {"median_ms": round(statistics.median(times), 3),
                     "p90_ms": round(times[int(0.9 * n)], 3)}
    a = torch.randn(512, 512, device=device)

    def step():
        nonlocal a
        for _ in range(30):
            a = torch.tanh(a @ a)
            dist.all_reduce(small)
    row["step_30_layers_ms"] = round(statistics.median(_timed(step, sync, 15)), 2)
    queue.put(row)
    dist.destroy_process_group()


def probe(pairs: int, pipe_dir: str, backend: str = "nccl", port: int = 29600) -> dict:
    """``pairs`` pairs of ranks at once, their CUDA pointed at ``pipe_dir`` for MPS."""
    import torch.multiprocessing as mp

    os.environ[shared_gpu.MPS_PIPE_VAR] = pipe_dir  # spawned ranks inherit it
    ctx, start = mp.get_context("spawn"), time.perf_counter()
    queue = ctx.Queue()
    procs = [ctx.Process(target=rank_main, args=(p, r, port + p, queue, backend))
             for p in range(pairs) for r in range(2)]
    for proc in procs:
        proc.start()
    rows = [queue.get(timeout=300) for _ in procs]
    for proc in procs:
        proc.join(30)
    return {"pairs": pairs, "mps": shared_gpu.mps_serves(), "wall_s":
            round(time.perf_counter() - start, 1),
            "ranks": sorted(rows, key=lambda r: (r["pair"], r["rank"]))}


def summarize(runs: list[dict]) -> dict:
    """The slowest rank's step per run, and how many times faster MPS made it."""
    worst = {f"{'mps' if r['mps'] else 'time-sliced'}-{r['pairs']}":
             max(x["step_30_layers_ms"] for x in r["ranks"]) for r in runs}
    out = {"slowest_step_30_layers_ms": worst}
    for pairs in (1, 3):
        plain, mps = worst.get(f"time-sliced-{pairs}"), worst.get(f"mps-{pairs}")
        if plain and mps:
            out[f"mps_speedup_{pairs}_pairs"] = round(plain / mps, 1)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--mps-pipe", default=None, help="the daemon's pipe folder (a new one)")
    ap.add_argument("--keep-mps", action="store_true")
    args = ap.parse_args()
    no_daemon = shared_gpu.without_mps()[shared_gpu.MPS_PIPE_VAR]
    runs = [probe(pairs, no_daemon) for pairs in (1, 3)]
    if shutil.which("nvidia-cuda-mps-control"):  # else the runs say time-sliced only
        pipe = args.mps_pipe or tempfile.mkdtemp(prefix="mps-probe-")
        shared_gpu.start_mps(pipe)
        try:
            runs += [probe(pairs, pipe) for pairs in (1, 3)]
        finally:
            if not args.keep_mps:
                shared_gpu.stop_mps(pipe)
    doc = {"meta": results.meta(" ".join(["python3", *sys.argv]), note=__doc__.split("\n\n")[1]
                                .replace("\n", " ")), "summary": summarize(runs), "runs": runs}
    results.write(os.path.dirname(os.path.abspath(args.out)), os.path.basename(args.out), doc)
    print(json.dumps(doc["summary"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
