"""Every rank of an engine on the GPUs a host has: the environment that engages the
test-only plugin ``shared_gpu_plugin/vllm_pcp_shared_gpu.py`` (read its docstring).

An engine started with this environment (``vllm.LLM`` or ``vllm serve``, in this process
or a child) runs as usual when the host has a GPU per rank; with fewer GPUs its ranks
share them and talk over NCCL's network transport, as ranks on different hosts would.
That checks outputs, never speed. The engine must be given ``kv_cache_memory_bytes``
(``--kv-cache-memory-bytes``) and a low ``gpu_memory_utilization``.

Ranks that share a GPU run far faster under an MPS control daemon (NVIDIA's Multi-Process
Service: all processes' kernels side by side instead of time slices; measured by
``probe_shared_gpu.py``). ``mps start`` runs one for this host's GPUs (its pipe folder:
``CUDA_MPS_PIPE_DIRECTORY``, default ``/tmp/nvidia-mps``); engines started afterwards with
that variable use it, and their result files list them under ``mps_configs``. An engine
whose rank a check kills, and an engine on Ray, runs outside it (:func:`without_mps`).

    python3 tests/engine/shared_gpu.py env [auto|force]   # `export K=V` lines for bash
    python3 tests/engine/shared_gpu.py mps start|stop     # `export K=V` lines for bash
    env = {**os.environ, **shared_gpu.env()}                 # Python
"""
from __future__ import annotations

import os
import shlex
import subprocess
import sys
import tempfile

PLUGIN_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "shared_gpu_plugin")
sys.path.insert(0, PLUGIN_DIR)
from vllm_pcp_shared_gpu import (ENGAGED_VAR, MODE_VAR, MPS_PIPE_VAR,  # noqa: E402,F401
                                 STACKS_SIGNAL, engages, give_nccl_own_host, mps_pipe_dir,
                                 mps_serves)

MODES = ("auto", "force")


def env(mode: str | None = None, base: dict | None = None) -> dict[str, str]:
    """The variables to add to an engine's environment: the plugin's folder first on
    ``PYTHONPATH`` and :data:`MODE_VAR` (``mode``, else the caller's own value of it,
    else ``auto``: engage only when the world size is larger than the GPUs)."""
    base = os.environ if base is None else base
    mode = mode or base.get(MODE_VAR) or "auto"
    if mode not in MODES:
        raise ValueError(f"{MODE_VAR}={mode!r}: one of {', '.join(MODES)}")
    path = [p for p in base.get("PYTHONPATH", "").split(os.pathsep) if p and p != PLUGIN_DIR]
    return {"PYTHONPATH": os.pathsep.join([PLUGIN_DIR, *path]), MODE_VAR: mode}


def without_mps() -> dict[str, str]:
    """The variable that keeps an engine's CUDA off any MPS daemon (a pipe folder where none
    listens: CUDA then runs as without MPS). For an engine whose rank a check kills: NVIDIA's
    MPS does not support ending a client that has GPU work outstanding, and a fault it leaves
    reaches every client of the daemon's server, every engine beside it included. For an
    engine on Ray: under the daemon one lost its local Ray head (``engines.py``)."""
    return {MPS_PIPE_VAR: tempfile.mkdtemp(prefix="vllm-pcp-no-mps-")}


def _mps_control(pipe_dir: str, *args: str, text: str | None = None) -> None:
    log_dir = os.path.join(pipe_dir, "log")
    os.makedirs(log_dir, exist_ok=True)
    subprocess.run(["nvidia-cuda-mps-control", *args], input=text or "", text=True, check=True,
                   env={**os.environ, MPS_PIPE_VAR: pipe_dir,
                        "CUDA_MPS_LOG_DIRECTORY": log_dir})


def start_mps(pipe_dir: str | None = None) -> dict[str, str]:
    """An MPS control daemon listening in ``pipe_dir`` (the caller's, else CUDA's default),
    unless one does; the variable that points CUDA processes at it."""
    pipe_dir = pipe_dir or mps_pipe_dir()
    if not mps_serves({MPS_PIPE_VAR: pipe_dir}):
        _mps_control(pipe_dir, "-d")
    return {MPS_PIPE_VAR: pipe_dir}


def stop_mps(pipe_dir: str | None = None) -> None:
    """Quit the daemon of ``pipe_dir``, after its engines end: their kernels run in it."""
    pipe_dir = pipe_dir or mps_pipe_dir()
    if mps_serves({MPS_PIPE_VAR: pipe_dir}):
        _mps_control(pipe_dir, text="quit\n")


def main(argv: list[str]) -> int:
    if argv[:2] == ["mps", "start"] and len(argv) == 2:
        variables = start_mps()
    elif argv[:2] == ["mps", "stop"] and len(argv) == 2:
        stop_mps()
        variables = {}
    elif argv[:1] == ["env"] and len(argv) <= 2:
        variables = env(argv[1] if len(argv) == 2 else None)
    else:
        print(__doc__, file=sys.stderr)
        return 2
    for key, value in variables.items():
        print(f"export {key}={shlex.quote(value)}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
