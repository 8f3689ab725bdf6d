"""``vllm serve`` of a layout for test_serve.py: the server, a client of its OpenAI API, the
judgments of what it answered (pure), and result files rewritten from each test's part."""
from __future__ import annotations

import collections
import contextlib
import json
import math
import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import filelock
import httpx
import psutil

import results
import shared_gpu
from judge import compare_outputs
from layouts import engine_env, serve_flags

VLLM = [sys.executable, "-m", "vllm.entrypoints.cli.main"]
TIMEOUT_S = 120.0  # a request not answered by then is a hang
QUESTION = ("Natalia sold clips to 48 of her friends in April, and then she sold half as "
            "many clips in May. How many clips did Natalia sell altogether in April and "
            "May? Explain step by step.")
ABORTED_PROMPTS, ABORTED_PROMPT_TOKENS, HANG_UP_AFTER_S, ABORT_SETTLE_S = 4, 3500, 0.15, 2.0
ABORT_LINE = re.compile(r"Request \S+ aborted\.")  # vLLM's, with --enable-log-requests
WORKER_TITLE = re.compile(r"^\w+::Worker(_[A-Z]+\d+)*(\s|$)")  # VLLM::Worker_PCP1_DCP1
DEATH_LINE = re.compile(r"died unexpectedly|EngineCore encountered a fatal error|EngineDeadError")
FLAT_MIB, FLAT_FRACTION, WARMUP_S = 512.0, 0.05, 60.0  # the soak's memory: flat
GSM8K_TOLERANCE_POINTS = 1.5
GSM8K_SUBSET_P = 0.05  # a subset's goal: flips a sign test cannot tell from chance
Server = collections.namedtuple("Server", "url proc log command")  # log: a Path


@contextlib.contextmanager
def serve(layout: str, model: str, log: str, *flags: str, env: dict | None = None,
          cuda_graphs: bool | None = None, share_gpus: bool = True):
    """``vllm serve MODEL`` of ``layout`` and ``flags`` on a free port, output in ``log``:
    the :class:`Server` once /health answers (raises with the log's tail if it exits).
    ``cuda_graphs`` overrides the layout's; ``share_gpus=False`` (benchmarks) leaves the
    shared-GPU harness out."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    args = ["serve", model, "--port", str(port), *serve_flags(layout, cuda_graphs), *flags]
    env = {**engine_env(layout, {**os.environ, "PYTHONUNBUFFERED": "1",
                                 **(shared_gpu.env() if share_gpus else {})}), **(env or {})}
    (log := Path(log)).parent.mkdir(parents=True, exist_ok=True)
    with open(log, "w") as out:
        proc = subprocess.Popen([*VLLM, *args], stdout=out, stderr=subprocess.STDOUT, env=env,
                                start_new_session=True)
    server = Server(f"http://127.0.0.1:{port}", proc, log, shlex.join(["vllm", *args]))
    try:
        deadline = time.monotonic() + 900
        while not healthy(server):
            if proc.poll() is not None or time.monotonic() > deadline:
                tail = log.read_text(errors="replace")[-4000:]
                raise RuntimeError(f"{server.command}: exited ({proc.poll()}) or not healthy "
                                   f"in 900 s; its log ends:\n{tail}")
            time.sleep(1)
        yield server
    finally:  # SIGTERM to the process group, then SIGKILL to what is left of it
        for sig in (signal.SIGTERM, signal.SIGKILL):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, sig)
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(60)


def call(server: Server, path: str, body=None, timeout_s: float = TIMEOUT_S) -> tuple:
    """GET ``path``, or POST ``body`` (a dict, or raw bytes) as JSON: (status, JSON or text),
    or (None, the error) when no answer came within ``timeout_s`` (the client hangs up)."""
    data = body if body is None or isinstance(body, bytes) else json.dumps(body).encode()
    try:
        resp = httpx.request("GET" if body is None else "POST", server.url + path,
                             content=data, timeout=timeout_s, trust_env=False,
                             headers={"Content-Type": "application/json"})
    except httpx.HTTPError as exc:
        return None, repr(exc)[:300]
    is_json = resp.headers.get("content-type", "").startswith("application/json")
    return resp.status_code, resp.json() if is_json else resp.text


def healthy(server: Server, timeout_s: float = 5.0) -> bool:
    return call(server, "/health", timeout_s=timeout_s)[0] == 200


def greedy(server: Server, model: str, prompt, max_tokens: int = 64, **extra) -> dict:
    """One greedy completion's text, or an error."""
    status, out = call(server, "/v1/completions", {
        "model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0, **extra})
    return {"text": out["choices"][0]["text"]} if status == 200 else {"error": f"{status}: {out}"}


def scored(choice: dict) -> dict:
    """A completion choice's text, token ids and each token's top logprobs (its own among
    them), from ``logprobs`` asked with ``return_tokens_as_token_ids``."""
    lp, tid = choice["logprobs"], lambda t: t.removeprefix("token_id:")
    return {"text": choice["text"], "token_ids": [int(tid(t)) for t in lp["tokens"]],
            "top_logprobs": [{**{tid(k): v for k, v in (top or {}).items()}, tid(t): own}
                             for t, own, top in zip(lp["tokens"], lp["token_logprobs"],
                                                    lp["top_logprobs"])]}


def greedy_scored(server: Server, model: str, prompt, salt: str, max_tokens: int = 64) -> dict:
    """One greedy completion with its top-5 logprobs (:func:`scored`), or an error; ``salt``
    (vLLM's ``cache_salt``) keeps any other salt's cached prefix from serving it."""
    status, out = call(server, "/v1/completions", {
        "model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0,
        "logprobs": 5, "return_tokens_as_token_ids": True, "cache_salt": salt})
    return scored(out["choices"][0]) if status == 200 else {"error": f"{status}: {out}"}


def hang_up_mid_prefill(server: Server, model: str) -> int:
    """Long distinct prompts whose clients hang up mid-prefill: how many gave up."""
    def send(i: int) -> bool:
        prompt = [(1000 + 7 * i + 13 * t) % 30000 + 100 for t in range(ABORTED_PROMPT_TOKENS)]
        body = {"model": model, "prompt": prompt, "max_tokens": 64}
        return call(server, "/v1/completions", body, HANG_UP_AFTER_S)[0] is None

    with ThreadPoolExecutor(ABORTED_PROMPTS) as pool:
        hung_up = sum(pool.map(send, range(ABORTED_PROMPTS)))
    time.sleep(ABORT_SETTLE_S)  # the aborts reach the engine
    return hung_up


def soak_plan(ranks: int, host_gpus: int, duration_s: str | None = None) -> dict:
    """The soak's load, lighter where ranks share GPUs (saying so); ``duration_s`` overrides."""
    plan = {"concurrency": 64, "duration_s": 420.0, "max_tokens": 128, "cancel_every": 10,
            "prompt_lens": [1024, 2048, 4096, 8192, 16384, 32768, 65536], "request_timeout_s": 120}
    if host_gpus < ranks:
        plan.update(concurrency=16, duration_s=180.0, prompt_lens=[1024, 4096, 16384],
                    scaled_down=f"{ranks} ranks share {host_gpus} GPU(s)")
    return {**plan, "duration_s": float(duration_s or plan["duration_s"])}


def top5_rule(answer: dict, base: dict) -> dict:
    """:func:`judge.compare_outputs` of two answers with ``token_ids`` and ``top_logprobs``."""
    return compare_outputs(*({"token_ids": r["token_ids"], "logprobs": r["top_logprobs"]}
                             for r in (answer, base)))


def judge_chat(runs: list[dict]) -> dict:
    """Chat runs held to pcp1's: the goals (vLLM's top-5 rule, a 4xx, the same text after the
    bad request and after the hang-ups, all aborted), the same text, the largest logprob
    difference before a divergence."""
    base = next((r for r in runs if r["layout"] == "pcp1"), {"error": "no pcp1 run"})
    if any("error" in r for r in [base, *runs]):
        return {"goals": {}}
    held = [top5_rule(run, base) for run in runs if run is not base]
    return {"same_text": all(r["text"] == base["text"] for r in runs),
            "max_abs_logprob_diff": max((h["max_abs_logprob_diff"] for h in held), default=0.0),
            "goals": {"top5_rule": all(h["passed"] for h in held),
                      "bad_request_is_4xx": all(400 <= r["bad_request_status"] < 500 for r in runs),
                      "serves_after_bad_request": all(
                          r["text_after_bad_request"] == r["text"] for r in runs),
                      "serves_after_abort_mid_prefill": all(
                          r["clients_hung_up"] == ABORTED_PROMPTS == r["aborted_in_log"]
                          and r["text_after_abort"] == r["text"] for r in runs)}}


def judge_case(status: int | None, payload, choices: int, empty_text: bool,
               reference: dict | None) -> dict:
    """A bad request's outcome: "rejected" (a 4xx), "answered" (``choices`` texts, empty where
    ``empty_text``) or "bad"; ok: not bad, and as ``reference`` (None: this is the reference)."""
    texts = [c["text"] for c in payload["choices"]] if status == 200 else []
    outcome = "rejected" if status is not None and 400 <= status < 500 else (
        "answered" if len(texts) == choices and not (empty_text and any(texts)) else "bad")
    ok = outcome != "bad" and (reference is None or (reference.get("outcome") == outcome and (
        outcome == "rejected" or reference["texts"] == texts)))
    return {"status": status, "outcome": outcome, "ok": ok,
            "texts": texts if outcome == "answered" else str(payload)[:300]}


def workers(server_pid: int) -> list[tuple[str, int]]:
    """(title, pid) of the server's workers in rank order (titled by group, outermost first)."""
    found = []
    for proc in psutil.Process(server_pid).children(recursive=True):
        with contextlib.suppress(psutil.Error):
            if WORKER_TITLE.match(title := " ".join(proc.cmdline())):
                found.append((title.split()[0], proc.pid))
    return sorted(found, key=lambda w: [int(i) for i in re.findall(r"\d+", w[0])])


def judge_dead_rank(run: dict, log_text: str, stop_s: float = 60.0) -> dict:
    """The log's lines about a worker's death, the rank vLLM's worker monitor names, and the
    goals: stopped within ``stop_s``, the killed rank named, no request left to time out."""
    lines = [line[:300] for line in log_text.splitlines() if DEATH_LINE.search(line)][:10]
    named = next((int(m.group(1)) for m in (re.search(r"VllmWorker-(\d+) died unexpectedly", line)
                                            for line in lines) if m), None)
    return {"log_lines": lines, "named_rank": named, "goals": {
        "stops_within_60s": run["seconds_to_stop"] <= stop_s,
        "log_names_dead_rank": named == run["killed_rank"],
        "no_request_waits_forever": all(r["seconds"] < TIMEOUT_S - 0.5 for r in run["requests"])}}


def gpu_mib_of(pids: set[int], processes: list[tuple[int, int]], device_used_mib: float
               ) -> tuple[float, str]:
    """GPU memory of ``pids`` (MiB) from ``processes``, NVML's (pid, bytes) of every GPU,
    and what it measured. Other jobs on the same GPUs are not counted: where NVML names
    none of ``pids`` (a PID namespace it cannot see into), the whole devices' use."""
    mine = [used for pid, used in processes if pid in pids]
    if mine:
        return round(sum(mine) / 2**20), "the server's processes (NVML)"
    return round(device_used_mib), "the whole GPUs (NVML names none of the server's processes)"


def nvml_processes() -> list[tuple[int, int]]:
    """(pid, GPU bytes) of every compute process on every GPU, by NVML."""
    from vllm.utils.import_utils import import_pynvml

    nvml = import_pynvml()
    nvml.nvmlInit()
    try:
        return [(p.pid, p.usedGpuMemory or 0)
                for i in range(nvml.nvmlDeviceGetCount())
                for p in nvml.nvmlDeviceGetComputeRunningProcesses(
                    nvml.nvmlDeviceGetHandleByIndex(i))]
    finally:
        nvml.nvmlShutdown()


def judge_greedy_set(after: dict, before: dict, reference: dict, dcp: int) -> dict:
    """The soak's greedy set after the load: the same tokens as the same server's before it
    (the load changed no state), and held to -pcp 1's ``reference``: the same text at DCP = 1,
    vLLM's top-5 rule with -dcp (its merge of the shards' partial results rounds otherwise)."""
    def one_gpu(name: str) -> bool:
        ours, ref = after.get(name, {}), reference[name]
        if "text" not in ours or "text" not in ref:
            return False
        if dcp == 1:
            return ours["text"] == ref["text"]
        return top5_rule(ours, ref)["passed"]

    def unchanged(name: str) -> bool:
        ours, earlier = after.get(name, {}), before.get(name, {})
        return "token_ids" in ours and ours.get("token_ids") == earlier.get("token_ids")
    return {"answers": after, "before_load": before, "one_gpu_rule": "same text" if dcp == 1
            else "top-5 rule", "changed_by_load": [n for n in reference if not unchanged(n)],
            "mismatches": [n for n in reference if not one_gpu(n)]}


def judge_soak(records: list[dict], samples: list[list], greedy: dict) -> dict:
    """The soak's outcomes, TTFT and ITL (recorded, never judged); memory ([s, RSS, GPU MiB,
    what the GPU figure measured] samples) grown since WARMUP_S (caches full by then; a third
    of a shorter run, which keeps two thirds of it to judge), flat within max(FLAT_MIB,
    FLAT_FRACTION of that baseline); ``greedy`` (:func:`judge_greedy_set`); its goals."""
    import numpy as np

    def pct(v: list) -> dict:
        return {p: float(np.percentile(v, int(p[1:]))) if v else None for p in ("p50", "p99")}

    count = {k: sum(r["outcome"] == k for r in records)
             for k in ("done", "cancelled", "error", "hang")}
    warmup_s = min(WARMUP_S, round(samples[-1][0] / 3, 1))
    base = next(s for s in samples if s[0] >= warmup_s)
    memory = {"warmup_s": warmup_s, "series": [s[:3] for s in samples],
              "gpu_measure": sorted({s[3] for s in samples if len(s) > 3}), **{name: {
        "baseline_mib": base[col], "growth_mib": round(samples[-1][col] - base[col], 1),
        "flat": samples[-1][col] - base[col] <= max(FLAT_MIB, FLAT_FRACTION * base[col])}
        for col, name in ((1, "rss"), (2, "gpu"))}}
    held = bool(greedy["answers"]) and not greedy["mismatches"]
    return {"outcomes": count, "ttft_s": pct([r["ttft_s"] for r in records if r["ttft_s"]]),
            "itl_s": pct([gap for r in records for gap in r["itl_s"]]), "memory": memory,
            "error_samples": [r for r in records if r["outcome"] in ("error", "hang")][:10],
            "greedy": greedy, "goals": {
                "no_errors": count["error"] == 0 and count["done"] > 0,
                "no_hangs": count["hang"] == 0,
                "outputs_unchanged_by_load": bool(greedy["answers"])
                and not greedy["changed_by_load"],
                "outputs_held_to_one_gpu": held,
                "memory_flat": memory["rss"]["flat"] and memory["gpu"]["flat"]}}


GSM8K_FILTERS = {"strict": "strict-match", "flexible": "flexible-extract"}


def correct_questions(samples: list[dict]) -> dict:
    """The doc ids of the questions answered right, per filter, from lm-eval's samples."""
    return {name: sorted(s["doc_id"] for s in samples if s.get("filter") == key
                         and s.get("exact_match")) for name, key in GSM8K_FILTERS.items()}


def paired_changes(base: list[int], other: list[int], questions: int) -> dict:
    """How many questions flipped between two runs of the same questions, and the two-sided
    exact sign test's p-value of those flips (McNemar's test): the flips, not the two
    scores, say whether a layout answers differently."""
    base, other = set(base), set(other)
    lost, gained = len(base - other), len(other - base)
    flips, fewer = lost + gained, min(lost, gained)
    tail = sum(math.comb(flips, k) for k in range(fewer + 1)) / 2 ** flips if flips else 1.0
    return {"right_to_wrong": lost, "wrong_to_right": gained,
            "same": questions - flips, "p_value": round(min(1.0, 2 * tail), 4)}


def gsm8k_rows(runs: list[dict], baseline: str = "pcp1") -> dict:
    """gsm8k.json's rows: exact match in points, each one's distance from ``baseline`` and,
    where both runs logged their answers, the questions that flipped (:func:`paired_changes`);
    ``failed``: each run that ended in an error, with the error's tail and its server log's
    error lines."""
    done = [r for r in runs if "error" not in r]
    rows = [{"config": r["layout"].removesuffix("-split-all"),
             "questions": r["lm_eval_results"].get("sample_len"),
             **{k: round(100 * r[f"exact_match_{k}"], 2) for k in GSM8K_FILTERS}} for r in done]
    correct = {row["config"]: r.get("correct") for row, r in zip(rows, done)}
    base = next((r for r in rows if r["config"] == baseline), None)
    for row in rows if base else []:
        if row is not base:
            delta = {f"delta_{k}": round(row[k] - base[k], 2) for k in GSM8K_FILTERS}
            tolerated = max(map(abs, delta.values())) <= GSM8K_TOLERANCE_POINTS
            row.update(delta, within_tolerance=tolerated)
            mine, theirs = correct[row["config"]], correct[baseline]
            if mine and theirs and row["questions"] == base["questions"]:
                row["paired"] = {k: paired_changes(theirs[k], mine[k], row["questions"])
                                 for k in GSM8K_FILTERS}
    failed = {r["layout"].removesuffix("-split-all"): {
        "error": r["error"][-500:], "server_log": r.get("server_errors", [])}
        for r in runs if "error" in r}
    return {"tolerance_points": GSM8K_TOLERANCE_POINTS, "rows": rows,
            **({"failed": failed} if failed else {})}


def gsm8k_goal_met(row: dict, subset: bool) -> bool:
    """Whether a gsm8k row meets its goal: on all questions, within
    :data:`GSM8K_TOLERANCE_POINTS` of one GPU on both filters. On a subset
    (``VLLM_PCP_GSM8K_LIMIT``), where one question can outweigh that tolerance (0.78 points of
    128), the questions that flipped, which a two-sided sign test cannot tell from chance
    (p >= :data:`GSM8K_SUBSET_P`) on both filters. One GPU's own row meets it."""
    if "within_tolerance" not in row:
        return True
    if not subset:
        return row["within_tolerance"]
    paired = row.get("paired")
    return bool(paired) and all(p["p_value"] >= GSM8K_SUBSET_P for p in paired.values())


def goals_file(runs: list[dict]) -> dict:
    """serve-faults.json, serve-soak.json: each layout's goals, whether all are met."""
    goals = {r["layout"]: r["goals"] for r in runs}
    met = bool(goals) and all(g and all(v is True for v in g.values()) for g in goals.values())
    return {"goals": goals, "all_goals_met": met, "runs": runs}


ERROR_TEXT = re.compile(r"([\w.]+Error: .*|Sticky error.*)")  # an exception's type and message


def error_lines(log: str, count: int = 3) -> list[str]:
    """The first ``count`` distinct exceptions a server's log names (the cause that a client's
    connection error hides), each its type and message, at most 300 characters."""
    try:
        lines = Path(log).read_text(errors="replace").splitlines()
    except OSError:
        return []
    found = [m.group(1).strip()[:300] for m in map(ERROR_TEXT.search, lines)
             if m and " WARNING " not in m.string]  # vLLM's warnings quote errors it foresees
    return list(dict.fromkeys(found))[:count]


def run_dir(request) -> str:
    """This pytest run's folder in the work dir, shared by its xdist workers."""
    run = os.environ.get("PYTEST_XDIST_TESTRUNUID") or f"pid{os.getpid()}"
    return os.path.join(request.config.getoption("--engine-work-dir"), "serve", run)


def cached(request, name: str, compute):
    """``name``'s JSON in this run's folder, computed once a run; ``FILE/KEY``: FILE.json's part."""
    path = Path(run_dir(request), f"{name}.json")
    path.parent.mkdir(parents=True, exist_ok=True)
    with filelock.FileLock(f"{path}.lock"):
        if not path.exists():
            (tmp := path.with_suffix(".tmp")).write_text(json.dumps(compute()))
            tmp.replace(path)
        return json.loads(path.read_text())


def write_result(request, name: str, assemble, **meta) -> None:
    """``name`` in --results-dir (if given): ``assemble`` of this run's parts so far."""
    if not (out := request.config.getoption("--results-dir")):
        return
    command = results.pytest_command(request.config)
    stem = Path(run_dir(request), name.removesuffix(".json"))
    with filelock.FileLock(f"{stem}.lock"):
        parts = [json.loads(path.read_text()) for path in sorted(stem.glob("*.json"))]
        shared = results.shared_gpus({p["layout"]: p.get("ranks_shared_gpus") for p in parts},
                                     [p["layout"] for p in parts if p.get("mps")])
        results.write(out, name, {"meta": results.meta(command, ranks_shared_gpus=shared, **meta),
                                  **assemble(parts)})
