"""scripts/gpu_sitting.sh with stand-in stages (no GPU): order, overlap, snapshot."""
import os
import shutil
import subprocess
import tarfile

SCRIPTS = os.path.join(os.path.dirname(__file__), "..", "scripts")
STUB = """#!/usr/bin/env bash
# stand-in for run_gpu_checks.sh STAGE OUT: record start/end, leave a work file
work=$GPU_CHECKS_DIR/$1; mkdir -p "$work"
echo "start $1" >> "$GPU_CHECKS_DIR/order"; sleep 0.3
echo result > "$work/$1.json"; echo "big" > "$work/x.pt.trace.json.gz"
echo "end $1" >> "$GPU_CHECKS_DIR/order"
[ "$1" != bad ]
"""


def _sitting(tmp_path):
    shutil.copy(os.path.join(SCRIPTS, "gpu_sitting.sh"), tmp_path / "gpu_sitting.sh")
    (tmp_path / "run_gpu_checks.sh").write_text(STUB)
    env = {**os.environ, "GPU_CHECKS_DIR": str(tmp_path / "checks")}
    return env


def test_stages_run_in_order_and_plus_joined_ones_at_once(tmp_path):
    env = _sitting(tmp_path)
    env["STAGES"] = "a b+bad c"
    subprocess.run(["bash", str(tmp_path / "gpu_sitting.sh"), "start"], env=env, check=True,
                   timeout=30)
    order = (tmp_path / "checks" / "order").read_text().split("\n")[:-1]
    assert order[:2] == ["start a", "end a"] and order[-2:] == ["start c", "end c"]
    middle = order[2:6]  # b and bad overlap: both start before either ends
    assert sorted(middle[:2]) == ["start b", "start bad"]
    progress = (tmp_path / "checks" / "progress.log").read_text()
    assert "end bad rc=1" in progress and "end b rc=0" in progress
    assert progress.rstrip().endswith("done")

    out = tmp_path / "out"
    res = subprocess.run(["bash", str(tmp_path / "gpu_sitting.sh"), "snapshot", str(out)],
                         env=env, capture_output=True, text=True, check=True, timeout=30)
    assert "end c rc=0" in res.stdout
    names = tarfile.open(out / "snapshot.tgz").getnames()
    assert "checks/c/c.json" in names and "checks/a/a.json" in names
    assert not any(n.endswith(".pt.trace.json.gz") for n in names)


def test_jit_cache_travels_in_parts_and_unpacks_on_the_next_host(tmp_path):
    env = _sitting(tmp_path)
    cache = tmp_path / "home1" / ".cache" / "flashinfer" / "0.6.14" / "90"
    cache.mkdir(parents=True)
    (cache / "kernel.so").write_bytes(os.urandom(40 << 20))  # incompressible: 3 parts
    script = str(tmp_path / "gpu_sitting.sh")
    subprocess.run(["bash", script, "jit", str(tmp_path / "out")], check=True, timeout=60,
                   env={**env, "HOME": str(tmp_path / "home1")}, capture_output=True)
    parts = sorted(os.listdir(tmp_path / "out" / "jit"))
    assert parts == ["part-00", "part-01", "part-02"]
    assert all(os.path.getsize(tmp_path / "out" / "jit" / p) <= 15 << 20 for p in parts)
    subprocess.run(["bash", script, "restore-jit", str(tmp_path / "out" / "jit")], check=True,
                   timeout=60, env={**env, "HOME": str(tmp_path / "home2")})
    restored = tmp_path / "home2" / ".cache" / "flashinfer" / "0.6.14" / "90" / "kernel.so"
    assert restored.read_bytes() == (cache / "kernel.so").read_bytes()
