"""Clients of a running ``vllm serve`` on this host's loopback address, the server's
processes, and the result files: what scripts/serve_soak.py and scripts/serve_faults.py
share. A streaming completion (:func:`stream_one`) fills a :class:`RequestRecord`; the
plain requests (:func:`post_json`, :func:`greedy_answer`, ...) never raise."""
from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import os
import shutil
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field

LOOPBACK = "127.0.0.1"


def base_url(port: int) -> str:
    return f"http://{LOOPBACK}:{port}"


# --- streaming completions --------------------------------------------------------------

@dataclass
class RequestSpec:
    index: int
    prompt: list[int]
    max_tokens: int
    cancel_after_chunks: int | None  # None: read the stream to its end


@dataclass
class RequestRecord:
    """One request's outcome: done, cancelled (by this client), error or hang."""
    index: int
    prompt_len: int
    outcome: str = "error"
    ttft_s: float | None = None
    itl_s: list[float] = field(default_factory=list)
    chunks: int = 0
    completion_tokens: int = 0
    seconds: float = 0.0
    error: str | None = None


def completion_body(model: str, spec: RequestSpec) -> dict:
    return {"model": model, "prompt": spec.prompt, "max_tokens": spec.max_tokens,
            "temperature": 0.0, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}


def parse_sse_line(line: bytes):
    """One server-sent-events line: the decoded JSON of a ``data:`` line, the string
    ``"[DONE]"``, or None for anything else (blank lines, comments)."""
    text = line.decode("utf-8", "replace").strip()
    if not text.startswith("data:"):
        return None
    payload = text[len("data:"):].strip()
    return "[DONE]" if payload == "[DONE]" else json.loads(payload)


async def read_stream(resp, spec: RequestSpec, record: RequestRecord, sent: float) -> None:
    """Fill ``record`` from a streaming completion: TTFT, inter-chunk gaps, tokens;
    hang up once ``spec.cancel_after_chunks`` chunks with text have come."""
    last = None
    async for line in resp.content:
        event = parse_sse_line(line)
        if event is None:
            continue
        if event == "[DONE]":
            record.outcome = "done"
            return
        if "error" in event:
            record.error = json.dumps(event["error"])[:500]
            return
        if event.get("usage"):
            record.completion_tokens = event["usage"].get("completion_tokens", 0)
        if any(c.get("text") for c in event.get("choices", [])):
            now = time.perf_counter()
            if last is None:
                record.ttft_s = now - sent
            else:
                record.itl_s.append(now - last)
            last, record.chunks = now, record.chunks + 1
            if spec.cancel_after_chunks and record.chunks >= spec.cancel_after_chunks:
                record.outcome = "cancelled"
                resp.close()  # the connection drops: the server aborts the request
                return
    record.error = "stream ended without [DONE]"


async def stream_one(session, url: str, model: str, spec: RequestSpec,
                     timeout_s: float) -> RequestRecord:
    """Send one streaming completion; a request not finished within ``timeout_s``
    is recorded as a hang (and given up), any other failure as an error."""
    record = RequestRecord(spec.index, len(spec.prompt))
    sent = time.perf_counter()

    async def go():
        async with session.post(url, json=completion_body(model, spec)) as resp:
            if resp.status != 200:
                record.error = f"HTTP {resp.status}: {(await resp.text())[:300]}"
                return
            await read_stream(resp, spec, record, sent)

    try:
        await asyncio.wait_for(go(), timeout_s)
    except asyncio.TimeoutError:
        record.outcome, record.error = "hang", f"not finished after {timeout_s} s"
    except Exception as exc:  # noqa: BLE001 -- one request's failure, never the soak's
        record.outcome, record.error = "error", repr(exc)[:300]
    if record.outcome == "cancelled" or not record.completion_tokens:
        record.completion_tokens = record.chunks  # no usage chunk: one token a chunk
    record.seconds = time.perf_counter() - sent
    return record


# --- plain requests ---------------------------------------------------------------------

def post_json(port: int, path: str, body: bytes, timeout_s: float) -> tuple[int | None, object]:
    """POST ``body`` to the server; (HTTP status, decoded JSON or the text) -- or
    (None, the exception's repr) when no answer came within ``timeout_s``."""
    req = urllib.request.Request(f"{base_url(port)}{path}", data=body, method="POST",
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout_s) as resp:
            status, raw = resp.status, resp.read()
    except urllib.error.HTTPError as exc:
        status, raw = exc.code, exc.read()
    except (OSError, ValueError) as exc:  # refused, reset, timed out
        return None, repr(exc)
    try:
        return status, json.loads(raw)
    except ValueError:
        return status, raw.decode("utf-8", "replace")


def healthy(port: int, timeout_s: float = 5.0) -> bool:
    try:
        with urllib.request.urlopen(f"{base_url(port)}/health", timeout=timeout_s) as resp:
            return resp.status == 200
    except OSError:
        return False


GREEDY_MAX_TOKENS = 64


def greedy_answer(port: int, model: str, prompt, max_tokens: int = GREEDY_MAX_TOKENS,
                  timeout_s: float = 120.0) -> dict:
    """One greedy completion: its text and per-token log-probabilities, or an error."""
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens,
            "temperature": 0.0, "logprobs": 1}
    status, payload = post_json(port, "/v1/completions", json.dumps(body).encode(), timeout_s)
    if status != 200 or not isinstance(payload, dict):
        return {"error": f"HTTP {status}: {str(payload)[:300]}"}
    choice = payload["choices"][0]
    logprobs = (choice.get("logprobs") or {}).get("token_logprobs") or []
    return {"text": choice["text"], "token_logprobs": logprobs}


def server_max_model_len(port: int, model: str) -> int | None:
    """max_model_len as /v1/models reports it for ``model``."""
    try:
        with urllib.request.urlopen(f"{base_url(port)}/v1/models",
                                    timeout=30) as resp:
            cards = json.load(resp)["data"]
    except (OSError, ValueError, KeyError):
        return None
    return next((c.get("max_model_len") for c in cards if c.get("id") == model), None)


def requests_running(port: int) -> float:
    """vllm:num_requests_running from /metrics (0 when it cannot be read)."""
    try:
        with urllib.request.urlopen(f"{base_url(port)}/metrics", timeout=5) as resp:
            text = resp.read().decode()
    except OSError:
        return 0.0
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("vllm:num_requests_running"))


def send_in_background(port: int, body: dict, timeout_s: float) -> tuple[threading.Thread, dict]:
    """POST ``body`` from a daemon thread; the dict gets status, detail and seconds."""
    outcome: dict = {"timeout_s": timeout_s}

    def send():
        start = time.monotonic()
        status, payload = post_json(port, "/v1/completions", json.dumps(body).encode(),
                                    timeout_s)
        outcome.update(status=status, detail=str(payload)[:300],
                       seconds=round(time.monotonic() - start, 2))

    thread = threading.Thread(target=send, daemon=True)
    thread.start()
    return thread, outcome


# --- the server's processes -------------------------------------------------------------

def _parent_pids() -> dict[int, int]:
    """pid -> parent pid of every process /proc lists."""
    parents = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat") as f:
                stat = f.read()
        except OSError:
            continue  # gone meanwhile
        fields = stat[stat.rindex(")") + 2:].split()  # after "(comm)": state, ppid, ...
        parents[int(name)] = int(fields[1])
    return parents


def tree_pids(root: int) -> list[int]:
    """``root`` and all its descendants that are alive now."""
    parents = _parent_pids()
    if root not in parents:
        return []
    tree, frontier = [root], [root]
    while frontier:
        children = [p for p, pp in parents.items() if pp in frontier and p not in tree]
        tree += children
        frontier = children
    return tree


def read_cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode("utf-8", "replace").strip()
    except OSError:
        return ""


def process_alive(pid: int) -> bool:
    """Running (a zombie, exited but not yet reaped by its parent, is not)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read()
    except OSError:
        return False
    return stat[stat.rindex(")") + 2] != "Z"


def wait_gone(pids: list[int], timeout_s: float) -> list[int]:
    """Those of ``pids`` still running after up to ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and any(process_alive(p) for p in pids):
        time.sleep(0.2)
    return [p for p in pids if process_alive(p)]


def rss_mib(pids: list[int]) -> float:
    """Summed resident set size (VmRSS) of ``pids``, MiB; vanished ones count 0."""
    total_kib = 0
    for pid in pids:
        try:
            with open(f"/proc/{pid}/status") as f:
                for line in f:
                    if line.startswith("VmRSS:"):
                        total_kib += int(line.split()[1])
        except OSError:
            pass
    return total_kib / 1024.0


def _nvidia_smi(query: str) -> list[list[str]]:
    out = subprocess.run(["nvidia-smi", f"--query-{query}", "--format=csv,noheader,nounits"],
                         capture_output=True, text=True, timeout=20).stdout
    return [[c.strip() for c in line.split(",")] for line in out.splitlines() if line.strip()]


def gpu_mib(pids: list[int]) -> tuple[float | None, str | None]:
    """GPU memory of ``pids`` (nvidia-smi's compute apps), MiB, and where it came from:
    "processes"; "devices" (all GPUs' used memory) when no listed process is one of
    ``pids`` (another PID namespace); (None, None) without nvidia-smi."""
    if shutil.which("nvidia-smi") is None:
        return None, None
    try:
        apps = _nvidia_smi("compute-apps=pid,used_memory")
        mine = [float(used) for pid, used in apps if pid.isdigit() and int(pid) in pids]
        if mine:
            return sum(mine), "processes"
        return sum(float(row[0]) for row in _nvidia_smi("gpu=memory.used")), "devices"
    except (OSError, subprocess.SubprocessError, ValueError, IndexError):
        return None, None


# --- result files -----------------------------------------------------------------------

def wait_for_file(path: str, wait_s: float) -> bool:
    """Whether ``path`` exists, or comes within ``wait_s`` (another run writes it)."""
    deadline = time.monotonic() + wait_s
    while not os.path.exists(path) and time.monotonic() < deadline:
        time.sleep(1.0)
    return os.path.exists(path)


def run_meta(git_rev: str | None) -> dict:
    """Revision, command, GPU and versions, date (the GPU result files' ``meta``)."""
    from gpu_runs import versions

    try:
        found = versions()
    except Exception as exc:  # no GPU: recorded, not fatal
        found = {"gpu": f"unavailable: {exc!r}"[:200]}
    rev = git_rev or subprocess.run(
        ["git", "-C", os.path.dirname(os.path.abspath(__file__)), "rev-parse", "HEAD"],
        capture_output=True, text=True).stdout.strip() or "unknown"
    return {"git_rev": rev, "command": " ".join(sys.argv), **found,
            "date": datetime.date.today().isoformat()}


def merge(paths: list[str], command: str = "") -> dict:
    """One result file from soak (or fault) runs: their goals side by side; its ``meta`` is
    the first run's (revision, versions) with ``command`` (the stage that ran them) where
    given, each run keeping its own."""
    runs = []
    for path in paths:
        if not os.path.exists(path):  # its server or client failed: see its log
            runs.append({"name": os.path.basename(path), "error": "no result file",
                         "goals": {}})
            continue
        with open(path) as f:
            runs.append(json.load(f))
    goals = {"/".join(filter(None, (run.get("name"), run.get("check"))))
             or os.path.basename(path): run.get("goals", {}) for run, path in zip(runs, paths)}
    met = bool(runs) and all(g and all(v is True for v in g.values()) for g in goals.values())
    meta = next((run["meta"] for run in runs if "meta" in run), {})
    if command:
        meta = {**meta, "command": command}
    return {"meta": meta, "goals": goals,
            "all_goals_met": met, "runs": runs}


def write_json(path: str, result: dict) -> None:
    with open(path, "w") as f:
        json.dump(result, f, indent=1)


def run_parser(doc: str, modes: tuple[str, ...], name_example: str) -> argparse.ArgumentParser:
    """The parser of a check against a running server: its ``mode``, the run files of
    ``merge``, and --out, --port, --model, --name, --git-rev."""
    ap = argparse.ArgumentParser(description=doc.split("\n")[0])
    ap.add_argument("mode", choices=modes)
    ap.add_argument("inputs", nargs="*", help="merge: the run files")
    ap.add_argument("--out", required=True)
    ap.add_argument("--port", type=int, default=8000)
    ap.add_argument("--model", default=None)
    ap.add_argument("--name", default=None, help=f"the configuration, e.g. {name_example}")
    ap.add_argument("--git-rev", default=os.environ.get("GIT_REV"))
    ap.add_argument("--command", default="",
                    help="merge: the command the merged file records (default: the first run's)")
    return ap
