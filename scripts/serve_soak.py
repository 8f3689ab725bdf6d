"""A bounded soak of a running ``vllm serve`` on this host's loopback address.

    # greedy reference texts from a -pcp 1 server
    python scripts/serve_soak.py reference --port 8301 --model M --out ref.json
    # 64 streaming clients for 600 s, then the same greedy requests, compared to ref.json
    python scripts/serve_soak.py soak --port 8302 --model M --server-pid PID \
        --reference ref.json --out soak-pcp2.json
    # the result file: every soak run, its goals, one meta
    python scripts/serve_soak.py merge --out serve-soak.json soak-pcp2.json soak-pcp2-dcp2.json

The load: ``--concurrency`` clients, each sending streaming completions one after the
other until ``--duration-s`` has passed (or ``--max-requests`` have been sent); the
prompts are distinct token-id lists (as check_serve_chat.py sends; no tokenizer needed,
no prefix hits) of lengths drawn from ``--prompt-lens``; every ``--cancel-every``-th
request hangs up after a random number of streamed chunks. A request still running
``--request-timeout-s`` after it was sent is a hang (the client gives it up). The
server's memory (RSS of its process tree from /proc; GPU memory of those processes
from nvidia-smi where present) is sampled every ``--sample-every-s`` seconds.

After the load the greedy requests of :data:`GREEDY_PROMPTS` run one at a time on the
idle server, as the reference run sent them, and their texts are compared.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import sys
import time
from dataclasses import asdict, dataclass

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from check_serve_chat import QUESTION  # noqa: E402
from serve_client import (RequestRecord, RequestSpec, base_url, greedy_answer,  # noqa: E402
                          gpu_mib, healthy, merge, rss_mib, run_meta, run_parser, stream_one,
                          tree_pids, wait_for_file, write_json)

TOKEN_ID_RANGE = (100, 30100)  # ids every tokenizer of the checks has
DEFAULT_PROMPT_LENS = (1024, 2048, 4096, 8192, 16384, 32768, 65536)


# --- the load ---------------------------------------------------------------------------

@dataclass
class SoakPlan:
    """What the clients send and for how long."""
    concurrency: int = 64
    duration_s: float = 600.0
    prompt_lens: tuple[int, ...] = DEFAULT_PROMPT_LENS
    max_tokens: int = 128
    cancel_every: int = 10  # every tenth request hangs up mid-stream
    request_timeout_s: float = 300.0  # past this a request is a hang
    max_requests: int = 100_000
    seed: int = 0


DISTINCT_HEAD = 16  # a prompt's own first ids: no two prompts share a cached prefix
_POOLS: dict[tuple[int, int], list[int]] = {}


def _token_pool(seed: int, size: int) -> list[int]:
    """Random token ids the prompts are cut from (made once: cutting is cheap, drawing
    64K ids per request would stall the clients' event loop)."""
    if (seed, size) not in _POOLS:
        rng = random.Random(seed)
        _POOLS[(seed, size)] = [rng.randrange(*TOKEN_ID_RANGE) for _ in range(size)]
    return _POOLS[(seed, size)]


def request_spec(index: int, plan: SoakPlan) -> RequestSpec:
    """Request ``index``'s prompt (seeded by plan seed and index, so repeatable, and
    distinct from its first ids on), and where it hangs up if it is one of the
    cancelled tenth."""
    rng = random.Random(plan.seed * 1_000_003 + index)
    length = rng.choice(plan.prompt_lens)
    pool = _token_pool(plan.seed, 2 * max(plan.prompt_lens))
    head = [rng.randrange(*TOKEN_ID_RANGE) for _ in range(min(length, DISTINCT_HEAD))]
    start = rng.randrange(len(pool) - length + 1)
    prompt = head + pool[start:start + length - len(head)]
    cancel = None
    if plan.cancel_every and index % plan.cancel_every == plan.cancel_every - 1:
        cancel = rng.randint(1, max(1, plan.max_tokens - 1))
    return RequestSpec(index, prompt, plan.max_tokens, cancel)


async def run_clients(port: int, model: str, plan: SoakPlan) -> list[RequestRecord]:
    """``plan.concurrency`` clients, each sending one request after the other until
    the duration has passed or ``plan.max_requests`` have been sent."""
    import aiohttp

    url = f"{base_url(port)}/v1/completions"
    records: list[RequestRecord] = []
    next_index = iter(range(plan.max_requests))
    end = time.perf_counter() + plan.duration_s

    async def client(session):
        while time.perf_counter() < end:
            index = next(next_index, None)
            if index is None:
                return
            spec = request_spec(index, plan)
            records.append(await stream_one(session, url, model, spec,
                                            plan.request_timeout_s))

    connector = aiohttp.TCPConnector(limit=plan.concurrency, force_close=True)
    async with aiohttp.ClientSession(connector=connector) as session:
        await asyncio.gather(*(client(session) for _ in range(plan.concurrency)))
    return sorted(records, key=lambda r: r.index)


# --- statistics -------------------------------------------------------------------------

def percentile(values: list[float], q: float) -> float | None:
    """The ``q``-th percentile (0..100) by linear interpolation; None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100.0
    low = int(pos)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (pos - low)


def _p50_p99(values: list[float]) -> dict:
    return {"p50": percentile(values, 50), "p99": percentile(values, 99), "count": len(values)}


def summarize(records: list[RequestRecord], plan: SoakPlan) -> dict:
    """Counts by outcome, tokens, TTFT and ITL percentiles (requests that streamed
    at least one chunk, the cancelled ones included), and the first errors."""
    by_outcome = {k: sum(r.outcome == k for r in records)
                  for k in ("done", "cancelled", "error", "hang")}
    planned = sum(r.index % plan.cancel_every == plan.cancel_every - 1
                  for r in records) if plan.cancel_every else 0
    return {
        "requests_sent": len(records),
        "requests_done": by_outcome["done"],
        "cancelled": by_outcome["cancelled"],
        "cancel_planned": planned,
        "errors": by_outcome["error"],
        "hangs": by_outcome["hang"],
        "prompt_tokens": sum(r.prompt_len for r in records),
        "completion_tokens": sum(r.completion_tokens for r in records),
        "ttft_s": _p50_p99([r.ttft_s for r in records if r.ttft_s is not None]),
        "itl_s": _p50_p99([gap for r in records for gap in r.itl_s]),
        "error_samples": [{"index": r.index, "prompt_len": r.prompt_len,
                           "outcome": r.outcome, "error": r.error}
                          for r in records if r.outcome in ("error", "hang")][:10],
    }


# --- server memory ----------------------------------------------------------------------


class MemorySampler:
    """Samples of the server's memory: (seconds since start, RSS MiB, GPU MiB)."""

    def __init__(self, server_pid: int):
        self.server_pid = server_pid
        self.start = time.perf_counter()
        self.samples: list[tuple[float, float, float | None]] = []
        self.gpu_source: str | None = None

    def sample(self) -> None:
        pids = tree_pids(self.server_pid)
        gpu, source = gpu_mib(pids)
        self.gpu_source = self.gpu_source or source
        self.samples.append((round(time.perf_counter() - self.start, 2),
                             round(rss_mib(pids), 1), gpu))

    async def run(self, stop: asyncio.Event, every_s: float, max_samples: int) -> None:
        """Sample every ``every_s`` seconds until ``stop`` is set (at most
        ``max_samples`` times), and once more at the end."""
        for _ in range(max_samples):
            await asyncio.to_thread(self.sample)
            try:
                await asyncio.wait_for(stop.wait(), every_s)
                break
            except asyncio.TimeoutError:
                pass
        await asyncio.to_thread(self.sample)


def series_summary(times: list[float], values: list[float | None], warmup_s: float) -> dict:
    """first, last, max and growth (last minus the first value at or after
    ``warmup_s``: the pools and caches are filled by then) of one memory series."""
    pairs = [(t, v) for t, v in zip(times, values) if v is not None]
    if not pairs:
        return {"first": None, "last": None, "max": None, "baseline": None, "growth": None}
    baseline = next((v for t, v in pairs if t >= warmup_s), pairs[-1][1])
    return {"first": pairs[0][1], "last": pairs[-1][1], "max": max(v for _, v in pairs),
            "baseline": baseline, "growth": round(pairs[-1][1] - baseline, 1)}


FLAT_MIB, FLAT_FRACTION = 512.0, 0.05


def is_flat(summary: dict) -> bool | None:
    """Growth after the warm-up within max(FLAT_MIB, FLAT_FRACTION of the baseline);
    None for a series with no samples."""
    if summary["growth"] is None:
        return None
    return summary["growth"] <= max(FLAT_MIB, FLAT_FRACTION * summary["baseline"])


def memory_report(sampler: MemorySampler, warmup_s: float) -> dict:
    times = [s[0] for s in sampler.samples]
    rss = series_summary(times, [s[1] for s in sampler.samples], warmup_s)
    gpu = series_summary(times, [s[2] for s in sampler.samples], warmup_s)
    return {"rss_mib": rss, "gpu_mib": gpu, "gpu_source": sampler.gpu_source,
            "warmup_s": warmup_s, "rss_flat": is_flat(rss), "gpu_flat": is_flat(gpu),
            "series": [list(s) for s in sampler.samples]}


# --- greedy requests, before and after ----------------------------------------------------

CITIES = ("Lyon", "Osaka", "Quito", "Perth", "Oslo", "Lagos", "Hanoi", "Lima", "Cork")


def records_document(records: int) -> str:
    """A long plain-text prompt with one answer in it: numbered parcel records and a
    question about one of them (real text: the greedy choice is clear-cut)."""
    lines = [f"Record {i}: the parcel from {CITIES[i % len(CITIES)]} weighs "
             f"{(i * 37) % 90 + 10} kg and left on day {(i * 11) % 28 + 1}."
             for i in range(records)]
    ask = records // 3
    return ("\n".join(lines) + f"\n\nQuestion: how much does the parcel of record {ask} "
            "weigh, where is it from, and on which day did it leave? Answer:")


# name -> prompt; roughly 50, 1K, 4K and 16K tokens (within a 32K model's trained length)
GREEDY_PROMPTS = {"question": QUESTION, "records-50": records_document(50),
                  "records-200": records_document(200), "records-800": records_document(800)}


def greedy_answers(port: int, model: str) -> dict:
    return {name: greedy_answer(port, model, prompt) for name, prompt in GREEDY_PROMPTS.items()}


def compare_greedy(answers: dict, reference: dict) -> dict:
    """Each greedy text against the reference's: equal or where it first differs,
    and the largest |log-probability difference| over the tokens both have."""
    mismatches, max_diff = [], 0.0
    for name, ref in reference.items():
        got = answers.get(name, {"error": "not sent"})
        if "text" not in got or "text" not in ref:
            mismatches.append({"prompt": name, "error": got.get("error") or ref.get("error")})
            continue
        diffs = [abs(a - b) for a, b in zip(got["token_logprobs"], ref["token_logprobs"])
                 if a is not None and b is not None]
        max_diff = max([max_diff, *diffs])
        if got["text"] != ref["text"]:
            at = next((i for i, (a, b) in enumerate(zip(got["text"], ref["text"])) if a != b),
                      min(len(got["text"]), len(ref["text"])))
            mismatches.append({"prompt": name, "first_diff_char": at,
                               "text": got["text"], "reference": ref["text"]})
    return {"equal": not mismatches and bool(reference), "mismatches": mismatches,
            "max_abs_logprob_diff": max_diff}


def load_reference(path: str, wait_s: float) -> dict | None:
    """The reference run's greedy answers, waiting up to ``wait_s`` for its file (the
    reference server may still be answering); None if it never came."""
    if not wait_for_file(path, wait_s):
        return None
    with open(path) as f:
        return json.load(f)["greedy"]


# --- the run and its result file ----------------------------------------------------------


async def soak(port: int, model: str, plan: SoakPlan, server_pid: int | None,
               sample_every_s: float) -> tuple[list[RequestRecord], MemorySampler | None]:
    """The clients, with the memory sampler beside them when a server PID is given."""
    if server_pid is None:
        return await run_clients(port, model, plan), None
    sampler, stop = MemorySampler(server_pid), asyncio.Event()
    max_samples = int((plan.duration_s + plan.request_timeout_s) / sample_every_s) + 2
    sampling = asyncio.create_task(sampler.run(stop, sample_every_s, max_samples))
    try:
        records = await run_clients(port, model, plan)
    finally:
        stop.set()
        await sampling
    return records, sampler


def soak_goals(result: dict) -> dict:
    """The soak's goals: no errors besides the cancellations (and something served),
    no hangs, greedy texts equal to the reference's, memory flat after the warm-up."""
    memory = result.get("memory") or {}
    return {"no_errors": result["errors"] == 0 and result["requests_done"] > 0,
            "no_hangs": result["hangs"] == 0,
            "outputs_equal": result["greedy"]["equal"] is True,
            "memory_flat": memory.get("rss_flat") is True
                           and memory.get("gpu_flat") is not False}


def soak_result(args, plan: SoakPlan, records, sampler, reference) -> dict:
    healthy_after = healthy(args.port)
    answers = greedy_answers(args.port, args.model)
    comparison = (compare_greedy(answers, reference) if reference is not None else
                  {"equal": None, "mismatches": [], "error": "no reference file"})
    result = {"meta": run_meta(args.git_rev), "name": args.name, "plan": asdict(plan),
              "server_command": args.server_command, **summarize(records, plan),
              "healthy_after_load": healthy_after,
              "memory": memory_report(sampler, args.warmup_s) if sampler else None,
              "greedy": {**comparison, "answers": answers}}
    result["goals"] = soak_goals(result)
    return result


def _args() -> argparse.Namespace:
    ap = run_parser(__doc__, ("reference", "soak", "merge"), "pcp2-dcp2")
    ap.add_argument("--server-pid", type=int, default=None)
    ap.add_argument("--server-command", default=None, help="recorded as given")
    ap.add_argument("--reference", default=None)
    ap.add_argument("--reference-wait-s", type=float, default=600.0)
    ap.add_argument("--concurrency", type=int, default=SoakPlan.concurrency)
    ap.add_argument("--duration-s", type=float, default=SoakPlan.duration_s)
    ap.add_argument("--prompt-lens", default=",".join(map(str, DEFAULT_PROMPT_LENS)))
    ap.add_argument("--max-tokens", type=int, default=SoakPlan.max_tokens)
    ap.add_argument("--cancel-every", type=int, default=SoakPlan.cancel_every)
    ap.add_argument("--request-timeout-s", type=float, default=SoakPlan.request_timeout_s)
    ap.add_argument("--max-requests", type=int, default=SoakPlan.max_requests)
    ap.add_argument("--seed", type=int, default=SoakPlan.seed)
    ap.add_argument("--sample-every-s", type=float, default=5.0)
    ap.add_argument("--warmup-s", type=float, default=60.0,
                    help="memory growth is measured from the first sample after this")
    return ap.parse_args()


def main() -> None:
    args = _args()
    if args.mode == "merge":
        result = merge(args.inputs, args.command)
        write_json(args.out, result)
        print(json.dumps(result["goals"]))
        sys.exit(0 if result["all_goals_met"] else 1)
    if args.mode == "reference":
        answers = greedy_answers(args.port, args.model)
        write_json(args.out, {"meta": run_meta(args.git_rev), "name": args.name,
                          "greedy": answers})
        sys.exit(0 if all("text" in a for a in answers.values()) else 1)
    plan = SoakPlan(args.concurrency, args.duration_s,
                    tuple(int(n) for n in args.prompt_lens.split(",")), args.max_tokens,
                    args.cancel_every, args.request_timeout_s, args.max_requests, args.seed)
    records, sampler = asyncio.run(soak(args.port, args.model, plan, args.server_pid,
                                        args.sample_every_s))
    reference = load_reference(args.reference, args.reference_wait_s) if args.reference else None
    result = soak_result(args, plan, records, sampler, reference)
    write_json(args.out, result)
    print(json.dumps({k: result[k] for k in ("name", "requests_done", "cancelled", "errors",
                                             "hangs", "goals")}))
    sys.exit(0 if all(v is True for v in result["goals"].values()) else 1)


if __name__ == "__main__":
    main()
