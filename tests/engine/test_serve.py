"""``vllm serve`` at PCP > 1 held to one GPU: chat, bad requests and a dead rank, a soak
(marker ``long``), gsm8k through lm-eval (``pip install -e .[eval]``). Models in
``VLLM_PCP_MODELS_DIR`` (/tmp/models), GSM8K in ``DATA_GSM8K`` (/tmp/gsm8k: train.jsonl, test.jsonl);
``VLLM_PCP_GSM8K_LIMIT`` (its first N questions), ``VLLM_PCP_SOAK_DURATION_S``."""
import asyncio
import itertools
import json
import os
import random
import re
import signal
import time
from concurrent.futures import ThreadPoolExecutor

import psutil
import pytest
import torch

import serve
import shared_gpu
from layouts import LAYOUTS, gpus

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA GPUs")]
MODELS = os.environ.get("VLLM_PCP_MODELS_DIR", "/tmp/models")
SMOLLM2, QWEN = f"{MODELS}/smollm2-135m", f"{MODELS}/qwen2.5-coder-0.5b"
GSM8K_DATA = os.environ.get("DATA_GSM8K", "/tmp/gsm8k")
GSM8K_LIMIT = os.environ.get("VLLM_PCP_GSM8K_LIMIT")  # its first N questions
GSM8K_TASK = os.path.join(os.path.dirname(__file__), "../../configs/lm_eval/gsm8k_local.yaml")
GIB = 1 << 30
# fixed KV pools, little else: servers side by side share the GPUs
COMMON = ("--seed", "0", "--gpu-memory-utilization", "0.05", "--no-enable-flashinfer-autotune")
CHAT_FLAGS = ("--max-model-len", "4096", "--gpu-memory-utilization", "0.1", "--seed", "0",
              "--kv-cache-memory-bytes", str(2 * GIB), "--max-num-batched-tokens", "256",
              "--max-num-seqs", "16", "--enable-log-requests", "--no-enable-flashinfer-autotune")
# 512 tokens a step: the dead rank's 30,000-token prompt prefills over 59 steps
FAULT_FLAGS = (*COMMON, "--kv-cache-memory-bytes", str(4 * GIB), "--max-model-len", "32768",
               "--max-num-seqs", "16", "--max-num-batched-tokens", "512", "--enable-log-requests")
SOAK_FLAGS = (*COMMON, "--max-model-len", "65792", "--max-num-seqs", "64")
SOAK_ENV = {"VLLM_ALLOW_LONG_MAX_MODEL_LEN": "1"}  # 64K prompts are load here; texts stay short
GSM8K_CONCURRENCY = 64  # lm-eval's requests in flight; the server runs as many, no more: its
# sampler warm-up (one row of the 151,936-token vocabulary per sequence) stays a quarter of
# vLLM's default 256 rows, which servers side by side on one GPU could not all hold
# 2 GiB of KV cache a rank: 170K tokens of Qwen2.5-Coder-0.5B (12 KiB a token), twice what 64
# requests hold at once (a 5-shot prompt and lm-eval's 256-token answer: about 1,300 tokens)
GSM8K_FLAGS = (*COMMON, "--kv-cache-memory-bytes", str(2 * GIB),
               "--max-num-seqs", str(GSM8K_CONCURRENCY))
RUNNING = re.compile(r"^vllm:num_requests_running\S* [1-9]", re.M)  # a /metrics line


def layouts(*names):
    return [pytest.param(n, id=n, marks=pytest.mark.gpus(gpus(n))) for n in names]


def on_server(request, layout, model, what, flags, ask, env=None) -> dict:
    """``ask(server)`` of a server of ``layout``, with what ran; an error is the result."""
    if not os.path.exists(model):
        pytest.skip(f"{model} missing (VLLM_PCP_MODELS_DIR)")
    count = torch.cuda.device_count()  # the GPUs its ranks shared, where they did
    shares = gpus(layout) > count
    head = {"layout": layout, "ranks_shared_gpus": min(gpus(layout), count) if shares else None,
            "mps": shared_gpu.mps_serves({**os.environ, **(env or {})}) if shares else None}
    log = os.path.join(serve.run_dir(request), f"{what}-{layout}.log")
    try:
        with serve.serve(layout, model, log, *flags, env=env) as server:
            return {**head, "command": server.command, **ask(server)}
    except Exception as exc:  # noqa: BLE001 -- recorded, and the test fails on it
        return {**head, "error": repr(exc)[-4000:], "server_errors": serve.error_lines(log),
                "goals": {}}


def chat(server) -> dict:
    """A greedy chat (top-5 logprobs), a malformed request, the chat, hang-ups, the chat."""
    def ask(content=serve.QUESTION, **kw) -> tuple:
        return serve.call(server, "/v1/chat/completions", {
            "model": SMOLLM2, "messages": [{"role": "user", "content": content}],
            "temperature": 0.0, "max_tokens": 64, **kw})

    def answer(**kw) -> dict:
        status, out = ask(**kw)
        assert status == 200, out
        return out["choices"][0]

    first = answer(logprobs=True, top_logprobs=5, return_tokens_as_token_ids=True)
    bad, again = ask("hi", max_tokens=-5)[0], answer()["message"]["content"]
    hung_up = serve.hang_up_mid_prefill(server, SMOLLM2)
    tid, tokens = lambda t: t["token"].removeprefix("token_id:"), first["logprobs"]["content"]
    return {"text": first["message"]["content"], "token_ids": [int(tid(t)) for t in tokens],
            "top_logprobs": [{**{tid(x): x["logprob"] for x in t["top_logprobs"]},
                              tid(t): t["logprob"]} for t in tokens],
            "bad_request_status": bad, "text_after_bad_request": again, "clients_hung_up": hung_up,
            "text_after_abort": answer()["message"]["content"],
            "aborted_in_log": len(serve.ABORT_LINE.findall(server.log.read_text(errors="replace")))}


@pytest.mark.parametrize("layout", layouts("pcp1", "pcp2-split-all", "pcp2-dcp2-split-all"))
def test_chat(request, layout):
    """A greedy chat held to -pcp 1's (top-5 rule); a bad request, hang-ups: answer unchanged."""
    runs = [serve.cached(request, f"serve-chat-pcp/{name}", lambda n=name: on_server(
        request, n, SMOLLM2, "chat", CHAT_FLAGS, chat)) for name in dict.fromkeys(("pcp1", layout))]
    serve.write_result(request, "serve-chat-pcp.json",
                       lambda parts: {"runs": parts, **serve.judge_chat(parts)})
    goals = serve.judge_chat(runs)["goals"]
    assert goals and all(goals.values()), [r.get("error") for r in runs] + [goals]


def body(**fields) -> bytes:
    return json.dumps({"model": QWEN, "temperature": 0.0, "max_tokens": 16, **fields}).encode()


# name -> (raw body, choices a correct answer has, whether its texts are empty)
FAULT_CASES = {"empty_prompt": (body(prompt=""), 1, False),
               "prompt_over_max_model_len": (body(prompt=[791] * 32769), 1, False),
               "max_tokens_0": (body(prompt=serve.QUESTION, max_tokens=0), 1, True),
               "one_token_prompt": (body(prompt=[791]), 1, False),
               # over --max-num-seqs; vLLM refuses n > 1 at temperature 0: seeded sampling
               "n_over_max_num_seqs": (body(prompt=serve.QUESTION, n=17, temperature=1.0, seed=0),
                                       17, False),
               "malformed_json": (body(prompt="hi")[:-1] + b', "max_tokens": ', 1, False)}


def bad_requests(server, reference: dict | None) -> dict:
    """Each bad request held to ``reference``'s, a fixed greedy request (probe) after each."""
    def probe():
        return serve.greedy(server, QWEN, serve.QUESTION, 32, ignore_eos=True).get("text")

    first, cases = probe(), []
    ref = reference and {c["case"]: c for c in reference["cases"]}
    for name, (raw, choices, empty) in FAULT_CASES.items():
        case = serve.judge_case(*serve.call(server, "/v1/completions", raw), choices, empty,
                                ref and ref.get(name, {}))
        cases.append({"case": name, **case, "probe_after": probe()})
    in_step = first is not None and all(c["probe_after"] == first for c in cases)
    return {"probe": first, "cases": cases,
            "goals": {"each_4xx_or_correct": all(c["ok"] for c in cases), "ranks_in_step": in_step}}


def dead_rank(server) -> dict:
    """The last worker killed mid-prefill: how soon the server goes, what its log says."""
    found, pool = serve.workers(server.proc.pid), ThreadPoolExecutor(2)
    assert len(found) > 1, f"{len(found)} workers found"

    def send(prompt) -> dict:
        start = time.monotonic()
        status = serve.call(server, "/v1/completions", {
            "model": QWEN, "prompt": prompt, "max_tokens": 16, "temperature": 0.0})[0]
        return {"status": status, "seconds": round(time.monotonic() - start, 2)}

    long_request = pool.submit(send, [100 + (7 * i) % 30000 for i in range(30000)])
    for _ in range(150):  # until /metrics shows it running, at most 30 s
        if long_request.done() or RUNNING.search(str(serve.call(server, "/metrics", None, 5)[1])):
            break
        time.sleep(0.2)
    time.sleep(0.5)
    running_at_kill = not long_request.done()
    os.kill(found[-1][1], signal.SIGKILL)
    start, after_kill = time.monotonic(), pool.submit(send, serve.QUESTION)
    while time.monotonic() - start < 90 and server.proc.poll() is None and serve.healthy(server, 1):
        time.sleep(0.5)  # until it exits or /health fails
    run = {"workers": found, "killed_rank": len(found) - 1, "prefill_running_at_kill":
           running_at_kill, "seconds_to_stop": round(time.monotonic() - start, 2),
           "requests": [long_request.result(), after_kill.result()]}
    pool.shutdown()
    return {**run, **serve.judge_dead_rank(run, server.log.read_text(errors="replace"))}


@pytest.mark.parametrize("layout", layouts("pcp1", "pcp2-split-all", "pcp2-dcp2-split-all"))
def test_bad_requests_and_dead_rank(request, layout):
    """Bad requests a 4xx or -pcp 1's answer; a dead rank stops the server, named."""
    def faults(server) -> dict:
        requests, dead = bad_requests(server, runs[0]), dead_rank(server)
        return {"requests": requests, "dead_rank": dead,
                "goals": {**requests.pop("goals"), **dead.pop("goals")}}

    runs = [serve.cached(request, "serve-faults/pcp1", lambda: on_server(
        request, "pcp1", QWEN, "faults", FAULT_FLAGS, lambda s: bad_requests(s, None)))]
    if layout != "pcp1":  # its rank is killed: outside any MPS daemon (shared_gpu.py)
        runs.append(serve.cached(request, f"serve-faults/{layout}", lambda: on_server(
            request, layout, QWEN, "faults", FAULT_FLAGS, faults, shared_gpu.without_mps())))
    serve.write_result(request, "serve-faults.json", serve.goals_file)
    for run in runs:
        assert run["goals"] and all(run["goals"].values()), run.get("error") or run["goals"]


CITIES = ("Lyon", "Osaka", "Quito", "Perth", "Oslo", "Lagos", "Hanoi", "Lima", "Cork")
# the soak's greedy requests after the load: about 50, 1K, 4K and 16K tokens
GREEDY_PROMPTS = {"question": serve.QUESTION, **{f"records-{n}": "\n".join(
    f"Record {i}: the parcel from {CITIES[i % 9]} weighs {(i * 37) % 90 + 10} kg and left on "
    f"day {(i * 11) % 28 + 1}." for i in range(n)) + f"\n\nQuestion: how much does the parcel "
    f"of record {n // 3} weigh, where is it from, and on which day did it leave? Answer:"
    for n in (50, 200, 800)}}


def greedy_set(server, salt: str = "soak") -> dict:
    return {name: serve.greedy_scored(server, QWEN, p, salt) for name, p in GREEDY_PROMPTS.items()}


async def stream(session, server, index: int, plan: dict) -> dict:
    """One streaming completion by ``vllm bench serve``'s client: done (all ``max_tokens``),
    cancelled (hung up on purpose), error or hang; TTFT, ITL."""
    from vllm.benchmarks.lib.endpoint_request_func import (RequestFuncInput,
                                                           async_request_openai_completions)

    rng = random.Random(index)  # random ids: no prefix hits
    prompt = rng.choices(range(100, 30100), k=rng.choice(plan["prompt_lens"]))
    cancel_s = round(rng.uniform(0.1, 4.0), 2) if (index + 1) % plan["cancel_every"] == 0 else None
    rec = {"index": index, "prompt_len": len(prompt), "outcome": "cancelled" if cancel_s else
           "hang", "ttft_s": None, "itl_s": [], "error": None}
    job = async_request_openai_completions(RequestFuncInput(
        prompt=prompt, api_url=f"{server.url}/v1/completions", prompt_len=len(prompt),
        output_len=plan["max_tokens"], model=QWEN, ignore_eos=True,
        extra_body={"temperature": 0.0}), session)
    try:
        out = await asyncio.wait_for(job, cancel_s or plan["request_timeout_s"])
    except asyncio.TimeoutError:  # leaving drops the connection: the server aborts it
        return rec
    done = out.success and out.output_tokens == plan["max_tokens"]  # an error mid-stream: fewer
    return {**rec, "outcome": "done" if done else "error", "ttft_s": out.ttft, "itl_s": out.itl,
            "error": None if done else out.error[-300:] or f"{out.output_tokens} tokens"}


async def load(server, plan: dict, every_s: float = 5.0) -> tuple[list, list]:
    """The plan's clients, one request after another; memory every ``every_s`` and at the end."""
    import aiohttp

    records, samples, start, indices = [], [], time.perf_counter(), itertools.count()

    async def client(session):
        while time.perf_counter() < start + plan["duration_s"]:
            records.append(await stream(session, server, next(indices), plan))

    def sample() -> list:  # [s, RSS MiB and GPU MiB of the server's processes, GPU measure]
        main = psutil.Process(server.proc.pid)
        procs = [main, *main.children(recursive=True)]
        used = sum(map(torch.cuda.device_memory_used, range(torch.cuda.device_count())))
        gpu, measure = serve.gpu_mib_of({p.pid for p in procs}, serve.nvml_processes(),
                                        used / 2**20)
        rss = sum(p.memory_info().rss for p in procs)
        return [round(time.perf_counter() - start, 1), round(rss / 2**20), gpu, measure]

    async def sample_every():
        while True:
            samples.append(await asyncio.to_thread(sample))
            await asyncio.sleep(every_s)

    sampling = asyncio.create_task(sample_every())
    async with aiohttp.ClientSession() as session:  # its 300 s limit: past request_timeout_s
        await asyncio.gather(*(client(session) for _ in range(plan["concurrency"])))
    sampling.cancel()
    samples.append(sample())
    return records, samples


@pytest.mark.long
@pytest.mark.parametrize("layout", layouts("pcp2", "pcp2-dcp2"))
def test_soak(request, layout):
    """Streaming load with hang-ups: no errors; the greedy set after it the same as before it
    and held to -pcp 1's (the same text; the top-5 rule with -dcp); memory flat."""
    kv, plan = "--kv-cache-memory-bytes", serve.soak_plan(
        gpus(layout), torch.cuda.device_count(), os.environ.get("VLLM_PCP_SOAK_DURATION_S"))
    reference = serve.cached(request, "soak-reference", lambda: on_server(
        request, "pcp1", QWEN, "soak", (*SOAK_FLAGS, kv, str(2 * GIB)), greedy_set, SOAK_ENV))
    assert "error" not in reference, reference["error"]

    def soak(server) -> dict:
        before = greedy_set(server, "before-load")  # salted apart: each set prefills afresh
        records, samples = asyncio.run(load(server, plan))
        greedy = serve.judge_greedy_set(greedy_set(server, "after-load"), before, {
            k: reference[k] for k in GREEDY_PROMPTS}, LAYOUTS[layout].dcp)
        return {"plan": plan, "healthy_after_load": serve.healthy(server),
                **serve.judge_soak(records, samples, greedy)}

    run = serve.cached(request, f"serve-soak/{layout}", lambda: on_server(
        request, layout, QWEN, "soak", (*SOAK_FLAGS, kv, str(8 * GIB)), soak, SOAK_ENV))
    serve.write_result(request, "serve-soak.json", serve.goals_file)
    assert run["goals"] and all(run["goals"].values()), run.get("error") or run["goals"]


def gsm8k(server) -> dict:
    """lm-eval's local-completions against the server: gsm8k, 5-shot, greedy."""
    import lm_eval
    import yaml

    with open(GSM8K_TASK) as f:
        task = yaml.safe_load(f.read().replace("@DATA_DIR@", os.path.abspath(GSM8K_DATA)))
    out = lm_eval.simple_evaluate(
        model="local-completions", tasks=[task], num_fewshot=5, batch_size=1,
        model_args=f"model={QWEN},base_url={server.url}/v1/completions,"
                   f"num_concurrent={GSM8K_CONCURRENCY},"
                   f"max_retries=3,tokenized_requests=False,tokenizer_backend=huggingface,"
                   f"tokenizer={QWEN}", limit=int(GSM8K_LIMIT) if GSM8K_LIMIT else None)
    res = out["results"]["gsm8k_local"]
    return {"exact_match_strict": res["exact_match,strict-match"],
            "exact_match_flexible": res["exact_match,flexible-extract"], "lm_eval_results": res,
            "correct": serve.correct_questions(out.get("samples", {}).get("gsm8k_local", []))}


@pytest.mark.parametrize("layout", layouts("pcp1", "pcp2-split-all", "pcp2-dcp2-split-all",
                                           "tp2-pcp2-split-all", "tp2"))
def test_gsm8k(request, layout, monkeypatch):
    """gsm8k (Qwen2.5-Coder-0.5B, every prompt split) within 1.5 points of -pcp 1's (on a
    subset: no flips a sign test tells from chance); vLLM's own -tp 2 (``tp2``, no plugin at
    work) the control of -tp 2 -pcp 2's server."""
    pytest.importorskip("lm_eval", reason="lm-eval missing: pip install -e .[eval]")
    # local-completions needs lm-eval's api extra; without it every server would start
    # only for lm-eval to refuse the model
    pytest.importorskip("tenacity", reason="lm-eval[api] missing: pip install -e .[eval]")
    if not os.path.exists(f"{GSM8K_DATA}/test.jsonl"):
        pytest.skip(f"{GSM8K_DATA}/test.jsonl missing (DATA_GSM8K)")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    # the layout's own server first: under xdist each worker then runs its layout while one
    # runs -pcp 1, instead of all waiting on -pcp 1's lock
    runs = [serve.cached(request, f"gsm8k/{n}", lambda n=n: on_server(
        request, n, QWEN, "gsm8k", GSM8K_FLAGS, gsm8k)) for n in dict.fromkeys((layout, "pcp1"))]
    runs.reverse()  # -pcp 1 first, as gsm8k_rows reads them
    subset = GSM8K_LIMIT and f"the first {GSM8K_LIMIT} of the 1,319 test questions"
    serve.write_result(request, "gsm8k.json", serve.gsm8k_rows, model=os.path.basename(QWEN),
                       subset=subset)
    assert not any("error" in r for r in runs), [r.get("error") for r in runs]
    row = serve.gsm8k_rows(runs)["rows"][-1]
    assert serve.gsm8k_goal_met(row, subset=bool(GSM8K_LIMIT)), row
