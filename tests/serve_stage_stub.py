"""scripts/run_gpu_checks.sh's soak and faults stages with stand-ins (no vLLM, no GPU): a
serve_lib.sh whose serve_until_healthy only records its arguments, and a serve_soak.py /
serve_faults.py that record theirs and write the --out file (scripts/layouts.py is the real
one)."""
from __future__ import annotations

import json
import os
import shutil
import subprocess

SCRIPTS = os.path.join(os.path.dirname(__file__), "..", "scripts")
FAKE_LIB = """serve_until_healthy() {  # PORT LOG WAIT_S MODEL [flags]: recorded, nothing started
  python3 -c 'import json, os, sys; open(os.environ["CALLS"], "a").write(json.dumps(
      {"script": "serve", "argv": sys.argv[1:],
       "v2_runner": os.environ.get("VLLM_USE_V2_MODEL_RUNNER")}) + "\\n")' "$@"
  server=$BASHPID
}
"""
FAKE_SCRIPT = """import json, os, sys
argv = sys.argv[1:]
with open(os.environ["CALLS"], "a") as f:
    f.write(json.dumps({"script": os.path.basename(sys.argv[0]), "argv": argv}) + "\\n")
out = argv[argv.index("--out") + 1]
json.dump({"argv": argv}, open(out, "w"))
"""


def run_stage(tmp_path, stage: str, **env) -> tuple[subprocess.CompletedProcess, list[dict]]:
    """Run the stage with the stand-ins; its result and the calls they recorded."""
    scripts = tmp_path / "scripts"
    scripts.mkdir(exist_ok=True)
    for name in ("run_gpu_checks.sh", "layouts.py"):  # the stage reads its layouts' flags
        shutil.copy(os.path.join(SCRIPTS, name), scripts / name)
    (scripts / "serve_lib.sh").write_text(FAKE_LIB)
    for name in ("serve_soak.py", "serve_faults.py"):
        (scripts / name).write_text(FAKE_SCRIPT)
    calls = tmp_path / "calls.jsonl"
    res = subprocess.run(["bash", str(scripts / "run_gpu_checks.sh"), stage,
                          str(tmp_path / "out")], capture_output=True, text=True, timeout=60,
                         env={**os.environ, "GPU_CHECKS_DIR": str(tmp_path / "checks"),
                              "CALLS": str(calls), **env})
    lines = calls.read_text().splitlines() if calls.exists() else []
    return res, [json.loads(line) for line in lines]


def flag(argv: list[str], name: str) -> str:
    return argv[argv.index(name) + 1]
