"""What the GPU scripts share: versions for result metadata, and one engine
configuration run in its own process that writes a JSON file."""
from __future__ import annotations

import json
import os
import subprocess
import time


def versions() -> dict:
    """torch, vllm, flashinfer and the GPUs of this host."""
    import torch

    out = {"torch": torch.__version__,
           "gpu": f"{torch.cuda.device_count()} x {torch.cuda.get_device_name(0)}"}
    for mod in ("vllm", "flashinfer"):
        try:
            out[mod] = __import__(mod).__version__
        except Exception as exc:  # recorded, not fatal
            out[mod] = f"unavailable: {exc}"
    return out


def run_worker(cmd: list[str], out: str, key: str, entry: dict, env: dict | None = None,
               extra: tuple[str, ...] = ()) -> dict:
    """Run ``cmd`` (which writes JSON to ``out``); return ``entry`` with the
    return code, seconds, and ``out[key]`` and ``out[extra...]`` -- or the log
    tail on failure."""
    if os.path.exists(out):
        os.remove(out)  # never report an earlier run's file
    start = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, **(env or {})})
    entry = {**entry, "returncode": proc.returncode,
             "seconds": round(time.perf_counter() - start, 1)}
    if proc.returncode == 0 or os.path.exists(out):  # a failed run may have saved a part
        with open(out) as f:
            data = json.load(f)
        entry.update({k: data[k] for k in (key, *extra) if k in data})
    if proc.returncode:
        entry["log_tail"] = (proc.stdout + proc.stderr)[-6000:]
    print(" ".join(str(v) for v in entry.values() if isinstance(v, (str, int, float))),
          flush=True)
    return entry
