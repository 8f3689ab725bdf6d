"""Every rank of an engine on the GPUs a host has: the environment that engages the
test-only plugin ``shared_gpu_plugin/vllm_pcp_shared_gpu.py`` (read its docstring).

An engine started with this environment (``vllm.LLM`` or ``vllm serve``, in this process
or a child) runs as usual when the host has a GPU per rank; with fewer GPUs its ranks
share them and talk over NCCL's network transport, as ranks on different hosts would.
That checks outputs, never speed. The engine must be given ``kv_cache_memory_bytes``
(``--kv-cache-memory-bytes``) and a low ``gpu_memory_utilization``.

    python3 tests/engine/shared_gpu.py env [auto|force]   # `export K=V` lines for bash
    env = {**os.environ, **shared_gpu.env()}                 # Python
"""
from __future__ import annotations

import os
import shlex
import sys

PLUGIN_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "shared_gpu_plugin")
sys.path.insert(0, PLUGIN_DIR)
from vllm_pcp_shared_gpu import ENGAGED_VAR, MODE_VAR, engages  # noqa: E402,F401

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


def main(argv: list[str]) -> int:
    if not argv or argv[0] != "env" or len(argv) > 2:
        print(__doc__, file=sys.stderr)
        return 2
    for key, value in env(argv[1] if len(argv) == 2 else None).items():
        print(f"export {key}={shlex.quote(value)}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
