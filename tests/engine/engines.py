"""One engine job in its own process (worker.py, the shared-GPU environment), its raw entry
kept as ``WORK/raw/NAME.json``: not run again (a failure: within its session), one run shared
by pytest-xdist workers under a file lock."""
import json
import os
import signal
import subprocess
import sys
import time
import warnings
from dataclasses import dataclass
from pathlib import Path

from filelock import FileLock

import judge
import layouts
import results
import shared_gpu

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
WORKER = [sys.executable, os.path.join(HERE, "worker.py")]
SESSION_VAR = "VLLM_PCP_ENGINE_SESSION"  # set once per pytest session (tests/engine/conftest.py)
REFUSAL_TIMEOUT_S = 300  # a run that must be refused and still goes after this is killed
TIMEOUT_VAR = "VLLM_PCP_ENGINE_TIMEOUT_S"  # any other run still going after this many seconds
EXIT_GRACE_S = 120.0  # a run still going this long after its whole output is written is killed
STACKS_WAIT_S = 5.0  # for a stopped run's processes to print their stacks (Ray's: and pass them on)
STACKS_GAP_S = 0.3  # between two processes' stacks: one dump is whole in the log before the next
REAL_MODELS = {"smollm2": "smollm2-135m", "qwen2.5-coder-0.5b": "qwen2.5-coder-0.5b"}
FULL_DEPTH = "-full"  # NAME-full: NAME with every layer of its config (else 4)


@dataclass(frozen=True)
class Job:
    """``teacher``: "self" or the job whose greedy outputs it scores; ``refusal``: a pattern
    its start-up error must match; ``repeat``: the same job run once more (its own raw)."""
    model: str
    variant: str
    layout: str
    groups: str = "standard"
    max_tokens: int = 32
    teacher: "Job | str | None" = None
    refusal: str | None = None
    repeat: int = 0

    @property
    def name(self) -> str:
        again = f"-r{self.repeat}" if self.repeat else ""
        return f"{self.model}-{self.variant}-{self.layout}-t{self.max_tokens}{again}"

    def spec(self) -> dict:
        """What a raw entry must have run to stand for this job: its groups, teacher,
        refusal and the installed vLLM (an entry of another vLLM runs again)."""
        teacher = self.teacher.name if isinstance(self.teacher, Job) else self.teacher
        return {"groups": self.groups, "max_tokens": self.max_tokens, "teacher": teacher,
                "refusal": self.refusal, "vllm": installed_vllm()}


def installed_vllm() -> str:
    """The vLLM version installed here (its package metadata: no import)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("vllm")
    except PackageNotFoundError:
        return "none"


def model_dir(name: str, work_dir: str) -> str:
    """A real model under ``VLLM_PCP_MODELS_DIR`` (default /tmp/models), else a random-weight
    bf16 one of ``configs/models/NAME.json`` (seed 0) built on first use into the work dir."""
    if name in REAL_MODELS:
        return os.path.join(os.environ.get("VLLM_PCP_MODELS_DIR", "/tmp/models"),
                            REAL_MODELS[name])
    full, base = name.endswith(FULL_DEPTH), name.removesuffix(FULL_DEPTH)
    target = os.path.join(work_dir, "models-full" if full else "models", base)
    os.makedirs(os.path.dirname(target), exist_ok=True)
    with FileLock(target + ".lock"):
        if not os.path.exists(os.path.join(target, "config.json")):
            import torch
            from transformers import AutoConfig, AutoModelForCausalLM
            fields = json.loads(Path(ROOT, "configs", "models", base + ".json").read_text())
            fields["num_hidden_layers"] = min(fields["num_hidden_layers"], 1000 if full else 4)
            config = AutoConfig.for_model(fields.pop("model_type"), **fields)
            torch.manual_seed(0)
            with torch.device("cuda"):
                model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
            model.save_pretrained(target)
    return target


def catches(pid: int, signum: int) -> bool:
    """Whether process ``pid`` has a handler of its own for ``signum`` (/proc's SigCgt)."""
    status = Path(f"/proc/{pid}/status").read_text()
    mask = next(line.split()[1] for line in status.splitlines() if line.startswith("SigCgt:"))
    return bool(int(mask, 16) >> (signum - 1) & 1)


def _session_pids(session: int) -> list[int]:
    """Every process of ``session`` (the worker's, and all it started), in pid order."""
    pids = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            if int(stat.read_text().rsplit(")", 1)[1].split()[3]) == session:
                pids.append(int(stat.parent.name))
        except (OSError, IndexError, ValueError):
            continue  # gone meanwhile
    return sorted(pids)


def _print_stacks(session: int) -> None:
    """:data:`shared_gpu.STACKS_SIGNAL` to each process of ``session`` that handles it, one
    at a time (their dumps share the log, and two at once interleave line by line). The
    others, Ray's own processes among them, would end at once, before they pass on what
    the rest print."""
    for pid in _session_pids(session):
        try:
            if catches(pid, shared_gpu.STACKS_SIGNAL):
                os.kill(pid, shared_gpu.STACKS_SIGNAL)
                time.sleep(STACKS_GAP_S)
        except (OSError, StopIteration):
            continue  # gone meanwhile


def _kill_session(session: int) -> None:
    for pid in _session_pids(session):
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            continue  # gone meanwhile


def _wait(proc: subprocess.Popen, out: str, timeout: float | None) -> tuple[int | None, str | None]:
    """The worker's return code, or why it is to be stopped: "timeout" past ``timeout``
    seconds, "exit" :data:`EXIT_GRACE_S` after its whole output was written (the worker
    writes it in one rename, then only stops its engine and exits)."""
    start, written = time.monotonic(), None
    while (returncode := proc.poll()) is None:
        now = time.monotonic()
        if written is None and os.path.exists(out):
            written = now
        if written is not None and now - written > EXIT_GRACE_S:
            return None, "exit"
        if timeout is not None and now - start > timeout:
            return None, "timeout"
        time.sleep(0.1)
    return returncode, None


def _start(cmd: list[str], env: dict, log: str, out: str,
           timeout: float | None) -> tuple[int, str | None]:
    """The worker's return code, and why it was stopped (:func:`_wait`), its stacks printed
    first; every process of its session killed on an interrupt too."""
    with open(log, "w") as f:
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=env,
                                start_new_session=True)
        try:
            returncode, stopped = _wait(proc, out, timeout)
        except BaseException:
            _kill_session(proc.pid)  # its process group is in it
            raise
        if stopped:
            _print_stacks(proc.pid)
            time.sleep(STACKS_WAIT_S)
            _kill_session(proc.pid)
            returncode = proc.wait()
    return returncode, stopped


def job_env(layout: str) -> dict:
    """The environment of an engine of ``layout``: this one's, the shared-GPU harness, the
    layout's (:func:`layouts.engine_env`: Model Runner V2), every PCP rank comparing its
    sampled tokens; a Ray engine outside any MPS daemon (under one Ray lost its head)."""
    env = layouts.engine_env(layout, {**os.environ, "PYTHONUNBUFFERED": "1",
                                      "HF_HUB_OFFLINE": "1", **shared_gpu.env()})
    env["VLLM_PCP_CHECK_SAMPLED_TOKENS"] = "1"
    return {**env, **(shared_gpu.without_mps() if layouts.LAYOUTS[layout].ray else {})}


def _run(job: Job, work_dir: str, path: str) -> dict:
    """The worker's run, every process of its session killed on an interrupt, a timeout
    (a refusal's, or for any other run ``VLLM_PCP_ENGINE_TIMEOUT_S`` where set: a hung engine
    fails with its log's errors instead of holding its pytest worker) or a hang at exit
    (:data:`EXIT_GRACE_S` after its output: the output is whole and judged, ``hung_at_exit``
    names the hang, and a warning). Before a timeout's or a hang's kill, each process that
    registered for :data:`shared_gpu.STACKS_SIGNAL` (every vLLM process of a check, through
    the test plugin) prints its Python stacks into the log."""
    out, log = (path.removesuffix(".json") + tail for tail in (".worker.json", ".log"))
    if os.path.exists(out):
        os.remove(out)  # never an earlier run's output
    cmd = [*WORKER, "--model", model_dir(job.model, work_dir), "--layout", job.layout,
           "--variant", job.variant, "--groups", "none" if job.refusal else job.groups,
           "--max-tokens", str(job.max_tokens), "--out", out]
    if job.teacher:
        cmd += ["--teacher", job.teacher if isinstance(job.teacher, str)
                else os.path.join(os.path.dirname(path), job.teacher.name + ".json")]
    env = job_env(job.layout)
    start = time.perf_counter()
    timeout = REFUSAL_TIMEOUT_S if job.refusal else float(os.environ.get(TIMEOUT_VAR) or 0) or None
    returncode, stopped = _start(cmd, env, log, out, timeout)
    timed_out, hung_at_exit = stopped == "timeout", stopped == "exit"
    entry = {"model": job.model, "variant": job.variant, "config": job.layout,
             "job": job.spec(), "git_rev": results.git_rev(),
             "session": os.environ.get(SESSION_VAR),
             "returncode": 0 if hung_at_exit else returncode,
             "seconds": round(time.perf_counter() - start, 1)}
    if hung_at_exit:
        entry["hung_at_exit"] = {"killed_after_output_s": EXIT_GRACE_S, "returncode": returncode}
    text = Path(log).read_text()
    if job.refusal:
        record = judge.refusal_record(text, returncode, timed_out, entry["seconds"],
                                      time.time(), job.refusal)
        return {**entry, "returncode": 0 if record["refused"] else 1, "refusal": record,
                "log_tail": text[-6000:]}
    if os.path.exists(out):  # a failed run may have saved a part
        entry.update(json.loads(Path(out).read_text()))
    if entry.get("shared_gpus"):  # its ranks shared GPUs: side by side, or time-sliced
        entry["mps"] = shared_gpu.mps_serves(env)
    if entry["returncode"]:
        errors = judge.error_lines(text)
        if timed_out:
            errors.insert(0, f"timed out: still running after {timeout:g} s ({TIMEOUT_VAR})")
        entry.update(errors=errors, log_tail=text[-6000:])
    return entry


def run_engine(job: Job, work_dir: str) -> dict:
    """The raw entry of ``job`` (the worker's output; on a failure its errors), its teacher's
    first."""
    if isinstance(job.teacher, Job):
        run_engine(job.teacher, work_dir)
    path = os.path.join(work_dir, "raw", job.name + ".json")
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with FileLock(path + ".lock"):
        if os.path.exists(path):
            entry = json.loads(Path(path).read_text())
            if entry["job"] == job.spec() and (
                    not entry["returncode"] or entry["session"] == os.environ.get(SESSION_VAR)):
                return entry
        entry = _run(job, work_dir, path)
        Path(path + ".tmp").write_text(json.dumps(entry))
        os.replace(path + ".tmp", path)
    if hang := entry.get("hung_at_exit"):
        warnings.warn(f"{job.name}: still running {hang['killed_after_output_s']:g} s after "
                      f"its output was written, killed (its stacks: {path[:-5]}.log)")
    return entry


def compare_with_old(old_raw: str, work_dir: str, max_tokens: int = 32) -> list[dict]:
    """Per engine of an old ``check_exactness.py`` raw file (``{"runs": [...]}``) that ran
    again into ``work_dir``: ``same`` when every case both ran has the same prompts and
    outputs (and scores), token for token and logprob for logprob."""
    raw = [json.loads(p.read_text()) for p in Path(work_dir, "raw").glob(f"*-t{max_tokens}.json")]
    new = {(e["model"], e["variant"], e["config"]): e for e in raw}
    report = []
    for run in json.loads(Path(old_raw).read_text())["runs"]:
        if (entry := new.get((run["model"], run["variant"], run["config"]))) is not None:
            compared, differ = judge.differing_cases(run, entry)
            report.append({"job": f"{run['model']}:{run['variant']}:{run['config']}",
                           "cases": compared, "differ": differ,
                           "same": compared > 0 and not differ})
    return report
