"""scripts/gpu_sitting.sh with stand-in stages (no GPU): order, overlap, snapshot."""
import os
import shutil
import subprocess
import tarfile
import time

SCRIPTS = os.path.join(os.path.dirname(__file__), "..", "scripts")
STUB = """#!/usr/bin/env bash
# stand-in for run_gpu_checks.sh STAGE OUT: record start/end, leave a work file
work=$GPU_CHECKS_DIR/$1; mkdir -p "$work"
echo "start $1" >> "$GPU_CHECKS_DIR/order"; sleep 0.3
echo result > "$work/$1.json"; echo "big" > "$work/x.pt.trace.json.gz"
echo "end $1" >> "$GPU_CHECKS_DIR/order"
[ "$1" != bad ]
"""


def _sitting(tmp_path, scripts=None):
    """gpu_sitting.sh beside a stand-in run_gpu_checks.sh in ``scripts`` (default tmp_path);
    returns the environment, with the work files in tmp_path/checks."""
    scripts = scripts or tmp_path
    scripts.mkdir(parents=True, exist_ok=True)
    shutil.copy(os.path.join(SCRIPTS, "gpu_sitting.sh"), scripts / "gpu_sitting.sh")
    (scripts / "run_gpu_checks.sh").write_text(STUB)
    return {**os.environ, "GPU_CHECKS_DIR": str(tmp_path / "checks")}


def test_stages_run_in_order_and_plus_joined_ones_at_once(tmp_path):
    env = _sitting(tmp_path)
    env.update(STAGES="a b+bad c", SERVE_CONFIGS="pcp2 tp2", GIT_REV="abc")
    subprocess.run(["bash", str(tmp_path / "gpu_sitting.sh"), "start"], env=env, check=True,
                   timeout=30)
    order = (tmp_path / "checks" / "order").read_text().split("\n")[:-1]
    assert order[:2] == ["start a", "end a"] and order[-2:] == ["start c", "end c"]
    middle = order[2:6]  # b and bad overlap: both start before either ends
    assert sorted(middle[:2]) == ["start b", "start bad"]
    progress = (tmp_path / "checks" / "progress.log").read_text()
    assert progress.split("\n")[0].endswith(
        "sitting GIT_REV=abc SERVE_CONFIGS=pcp2 tp2 STAGES=a b+bad c ")
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


# stand-ins for the offline host's .gpu/install.sh and .gpu/models/prepare.sh: keep the
# parts carried now in $STASH, report what is complete, "install" / "build" into $STASH
FAKE_INSTALL = """set -e
mkdir -p "$STASH/gpu-stage"; cp .gpu/parts/* "$STASH/gpu-stage/" 2>/dev/null || true
[ -f .gpu/install.sh ] && cp .gpu/install.sh "$STASH/gpu-stage/install.sh"
[ "${1:-}" = --install ] || exit 0
[ -f "$STASH/gpu-stage/part01" ] || { echo "bundle incomplete"; exit 1; }
mkdir -p "$STASH/site"; pwd > "$STASH/site/installed-from"; echo "vllm 0.26.0 gpus 2"
"""
FAKE_PREPARE = """set -e
stage=$STASH/model-stage; mkdir -p "$stage"
cp .gpu/models/parts/* "$stage/" 2>/dev/null || true
[ -f .gpu/models/prepare.sh ] && cp .gpu/models/prepare.sh "$stage/prepare.sh"
for want in "$stage"/*.want; do
  [ -e "$want" ] || break; name=$(basename "$want" .want)
  echo "$name: $(ls "$stage" | grep -c "^$name.part") of $(cat "$want") parts"
  sleep 0.1  # the real one reads and counts for a while between models
done
[ "${1:-}" = --build ] || exit 0
[ "$(ls "$stage" | grep -c "^$2.part")" = "$(cat "$stage/$2.want")" ]
mkdir -p "$STASH/models/$2"; echo "$PYTHONPATH" > "$STASH/models/$2/built"
"""


def _carry(proj, files):
    """One device transfer: the project folder holds only what this one carried."""
    shutil.rmtree(proj / ".gpu", ignore_errors=True)
    for rel, text in files.items():
        (proj / rel).parent.mkdir(parents=True, exist_ok=True)
        (proj / rel).write_bytes(text if isinstance(text, bytes) else text.encode())
    return proj


def _jit_part(tmp_path):
    src = tmp_path / "jit-src" / "flashinfer"
    src.mkdir(parents=True)
    (src / "kernel.so").write_text("compiled")
    subprocess.run(["tar", "czf", str(tmp_path / "jit.tgz"), "-C", str(src.parent),
                    "flashinfer"], check=True)
    return (tmp_path / "jit.tgz").read_bytes()


def _host_project(tmp_path, **env):
    """A project folder on a stand-in host: (folder, stash, env, the sitting command)."""
    proj, stash = tmp_path / "proj", tmp_path / "stash"
    env = {**_sitting(tmp_path, proj / "scripts"), "STASH": str(stash),
           "HOME": str(tmp_path / "home"), "STAGES": "a", **env}
    return proj, stash, env, ["bash", "scripts/gpu_sitting.sh"]


def test_staged_transfers_set_up_the_host_before_the_first_stage(tmp_path):
    proj, stash, env, sitting = _host_project(tmp_path)
    (proj / "pyproject.toml").write_text("[project]\n")

    def stash_call(files):
        _carry(proj, files)
        return subprocess.run(sitting + ["stash"], cwd=proj, env=env, check=True,
                              capture_output=True, text=True, timeout=30).stdout

    stash_call({".gpu/install.sh": FAKE_INSTALL, ".gpu/parts/part00": "p0"})
    out = stash_call({".gpu/parts/part01": "p1", ".gpu/jit/part-00": _jit_part(tmp_path),
                      ".gpu/gsm8k/test.jsonl": "{}\n", ".gpu/extra/none.txt": ""})
    assert "bundle parts: 2" in out
    setup = subprocess.Popen(sitting + ["setup", "m1"], cwd=proj, env=env)
    progress = tmp_path / "checks" / "progress.log"
    for _ in range(300):  # as on the host, the start comes after the setup has begun
        if progress.exists() and "setup start" in progress.read_text():
            break
        time.sleep(0.05)
    start = subprocess.Popen(sitting + ["start"], cwd=proj, env=env)
    stash_call({".gpu/models/prepare.sh": FAKE_PREPARE, ".gpu/models/parts/m1.want": "2",
                ".gpu/models/parts/m1.part00": "m"})
    assert start.poll() is None  # the model is not complete: no stage yet
    out = stash_call({".gpu/models/parts/m1.part01": "m"})
    assert "m1: 2 of 2 parts" in out
    assert setup.wait(timeout=30) == 0 and start.wait(timeout=30) == 0

    events = [line.split(" ", 1)[1] for line in progress.read_text().splitlines()]
    assert events[0] == "setup start" and events[1].startswith("setup install rc=0 vllm")
    assert events[2:4] == ["setup model m1 rc=0", "setup done"]
    assert events[4].startswith("sitting ") and "STAGES=a" in events[4]
    assert events[5:] == ["start a", "end a rc=0", "done"]
    assert (stash / "site" / "installed-from").read_text().strip() == str(stash / "pcp-src")
    assert (stash / "pcp-src" / "pyproject.toml").exists()
    assert not (stash / "pcp-src" / ".gpu").exists()
    assert (stash / "models" / "m1" / "built").read_text().startswith(str(stash / "site"))
    assert (tmp_path / "home" / ".cache" / "flashinfer" / "kernel.so").read_text() == "compiled"
    assert (stash / "gsm8k" / "test.jsonl").exists()


def test_start_goes_on_when_setup_fails(tmp_path):
    proj, stash, env, sitting = _host_project(tmp_path, SETUP_WAIT_S="2")
    _carry(proj, {".gpu/install.sh": FAKE_INSTALL, ".gpu/parts/part00": "p0"})
    subprocess.run(sitting + ["stash"], cwd=proj, env=env, check=True, timeout=30)
    subprocess.run(sitting + ["setup", "m1"], cwd=proj, env=env, check=False, timeout=30)
    subprocess.run(sitting + ["start"], cwd=proj, env=env, check=True, timeout=30)
    progress = (tmp_path / "checks" / "progress.log").read_text()
    assert "setup install rc=1 bundle incomplete" in progress
    assert "setup model m1 rc=" in progress and "setup model m1 rc=0" not in progress
    assert progress.index("setup done") < progress.index("start a")


def test_setup_builds_a_model_that_is_not_the_last_one_listed(tmp_path):
    """The wait for a model reads the whole listing: with `prepare.sh | grep -q`, grep
    left at a1's line, prepare.sh died of SIGPIPE writing b2's, and the wait never ended."""
    proj, stash, env, sitting = _host_project(tmp_path, SETUP_WAIT_S="60")
    _carry(proj, {".gpu/install.sh": FAKE_INSTALL, ".gpu/parts/part00": "p0",
                  ".gpu/parts/part01": "p1", ".gpu/models/prepare.sh": FAKE_PREPARE,
                  ".gpu/models/parts/a1.want": "1", ".gpu/models/parts/a1.part00": "m",
                  ".gpu/models/parts/b2.want": "2"})
    out = subprocess.run(sitting + ["stash"], cwd=proj, env=env, check=True,
                         capture_output=True, text=True, timeout=30).stdout
    assert out.index("a1: 1 of 1 parts") < out.index("b2: 0 of 2 parts")
    subprocess.run(sitting + ["setup", "a1"], cwd=proj, env=env, check=True, timeout=30)
    assert "setup model a1 rc=0" in (tmp_path / "checks" / "progress.log").read_text()
    assert (stash / "models" / "a1" / "built").exists()


def test_watch_snapshots_until_the_sitting_is_done_not_the_setup(tmp_path):
    env = {**_sitting(tmp_path), "STAGES": "a b", "WATCH_EVERY_S": "1"}
    checks = tmp_path / "checks"
    checks.mkdir()
    (checks / "progress.log").write_text("10:00:00 setup start\n10:00:01 setup done\n")
    script, out = str(tmp_path / "gpu_sitting.sh"), tmp_path / "out"
    start = subprocess.Popen(["bash", script, "start"], env=env)
    res = subprocess.run(["bash", script, "watch", str(out), "60"], env=env, timeout=30,
                         capture_output=True, text=True)
    assert start.wait(timeout=30) == 0
    assert res.returncode == 0 and res.stdout.rstrip().endswith(" done")
    names = tarfile.open(out / "snapshot.tgz").getnames()
    assert "checks/b/b.json" in names  # taken after the last stage, not at "setup done"
    assert os.listdir(out) == ["snapshot.tgz"]


def test_watch_ends_at_its_time_and_at_once_on_a_fresh_host(tmp_path):
    env = {**_sitting(tmp_path), "WATCH_EVERY_S": "1"}
    script, out = str(tmp_path / "gpu_sitting.sh"), tmp_path / "out"
    t0 = time.monotonic()
    res = subprocess.run(["bash", script, "watch", str(out), "60"], env=env, timeout=30,
                         capture_output=True, text=True)
    assert res.returncode == 3 and "fresh host" in res.stdout
    assert time.monotonic() - t0 < 5 and not (out / "snapshot.tgz").exists()

    (tmp_path / "checks" / "progress.log").write_text("10:00:02 start a\n")  # never ends
    t0 = time.monotonic()
    res = subprocess.run(["bash", script, "watch", str(out), "2"], env=env, timeout=30,
                         capture_output=True, text=True)
    assert res.returncode == 0 and "start a" in res.stdout
    assert 2 <= time.monotonic() - t0 < 10
    assert "checks/progress.log" in tarfile.open(out / "snapshot.tgz").getnames()
