"""What every GPU result file shares: its ``meta`` (revision, command, GPU, versions,
date) and where it goes.

Result files go to the folder of pytest's ``--results-dir``; without it none is written
(a run that checks leaves the committed files alone).
"""
from __future__ import annotations

import datetime
import json
import os
import shlex
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def versions() -> dict:
    """torch, vllm, flashinfer and the GPUs of this host."""
    import torch

    count = torch.cuda.device_count()
    out = {"torch": torch.__version__, "gpu_count": count,
           "gpu": f"{count} x {torch.cuda.get_device_name(0)}" if count else "none"}
    for mod in ("vllm", "flashinfer"):
        try:
            out[mod] = __import__(mod).__version__
        except Exception as exc:  # recorded, not fatal
            out[mod] = f"unavailable: {exc}"
    return out


def git_rev() -> str:
    """``GIT_REV`` where set (a copy of the tree without its .git), else git's HEAD."""
    if os.environ.get("GIT_REV"):
        return os.environ["GIT_REV"]
    proc = subprocess.run(["git", "-C", ROOT, "rev-parse", "HEAD"], capture_output=True,
                          text=True)
    return proc.stdout.strip() or "unknown"


def pytest_command(config=None) -> str:
    """The command line that started this session (on an xdist worker: its controller's)."""
    argv = getattr(config, "workerinput", {}).get("mainargv") or sys.argv
    return "python -m pytest " + shlex.join(argv[1:])


SHARED_NOTE = ("every rank of these engines ran on the same GPU(s) and talked over "
               "NCCL's network transport on the loopback interface: outputs, not speed")
MPS_NOTE = ("mps_configs: those whose ranks ran under an MPS control daemon, their kernels "
            "side by side; the others' ranks took turns on the GPU (time slices)")


def shared_gpus(by_config: dict, mps=()) -> dict | None:
    """``meta.ranks_shared_gpus`` from ``{config: GPUs its ranks shared}`` (those that did)
    and the configs of those that ran under MPS: the most GPUs, the configurations, what it
    means; None if no ranks shared."""
    shared = {c: int(n) for c, n in by_config.items() if n}
    if not shared:
        return None
    out = {"gpus": max(shared.values()), "configs": sorted(shared), "note": SHARED_NOTE}
    if mps_configs := sorted(set(mps) & set(shared)):
        out.update(mps_configs=mps_configs, note=f"{SHARED_NOTE}; {MPS_NOTE}")
    return out


def meta(command: str | None = None, host: dict | None = None, **extra) -> dict:
    """A result file's ``meta``: ``extra`` (e.g. ``ranks_shared_gpus``, ``note``) after
    revision, command, GPU, versions and date."""
    host = versions() if host is None else host
    out = {"git_rev": git_rev(), "command": command or pytest_command(),
           "gpu": host.get("gpu"), "vllm": host.get("vllm"),
           "flashinfer": host.get("flashinfer"), "torch": host.get("torch"),
           "date": datetime.date.today().isoformat()}
    out.update({k: v for k, v in extra.items() if v is not None})
    return out


def write(results_dir: str, name: str, payload: dict) -> str:
    """``payload`` as ``results_dir/name`` (indented JSON); the path."""
    os.makedirs(results_dir, exist_ok=True)
    path = os.path.join(results_dir, name)
    with open(path, "w") as f:
        json.dump(payload, f, indent=1)
    return path
