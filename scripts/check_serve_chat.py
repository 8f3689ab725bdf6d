"""One OpenAI-API chat completion from ``vllm serve`` at PCP = 1, PCP = 2 and PCP = 2 x DCP = 2.

    python scripts/check_serve_chat.py --model /tmp/models/smollm2-135m \
        --git-rev REV --out tests/gpu/results/serve-chat-pcp.json

Starts one server per layout (its ranks share the host's GPUs where it has fewer:
tests/engine/shared_gpu.py), sends the same greedy chat request, a
malformed one that must come back as a 4xx while the server keeps serving, and
long prompts whose clients hang up mid-prefill (the server aborts them; every
rank must drop them in the same step, or the next request hangs or differs).
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from gpu_runs import check_env  # noqa: E402
from layouts import LAYOUTS as ALL_LAYOUTS  # noqa: E402
from layouts import serve_flags  # noqa: E402

# the layouts (scripts/layouts.py), the first the one the others are held to: eager,
# FLASHINFER everywhere (vLLM would pick FLASH_ATTN for PCP = 1), and at PCP = 2 the short
# chat prompt split too (the default keeps it whole)
LAYOUTS = ("pcp1", "pcp2-split-all", "pcp2-dcp2-split-all")
QUESTION = ("Natalia sold clips to 48 of her friends in April, and then she sold half as "
            "many clips in May. How many clips did Natalia sell altogether in April and "
            "May? Explain step by step.")


def _wait_healthy(port: int, proc: subprocess.Popen, timeout: float = 600) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2):
                return
        except OSError:
            time.sleep(2)
    raise TimeoutError("server did not become healthy")


ABORTED_PROMPTS, ABORTED_PROMPT_TOKENS, HANG_UP_AFTER_S = 4, 3500, 0.15
MAX_NUM_BATCHED_TOKENS = 256  # a 3,500-token prompt prefills over 14 steps or more


def _greedy_chat(client, model: str, **kw):
    return client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": QUESTION}], temperature=0.0,
        max_tokens=64, **kw)


def _hang_up_mid_prefill(port: int, model: str) -> int:
    """Send long token-id prompts (distinct, so no prefix hits) and close each
    connection after ``HANG_UP_AFTER_S``, long before their prefills end; returns
    how many clients gave up waiting (the server aborts those requests)."""
    from openai import APITimeoutError, OpenAI

    client = OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none",
                    timeout=HANG_UP_AFTER_S, max_retries=0)

    def send(i: int) -> bool:
        prompt = [(1000 + 7 * i + 13 * t) % 30000 + 100 for t in range(ABORTED_PROMPT_TOKENS)]
        try:
            client.completions.create(model=model, prompt=prompt, max_tokens=64)
        except APITimeoutError:
            return True
        return False

    with ThreadPoolExecutor(ABORTED_PROMPTS) as pool:
        hung_up = sum(pool.map(send, range(ABORTED_PROMPTS)))
    time.sleep(2)  # the aborts reach the engine
    return hung_up


def _ask(port: int, model: str) -> dict:
    from openai import BadRequestError, OpenAI

    client = OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none")
    chat = _greedy_chat(client, model, logprobs=True, top_logprobs=5)
    choice = chat.choices[0]
    try:
        client.chat.completions.create(model=model, max_tokens=-5,
                                       messages=[{"role": "user", "content": "hi"}])
        bad_status = 200
    except BadRequestError as exc:
        bad_status = exc.status_code
    again = _greedy_chat(client, model)
    hung_up = _hang_up_mid_prefill(port, model)
    after_abort = _greedy_chat(client, model)
    return {"text": choice.message.content,
            "token_logprobs": [t.logprob for t in choice.logprobs.content],
            "tokens": [t.token for t in choice.logprobs.content],
            "top_logprobs": [{**{top.token: top.logprob for top in t.top_logprobs},
                              t.token: t.logprob} for t in choice.logprobs.content],
            "prompt_tokens": chat.usage.prompt_tokens,
            "bad_request_status": bad_status,
            "text_after_bad_request": again.choices[0].message.content,
            "clients_hung_up": hung_up,
            "text_after_abort": after_abort.choices[0].message.content}


def _shared_gpus_in_log(log_path: str) -> bool:
    """Whether the server's ranks shared GPUs (the harness's start-up warning)."""
    with open(log_path) as f:
        return "vllm-pcp test harness:" in f.read()


def _aborts_in_log(log_path: str) -> int:
    """Requests the server logged as aborted by their client's hang-up
    (``--enable-log-requests``: "Request ID aborted.")."""
    with open(log_path) as f:
        return len(re.findall(r"Request \S+ aborted\.", f.read()))


def serve_and_ask(model: str, layout: str, port: int, log_path: str) -> dict:
    cmd = [sys.executable, "-c", "from vllm.entrypoints.cli.main import main; main()",
           "serve", model, "--port", str(port), *serve_flags(layout),
           "--max-model-len", "4096",
           # a fixed KV pool: both servers share the GPUs, so no memory profiling
           "--gpu-memory-utilization", "0.1", "--kv-cache-memory-bytes", str(2 << 30),
           "--seed", "0", "--max-num-batched-tokens", str(MAX_NUM_BATCHED_TOKENS),
           "--max-num-seqs", "16",  # vLLM wants no more sequences than step tokens
           "--enable-log-requests"]
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True, env={**os.environ, **check_env()})
    lay = ALL_LAYOUTS[layout]
    head = {"layout": layout, "pcp": lay.pcp, "dcp": lay.dcp, "command": " ".join(cmd)}
    try:
        _wait_healthy(port, proc)
        answers = _ask(port, model)
        return {**head, **answers, "aborted_in_log": _aborts_in_log(log_path),
                "ranks_shared_gpus": _shared_gpus_in_log(log_path)}
    except Exception as exc:
        with open(log_path) as f:
            return {**head, "error": repr(exc), "log_tail": f.read()[-4000:]}
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=60)


CHECKS = ("same_text", "sharded_cache_top5_rule", "bad_request_is_4xx",
          "serves_after_bad_request", "serves_after_abort_mid_prefill")


def judge(runs: list[dict]) -> dict:
    """:data:`CHECKS` over the servers' answers, held to the first server's: the same text
    with a whole KV cache on every rank, vLLM's top-5 rule with a sharded one (DCP
    merges partial states in another order; None where a run kept no top-5 lists)."""
    ok = bool(runs) and all("error" not in r for r in runs)
    base = runs[0] if ok else {}
    whole = [r for r in runs if r.get("dcp", 1) == 1]
    diffs = [abs(a - b) for r in runs[1:] if ok
             for a, b in zip(base["token_logprobs"], r["token_logprobs"])]
    return {
        "same_text": ok and all(r["text"] == base["text"] for r in whole),
        "sharded_cache_top5_rule": ok and _top5_rule(base, [r for r in runs if r not in whole]),
        "max_abs_logprob_diff": max(diffs, default=None),
        "bad_request_is_4xx": ok and all(400 <= r["bad_request_status"] < 500 for r in runs),
        "serves_after_bad_request": ok and all(r["text_after_bad_request"] == r["text"]
                                               for r in runs),
        # every hung-up client's request aborted, and the next answer unchanged
        "serves_after_abort_mid_prefill": ok and all(
            r["clients_hung_up"] == ABORTED_PROMPTS == r["aborted_in_log"]
            and r["text_after_abort"] == r["text"] for r in runs),
    }


def _top5_rule(base: dict, runs: list[dict]) -> bool | None:
    """vLLM's top-5 rule (exactness_lib.compare_outputs) on the chat tokens of ``runs``
    against ``base``'s; True with no runs, None where one kept no top-5 lists."""
    from exactness_lib import compare_outputs

    if any("top_logprobs" not in r for r in [base, *runs]):
        return None
    ids: dict[str, int] = {}  # the API names tokens by their text; the rule takes ids

    def as_output(r: dict) -> dict:
        return {"token_ids": [ids.setdefault(t, len(ids)) for t in r["tokens"]],
                "logprobs": [{str(ids.setdefault(t, len(ids))): lp for t, lp in top.items()}
                             for top in r["top_logprobs"]]}

    return all(compare_outputs(as_output(r), as_output(base))["passed"] for r in runs)


def all_checks_pass(result: dict) -> bool:
    """The run's verdict (its exit status): every check of ``CHECKS`` holds."""
    return all(result.get(k) is True for k in CHECKS)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--git-rev", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--log-dir", default="/tmp")
    args = ap.parse_args()
    from gpu_runs import versions

    with ThreadPoolExecutor(len(LAYOUTS)) as pool:  # the servers at once
        runs = list(pool.map(lambda i: serve_and_ask(
            args.model, LAYOUTS[i], 8101 + i,
            os.path.join(args.log_dir, f"serve-{LAYOUTS[i]}.log")), range(len(LAYOUTS))))
    result = {"meta": {"git_rev": args.git_rev, "command": " ".join(sys.argv), **versions(),
                       "date": datetime.date.today().isoformat()},
              "runs": runs, **judge(runs)}
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    print(json.dumps({k: v for k, v in result.items() if k != "runs"}))
    sys.exit(0 if all_checks_pass(result) else 1)


if __name__ == "__main__":
    main()
