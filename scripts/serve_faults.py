"""Bad requests and a dead rank against a running ``vllm serve`` on the loopback address.

    # bad requests at -pcp 1, the answers the -pcp 2 run is held to
    python scripts/serve_faults.py requests --port 8401 --model M --max-num-seqs 16 \
        --name pcp1 --out faults-pcp1.json
    # bad requests at -pcp 2, each answer against -pcp 1's
    python scripts/serve_faults.py requests --port 8402 --model M --max-num-seqs 16 \
        --name pcp2 --reference faults-pcp1.json --out faults-pcp2.json
    # kill one worker of that server in the middle of a long prefill (the server stops)
    python scripts/serve_faults.py dead-rank --port 8402 --model M --server-pid PID \
        --server-log pcp2-server.log --name pcp2 --out dead-rank-pcp2.json
    # the result file
    python scripts/serve_faults.py merge --out serve-faults.json faults-pcp2.json ...

Bad requests (:data:`CASES`): each must come back as a 4xx or as a correct answer (a
well-formed completion; with ``--reference``, the same outcome and text as that run's),
and a fixed greedy request before and after each must give the same text: the ranks
stay in step.

What vLLM 0.26.0 already does when a worker dies (MultiprocExecutor, the executor of
``vllm serve`` on one host):

- ``vllm/v1/executor/multiproc_executor.py``, ``WorkerProc.make_worker_process``: each
  worker is a ``multiprocessing`` process named ``VllmWorker-{rank}``, a child of the
  engine core process (itself a child of the API server, the ``vllm serve`` process);
  ``WorkerProc.setup_proc_title_and_log_prefix`` sets its process title to
  ``VLLM::Worker_PCP{r}`` (``_TP{r}``, ``_DCP{r}``, ... by the groups it is in;
  ``VLLM_PROCESS_NAME_PREFIX`` is the ``VLLM``) and its log prefix to
  ``(Worker_PCP{r} pid=N)``.
- ``MultiprocExecutor.start_worker_monitor``: a daemon thread, ``MultiprocWorkerMonitor``,
  waits on every worker's process sentinel; on the first death it logs "Worker proc
  VllmWorker-{rank} died unexpectedly (exit code: N), shutting down executor.", sets
  ``is_failed``, calls ``MultiprocExecutor.shutdown`` and then the failure callback.
- ``MultiprocExecutor.shutdown`` closes each worker's death pipe, and
  ``_ensure_worker_termination`` waits ``VLLM_WORKER_SHUTDOWN_TIMEOUT_SECONDS`` (5),
  sends SIGTERM, waits 4 s, sends SIGKILL (a surviving rank stuck in a collective with
  the dead one goes this way); then it shuts the message queues, so an
  ``execute_model`` waiting for its reply raises ``RuntimeError("cancelled")``
  (``vllm/distributed/device_communicators/shm_broadcast.py``,
  ``MessageQueue.acquire_read``).
- ``vllm/v1/engine/core.py``: the failure callback (``EngineCoreProc.__init__``'s
  ``executor_fail_callback``) queues ``EXECUTOR_FAILED``, which
  ``EngineCoreProc._handle_client_request`` turns into ``RuntimeError("Executor
  failed.")``; ``EngineCoreProc.run_engine_core`` logs "EngineCore encountered a fatal
  error." and ``_send_engine_dead`` tells the API server.
- The API server then raises ``EngineDeadError`` for every request: ``/health`` answers
  503 (``vllm/entrypoints/serve/instrumentator/health.py``, ``health``), and
  ``terminate_if_errored`` (``vllm/entrypoints/launcher.py``, called from
  ``engine_error_handler`` and every 5 s from ``watchdog_loop``) stops the HTTP server
  unless ``VLLM_KEEP_ALIVE_ON_ENGINE_DEATH`` is set.

So a dead rank should stop the server in about 10-15 s with the log line naming
``VllmWorker-{rank}``, and nothing in the plugin has to add to it; ``dead-rank``
measures that: the seconds from the kill until /health fails and until the server
process is gone, the log lines about the death, whether the rank they name is the one
killed, and that the long request and one sent after the kill both come back before
their client timeouts.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import signal
import sys
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from check_serve_chat import QUESTION  # noqa: E402
from serve_client import (greedy_answer, healthy, merge, post_json, process_alive,  # noqa: E402
                          read_cmdline, requests_running, run_meta, run_parser,
                          send_in_background, server_max_model_len, tree_pids, wait_for_file,
                          wait_gone, write_json)

PROBE_MAX_TOKENS = 32
CLIENT_TIMEOUT_S = 120.0


# --- bad requests -----------------------------------------------------------------------

def probe(port: int, model: str) -> str | None:
    """The fixed greedy request sent before and after every bad one: its text."""
    return greedy_answer(port, model, QUESTION, PROBE_MAX_TOKENS,
                                    CLIENT_TIMEOUT_S).get("text")


def cases(model: str, max_model_len: int, max_num_seqs: int) -> dict:
    """name -> (raw request body, choices a correct answer has, whether its text must
    be empty). The token ids are ones every tokenizer of the checks has."""
    def body(**fields) -> bytes:
        return json.dumps({"model": model, "temperature": 0.0, "max_tokens": 16,
                           **fields}).encode()

    too_long = [100 + i % 30000 for i in range(max_model_len + 1)]
    return {
        "empty_prompt": (body(prompt=""), 1, False),
        "prompt_over_max_model_len": (body(prompt=too_long), 1, False),
        "max_tokens_0": (body(prompt=QUESTION, max_tokens=0), 1, True),
        "one_token_prompt": (body(prompt=[791]), 1, False),
        # vLLM 0.26.0 refuses n > 1 at temperature 0: seeded sampling
        "n_over_max_num_seqs": (body(prompt=QUESTION, n=max_num_seqs + 1,
                                     temperature=1.0, seed=0), max_num_seqs + 1, False),
        "malformed_json": (f'{{"model": "{model}", "prompt": "hi", "max_tokens": '.encode(),
                           1, False),
    }


def classify(status: int | None, payload, choices: int, empty_text: bool) -> str:
    """"rejected" (a 4xx), "answered" (a 200 that is a well-formed completion with
    ``choices`` choices, empty texts where ``empty_text``) or "bad" (anything else: a
    5xx, no answer, a malformed 200)."""
    if status is not None and 400 <= status < 500:
        return "rejected"
    if status != 200 or not isinstance(payload, dict):
        return "bad"
    got = payload.get("choices")
    if not isinstance(got, list) or len(got) != choices:
        return "bad"
    if not all(isinstance(c, dict) and isinstance(c.get("text"), str) for c in got):
        return "bad"
    if empty_text and any(c["text"] for c in got):
        return "bad"
    return "answered"


def answer_texts(payload) -> list[str] | None:
    if not isinstance(payload, dict):
        return None
    return [c.get("text") for c in sorted(payload.get("choices", []),
                                           key=lambda c: c.get("index", 0))]


def case_ok(entry: dict, reference: dict | None) -> bool:
    """A 4xx or a correct answer; with a reference run, the same outcome (and for an
    answer the same texts) as there."""
    if entry["outcome"] == "bad":
        return False
    if reference is None:
        return True
    ref = reference.get(entry["case"])
    if ref is None or ref["outcome"] != entry["outcome"]:
        return False
    return entry["outcome"] == "rejected" or ref["texts"] == entry["texts"]


def run_cases(port: int, model: str, max_model_len: int, max_num_seqs: int,
              reference: dict | None) -> dict:
    """Every bad request between two probes; the probes' texts and health after each."""
    first = probe(port, model)
    entries = []
    for name, (raw, choices, empty_text) in cases(model, max_model_len, max_num_seqs).items():
        status, payload = post_json(port, "/v1/completions", raw, CLIENT_TIMEOUT_S)
        entry = {"case": name, "status": status,
                 "outcome": classify(status, payload, choices, empty_text),
                 "texts": answer_texts(payload) if status == 200 else None,
                 "detail": None if status == 200 else str(payload)[:300]}
        entry["ok"] = case_ok(entry, reference)
        entry["probe_after"] = probe(port, model)
        entry["healthy_after"] = healthy(port)
        entries.append(entry)
    in_step = first is not None and all(e["probe_after"] == first and e["healthy_after"]
                                        for e in entries)
    return {"probe": first, "cases": entries, "ranks_in_step": in_step,
            "probe_equals_reference": None if reference is None
            else first == reference.get("_probe")}


def load_reference(path: str, wait_s: float) -> dict | None:
    """The reference run's cases by name (and its probe as ``_probe``), waiting up to
    ``wait_s`` for its file."""
    if not wait_for_file(path, wait_s):
        return None
    with open(path) as f:
        data = json.load(f)
    return {**{c["case"]: c for c in data["cases"]}, "_probe": data["probe"]}


def requests_result(args) -> dict:
    max_model_len = args.max_model_len or server_max_model_len(args.port, args.model)
    if max_model_len is None:
        sys.exit("no --max-model-len, and /v1/models does not give it")
    reference = load_reference(args.reference, args.reference_wait_s) if args.reference else None
    run = run_cases(args.port, args.model, max_model_len, args.max_num_seqs, reference)
    goals = {"each_4xx_or_correct": all(e["ok"] for e in run["cases"]),
             "ranks_in_step": run["ranks_in_step"]}
    if args.reference and reference is None:
        goals["each_4xx_or_correct"] = False  # nothing to hold the answers to
    return {"meta": run_meta(args.git_rev), "name": args.name, "check": "requests",
            "max_model_len": max_model_len, "max_num_seqs": args.max_num_seqs,
            "reference": args.reference, **run, "goals": goals}


# --- a dead rank ------------------------------------------------------------------------

WORKER_TITLE = re.compile(r"^\w+::Worker((?:_[A-Z]+\d+)*)(?:\s|$)")
STOP_GOAL_S = 60.0


def worker_processes(server_pid: int) -> list[dict]:
    """The server's workers, found by the process title vLLM gives them
    (``VLLM::Worker_PCP1``...): pid, title, and their group indices ({"PCP": 1})."""
    workers = []
    for pid in tree_pids(server_pid):
        title = read_cmdline(pid)
        match = WORKER_TITLE.match(title)
        if match:
            groups = {g: int(i) for g, i in re.findall(r"_([A-Z]+)(\d+)", match.group(1))}
            workers.append({"pid": pid, "title": title.split()[0], "groups": groups})
    return sorted(workers, key=lambda w: w["title"])


def global_rank(worker: dict, workers: list[dict]) -> int:
    """The worker's rank in vLLM's layout (PP x PCP x TP, TP innermost:
    ``initialize_model_parallel``), the N of its ``VllmWorker-N``; DCP splits TP."""
    size = {g: 1 + max(w["groups"].get(g, 0) for w in workers) for g in ("PP", "PCP", "TP")}
    at = {g: worker["groups"].get(g, 0) for g in size}
    return (at["PP"] * size["PCP"] + at["PCP"]) * size["TP"] + at["TP"]


def watch_server(server_pid: int, port: int, deadline_s: float, poll_s: float) -> dict:
    """Seconds from now until /health first fails and until the server process is
    gone; None for what did not happen within ``deadline_s``."""
    start, unhealthy_at, exited_at = time.monotonic(), None, None
    for _ in range(int(deadline_s / poll_s) + 1):
        elapsed = time.monotonic() - start
        if elapsed > deadline_s:
            break
        if not process_alive(server_pid):
            exited_at = round(elapsed, 2)
            unhealthy_at = unhealthy_at if unhealthy_at is not None else exited_at
            break
        if unhealthy_at is None and not healthy(port, timeout_s=max(poll_s, 1.0)):
            unhealthy_at = round(time.monotonic() - start, 2)
        time.sleep(poll_s)
    return {"seconds_to_unhealthy": unhealthy_at, "seconds_to_exit": exited_at}


DEATH_LINE = re.compile(r"died unexpectedly|Executor failed|EngineCore encountered a fatal "
                        r"error|EngineDeadError")


def dead_worker_lines(log_text: str, worker_pid: int) -> list[str]:
    """The server log's lines about the death: vLLM's monitor and engine errors, and
    whatever the killed worker logged under its ``pid=N`` prefix (the last five)."""
    lines = log_text.splitlines()
    about = [line[:300] for line in lines if DEATH_LINE.search(line)]
    own = [line[:300] for line in lines if f"pid={worker_pid})" in line]
    return about[:10] + own[-5:]


def named_rank(lines: list[str]) -> int | None:
    """The rank of vLLM's "Worker proc VllmWorker-N died unexpectedly" line."""
    for line in lines:
        match = re.search(r"VllmWorker-(\d+) died unexpectedly", line)
        if match:
            return int(match.group(1))
    return None


def returned_in_time(outcome: dict) -> bool:
    """Came back (an answer or an error) before its client timeout."""
    return outcome.get("seconds") is not None and outcome["seconds"] < outcome["timeout_s"] - 0.5


def wait_until_running(port: int, thread: threading.Thread, wait_s: float) -> bool:
    """Until the server reports a running request (the long prefill has been
    scheduled), at most ``wait_s``; False if it never did."""
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline and thread.is_alive():
        if requests_running(port) >= 1:
            return True
        time.sleep(0.2)
    return False


def kill_during_prefill(args, workers: list[dict]) -> dict:
    """Send a long prefill, kill one worker once it runs, and watch the server go."""
    target = workers[args.kill_index]
    tree = tree_pids(args.server_pid)
    prompt = [100 + (7 * i) % 30000 for i in range(args.prompt_tokens)]
    long_thread, long_request = send_in_background(
        args.port, {"model": args.model, "prompt": prompt, "max_tokens": 16,
                    "temperature": 0.0}, args.client_timeout_s)
    scheduled = wait_until_running(args.port, long_thread, args.running_wait_s)
    time.sleep(args.kill_after_s)
    running_at_kill = long_thread.is_alive()
    os.kill(target["pid"], signal.SIGKILL)
    after_thread, after_kill = send_in_background(
        args.port, {"model": args.model, "prompt": QUESTION, "max_tokens": PROBE_MAX_TOKENS,
                    "temperature": 0.0}, args.client_timeout_s)
    watch = watch_server(args.server_pid, args.port, args.deadline_s, args.poll_s)
    left = wait_gone(tree, args.leftover_wait_s)
    for thread in (long_thread, after_thread):  # bounded by their client timeouts
        thread.join(args.client_timeout_s + 5)
    return {"killed": {**target, "rank": global_rank(target, workers)},
            "workers": workers, "prefill_scheduled": scheduled,
            "prefill_running_at_kill": running_at_kill, **watch,
            "processes_left": left, "long_request": long_request,
            "request_after_kill": after_kill}


def dead_rank_goals(run: dict) -> dict:
    """Stopped or unhealthy within STOP_GOAL_S, the log names the killed rank, and
    neither request waited until its client gave up."""
    times = [t for t in (run.get("seconds_to_unhealthy"), run.get("seconds_to_exit"))
             if t is not None]
    return {"stops_within_60s": bool(times) and min(times) <= STOP_GOAL_S,
            "log_names_dead_rank": run.get("named_rank") is not None
                                   and run.get("named_rank") == run["killed"]["rank"],
            "no_request_waits_forever": returned_in_time(run["long_request"])
                                        and returned_in_time(run["request_after_kill"])}


def dead_rank_result(args) -> dict:
    result = {"meta": run_meta(args.git_rev), "name": args.name,
              "check": "dead-rank"}
    workers = worker_processes(args.server_pid)
    for _ in range(int(args.find_workers_s / 0.5)):  # titled once their groups are up
        if len(workers) >= 2 or not process_alive(args.server_pid):
            break
        time.sleep(0.5)
        workers = worker_processes(args.server_pid)
    if len(workers) < 2:
        processes = [[p, read_cmdline(p)[:200]] for p in tree_pids(args.server_pid)]
        return {**result, "error": f"{len(workers)} worker processes found",
                "processes": processes,
                "goals": {k: False for k in ("stops_within_60s", "log_names_dead_rank",
                                             "no_request_waits_forever")}}
    run = kill_during_prefill(args, workers)
    with open(args.server_log, errors="replace") as f:
        run["log_lines"] = dead_worker_lines(f.read(), run["killed"]["pid"])
    run["named_rank"] = named_rank(run["log_lines"])
    return {**result, **run, "goals": dead_rank_goals(run)}


def _args() -> argparse.Namespace:
    ap = run_parser(__doc__, ("requests", "dead-rank", "merge"), "pcp2")
    ap.add_argument("--max-num-seqs", type=int, default=16, help="as the server was given")
    ap.add_argument("--max-model-len", type=int, default=None,
                    help="default: as /v1/models reports it")
    ap.add_argument("--reference", default=None, help="a requests run at -pcp 1")
    ap.add_argument("--reference-wait-s", type=float, default=300.0)
    ap.add_argument("--server-pid", type=int, default=None)
    ap.add_argument("--server-log", default=None)
    ap.add_argument("--kill-index", type=int, default=-1,
                    help="which worker, in the order of their titles (default the last)")
    ap.add_argument("--find-workers-s", type=float, default=10.0,
                    help="how long to look for two or more titled workers")
    ap.add_argument("--prompt-tokens", type=int, default=30000)
    ap.add_argument("--running-wait-s", type=float, default=30.0)
    ap.add_argument("--kill-after-s", type=float, default=0.5,
                    help="after the server first reports the prefill running")
    ap.add_argument("--deadline-s", type=float, default=90.0)
    ap.add_argument("--poll-s", type=float, default=0.5)
    ap.add_argument("--leftover-wait-s", type=float, default=20.0)
    ap.add_argument("--client-timeout-s", type=float, default=CLIENT_TIMEOUT_S)
    return ap.parse_args()


def main() -> None:
    args = _args()
    if args.mode == "merge":
        result = merge(args.inputs, args.command)
    elif args.mode == "requests":
        result = requests_result(args)
    else:
        result = dead_rank_result(args)
    write_json(args.out, result)
    goals = result.get("goals", {})
    print(json.dumps({"name": result.get("name"), "goals": goals}))
    met = result["all_goals_met"] if args.mode == "merge" else all(
        v is True for v in goals.values())
    sys.exit(0 if met else 1)


if __name__ == "__main__":
    main()
