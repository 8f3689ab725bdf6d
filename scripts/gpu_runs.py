"""What the GPU scripts share: versions for result metadata, and one engine
configuration run in its own process that writes a JSON file."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time

from layouts import NO_ALLREDUCE_FUSION  # noqa: F401  (the workers' and benches' TP > 1)

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests",
                                "engine"))
import shared_gpu  # noqa: E402

# what a raw entry keeps of an exactness worker's file besides its main key
RAW_KEYS = ("results", "feature_results", "scores", "scores_error", "kv_capacity_tokens",
            "step_counts", "sampled_token_checks", "memory", "shared_gpus")

# "RuntimeError: ..." after any "(Worker pid=N) ERROR ... [file.py:N]" prefix
_ERROR_LINE = re.compile(r"(?:^|\s)((?:\w+\.)*\w*(?:Error|Exception): .*)$")


def versions() -> dict:
    """torch, vllm, flashinfer and the GPUs of this host."""
    import torch

    out = {"torch": torch.__version__, "gpu_count": torch.cuda.device_count(),
           "gpu": f"{torch.cuda.device_count()} x {torch.cuda.get_device_name(0)}"}
    for mod in ("vllm", "flashinfer"):
        try:
            out[mod] = __import__(mod).__version__
        except Exception as exc:  # recorded, not fatal
            out[mod] = f"unavailable: {exc}"
    return out


def check_env(env: dict | None = None) -> dict:
    """An engine check's environment: ``env`` over the harness that lets its ranks share
    the host's GPUs where it has fewer than the engine's world size
    (tests/engine/shared_gpu.py). Benchmarks never take it: shared GPUs time nothing."""
    return {**shared_gpu.env(), **(env or {})}


def run_worker(cmd: list[str], out: str, key: str, entry: dict, env: dict | None = None,
               extra: tuple[str, ...] = (), log: str | None = None) -> dict:
    """Run ``cmd`` (which writes JSON to ``out``); return ``entry`` with the
    return code, seconds, and ``out[key]`` and ``out[extra...]`` -- or the log
    tail on failure. The worker's output goes to ``log`` (default: ``out`` + ``.log``)
    as it runs, so a long engine's progress (its per-case lines) can be read meanwhile."""
    if os.path.exists(out):
        os.remove(out)  # never report an earlier run's file
    log = log or out + ".log"
    start = time.perf_counter()
    with open(log, "w") as f:
        proc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, text=True,
                              env={**os.environ, **(env or {})})
    entry = {**entry, "returncode": proc.returncode,
             "seconds": round(time.perf_counter() - start, 1)}
    if proc.returncode == 0 or os.path.exists(out):  # a failed run may have saved a part
        with open(out) as f:
            data = json.load(f)
        entry.update({k: data[k] for k in (key, *extra) if k in data})
    if proc.returncode:
        with open(log) as f:
            output = f.read()
        entry["errors"] = error_lines(output)
        entry["log_tail"] = output[-6000:]
    print(" ".join(str(v) for v in entry.values() if isinstance(v, (str, int, float))),
          *entry.get("errors", [])[:1], flush=True)  # a failure's first exception line
    return entry


def error_lines(log: str, limit: int = 8) -> list[str]:
    """The distinct exception lines of a log, first seen first: the root cause a
    worker process raised survives the long tracebacks that follow it."""
    seen: list[str] = []
    for line in log.splitlines():
        match = _ERROR_LINE.search(line)
        if match and match.group(1) not in seen:
            seen.append(match.group(1))
    return seen[:limit]
