#!/usr/bin/env bash
# The GPU checks and benchmarks of one sitting on 2 x H200, one stage per call (each under
# 10 minutes once FlashInfer's kernels are compiled; the first engine of a fresh host
# compiles them, about 4 minutes).
#
#   scripts/run_gpu_checks.sh STAGE OUT_DIR
#
# Stages, in the order worth running them:
#   kernels    pytest tests/gpu (FlashInfer kernels as driven here vs the reference);
#              OUT_DIR/kernels.json: pass counts by test, outcomes, git revision (GIT_REV,
#              else git's HEAD), GPU, versions, date (tests/gpu/results/kernels.json)
#   exact-pcp  PCP=2 vs PCP=1 on the random models and SmolLM2 (/tmp/models/smollm2-135m),
#              chunked prefill on and off, plus CUDA graphs and Ray; engines side by side
#              in lanes, each on a fixed 2 GiB KV pool (no memory profiling to disturb)
#   exact-dcp  PCP x DCP at interleave 1, 8, 16 against PCP=1, 256 greedy tokens, and at 8
#              with CUDA graphs against PCP=1 with CUDA graphs; one GPU
#              on FlashAttention against FlashInfer (the noise floor of a kernel change);
#              one run whose KV pool per rank (20480 tokens) is smaller than its longest
#              prompt (32768); DCP_CONFIGS and DCP_UNCHUNKED_CONFIGS pick configurations
#              (also pcp2-dcp2-i8-keys / -queries: one context exchange forced); and the
#              real models of DCP_TEXT_MODELS (default smollm2-text; empty: none) on GSM8K
#              text (DATA_GSM8K, default .gpu/gsm8k, else $STASH/gsm8k) under DCP_TEXT_CONFIGS
#   exact-tp-dcp  -tp 2 -dcp 2 (PCP = 1) at interleave 1, 8, 16 and with CUDA graphs
#              against PCP = 1, the 1-kv-head model, chunked and unchunked prefill
#              (TP_DCP_CONFIGS picks configurations)
#   bench      TTFT/ITL: pcp1-stock and pcp1 (one per GPU, at once), then pcp2, pcp2-dcp2,
#              tp2 with the GPUs to themselves; records each KV pool in tokens, and a
#              torch-profiler table (kernels by CUDA time) of one 32K prefill per rank
#              (pcp1, pcp2, pcp2-dcp2), and per step and rank its GPU time in kernels,
#              NCCL, FlashInfer and idle (scripts/trace_steps.py: steps.json)
#   serve      vllm serve chat at PCP=1 and PCP=2 (with clients hanging up mid-prefill),
#              and gsm8k through lm-eval at PCP=1,
#              PCP=2 and PCP=2 x DCP=2 (MODEL_GSM8K; DATA_GSM8K: a folder with train.jsonl
#              and test.jsonl, default .gpu/gsm8k of the checkout, else $STASH/gsm8k),
#              servers side by side;
#              GSM8K_CONFIGS picks some ("pcp2-dcp2"; empty: chat and abort check only)
#   bench-serve  vllm bench serve at concurrency 4 and 16 against one server at a time
#              (SERVE_CONFIGS, default "pcp1 pcp2 pcp2-dcp2 tp2", also pcp2-dcp2-queries
#              and pcp2-dcp2-keys; INPUT_LEN 16384, PROMPTS
#              16), the bench model with dummy weights, CUDA graphs as vLLM's default
#              (SERVE_EAGER=--enforce-eager: none), Qwen2.5-Coder's tokenizer (same
#              vocabulary; SERVE_TOKENIZER: any tokenizer whose ids the model takes);
#              SERVE_FLAGS adds vllm serve flags (e.g. "--max-num-batched-tokens 16384"),
#              SERVE_TAG a suffix to the result names (CONFIG-TAG-cN.json)
#   bench-chunked  bench with CUDA graphs and chunked prefill (8,192 tokens per step) on a
#              32K prompt, decode ITL, and a profile of a 16K prompt's chunks beside 8
#              decoding requests (pcp2, pcp2-dcp2); BENCH_CHUNKED_CONFIGS picks
#              configurations (default pcp1,pcp2,pcp2-dcp2); BENCH_PROFILE_STACK=1 records
#              Python stacks and writes python.json (the attention layer's host time per
#              Python function) beside steps.json; the other BENCH_* are fixed
# bench: BENCH_CONFIGS, BENCH_PROMPT_LENS, BENCH_PROFILE ("--profile-decode 16": decode steps
# instead of a 32K prefill; empty: no profile), BENCH_PROFILE_CONFIGS override; BENCH_PARALLEL_ONE_GPU= (empty)
# runs the one-GPU configurations one after the other (cleaner ITL); BENCH_EAGER= (empty)
# runs with vLLM's CUDA graphs (default: --eager); BENCH_CHUNK=8192 times chunked prefill at
# that many tokens per step (default: unchunked)
# Work files go to /tmp/gpu-checks/STAGE (GPU_CHECKS_DIR overrides /tmp/gpu-checks); OUT_DIR
# gets them as one STAGE.tgz (the device returns few files) and a summary on stdout. scripts/check_exactness.py compare and
# scripts/bench_pcp.py report turn the raw files into the committed result files.
set -uo pipefail
stage=$1 out=$2
here=$(cd "$(dirname "$0")" && pwd)
work=${GPU_CHECKS_DIR:-/tmp/gpu-checks}/$stage
mkdir -p "$out" "$work"
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1
if [ -z "${DATA_GSM8K:-}" ] && [ ! -d "$here/../.gpu/gsm8k" ]; then  # where `stash` keeps it
  export DATA_GSM8K=${STASH:-/tmp}/gsm8k
fi
ex() { python3 "$here/check_exactness.py" "$@"; }
lanes() { ex run --overlap --kv-cache-gib 2 --gpu-memory-utilization 0.05 "$@"; }
models=qwen2.5-3b-shape,llama-8kv-hd64,qwen2-mqa-1kv,smollm2
pack() {  # profiler traces stay behind (too big to return); their tables travel
  tar czf "$out/$stage.tgz" --exclude='*.pt.trace.json*' -C "$(dirname "$work")" "$stage"
}
trap pack EXIT
case "$stage" in
  kernels)  # OUT_DIR/kernels.json (tests/gpu/results/kernels.json): counts, outcomes, meta
    python3 -m pytest -q "$here/../tests/gpu" --junitxml="$work/kernels.xml" 2>&1 \
      | tee "$work/kernels.log"
    rc=${PIPESTATUS[0]}
    python3 - "$work" "$here" <<'EOF'
import datetime, json, os, re, subprocess, sys
import xml.etree.ElementTree as ET
work, here = sys.argv[1:]
sys.path.insert(0, here)
from gpu_runs import versions
try:
    meta = versions()
except Exception as exc:  # no GPU: recorded, not fatal
    meta = {"gpu": f"unavailable: {exc}"}
rev = os.environ.get("GIT_REV") or subprocess.run(
    ["git", "-C", here, "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
outcomes = {}
for case in ET.parse(os.path.join(work, "kernels.xml")).iter("testcase"):
    test = case.get("classname").replace(".", "/") + ".py::" + case.get("name")
    tags = {child.tag for child in case}
    outcomes[test] = next((outcome for tag, outcome in (("failure", "failed"), ("error", "error"),
                                                        ("skipped", "skipped")) if tag in tags),
                          "passed")
counts = {}
for test, outcome in outcomes.items():
    by_outcome = counts.setdefault(test.split("[")[0], {})
    by_outcome[outcome] = by_outcome.get(outcome, 0) + 1
lines = open(os.path.join(work, "kernels.log")).read().splitlines()
summary = [line for line in lines if re.search(r"\d+ \w+.* in [\d.]+s", line)]
result = {"meta": {"git_rev": rev or "unknown",
                   "command": "scripts/run_gpu_checks.sh kernels (python3 -m pytest -q tests/gpu)",
                   **meta, "date": datetime.date.today().isoformat()},
          "pytest_summary": summary[-1].strip("= ") if summary else None,
          "counts": counts,
          "failed": [t for t, o in outcomes.items() if o in ("failed", "error")],
          "tests": [t for t, o in outcomes.items() if o == "passed"]}
json.dump(result, open(os.path.join(work, "kernels.json"), "w"), indent=1)
EOF
    cp "$work/kernels.json" "$out/kernels.json"
    exit "$rc" ;;
  exact-pcp)
    ex models --out-dir /tmp/pcp-models --layers 4 > "$work/models.log" 2>&1
    lanes --lanes 3 --models "$models" --variants unchunked,chunked --configs pcp1,pcp2 \
      --raw "$work/raw-pcp.json" > "$work/pcp.log" 2>&1 &
    lanes --lanes 1 --models qwen2.5-3b-shape --variants chunked \
      --configs pcp1-graphs,pcp2-graphs,pcp2-ray --raw "$work/raw-more.json" \
      > "$work/more.log" 2>&1 &
    wait; tail -n 30 "$work"/pcp.log "$work"/more.log ;;
  exact-dcp)
    ex models --out-dir /tmp/pcp-models --layers 4 > "$work/models.log" 2>&1
    # the real model and the 1-kv-head model first: the last sitting's run ended before them
    lanes --lanes 8 --one-gpu-lanes 2 --variants chunked --max-tokens 256 \
      --models smollm2,qwen2-mqa-1kv,qwen2.5-3b-shape,llama-8kv-hd64 \
      --configs "${DCP_CONFIGS:-pcp1,pcp1-flash-attn,pcp1-graphs,pcp2-dcp2-i1,pcp2-dcp2-i8,pcp2-dcp2-i16,pcp2-dcp2-i8-graphs}" \
      --raw "$work/raw-dcp.json" \
      > "$work/dcp.log" 2>&1 &
    lanes --lanes 1 --models qwen2.5-3b-shape --variants unchunked --max-tokens 256 \
      --configs "${DCP_UNCHUNKED_CONFIGS:-pcp1,pcp2-dcp2-i8,pcp2-dcp2-i8-smallpool}" \
      --raw "$work/raw-dcp-unchunked.json" \
      > "$work/dcp-u.log" 2>&1 &
    if [ -n "${DCP_TEXT_MODELS-smollm2-text}" ]; then  # real models on GSM8K text
      lanes --lanes 2 --one-gpu-lanes 1 --variants chunked --max-tokens 256 \
        --models "${DCP_TEXT_MODELS-smollm2-text}" \
        --configs "${DCP_TEXT_CONFIGS:-pcp1,pcp2-dcp2-i8}" --raw "$work/raw-dcp-text.json" \
        > "$work/dcp-text.log" 2>&1 &
    fi
    wait; tail -n 30 "$work"/dcp*.log ;;
  exact-tp-dcp)  # DCP inside TP on FlashInfer: the 1-kv-head model (kv heads < -tp)
    ex models --out-dir /tmp/pcp-models --layers 4 > "$work/models.log" 2>&1
    lanes --lanes 4 --one-gpu-lanes 2 --variants chunked,unchunked --max-tokens 256 \
      --models qwen2-mqa-1kv \
      --configs "${TP_DCP_CONFIGS:-pcp1,pcp1-graphs,tp2-dcp2-i1,tp2-dcp2-i8,tp2-dcp2-i16,tp2-dcp2-i8-graphs}" \
      --raw "$work/raw-tp-dcp.json" > "$work/tp-dcp.log" 2>&1
    tail -n 30 "$work/tp-dcp.log" ;;
  bench|bench-chunked)
    if [ "$stage" = bench-chunked ]; then  # ttft-chunked.json, itl.json, mixed-step profiles
      BENCH_EAGER= BENCH_CHUNK=8192 BENCH_PARALLEL_ONE_GPU= BENCH_PROMPT_LENS=32768
      BENCH_CONFIGS=${BENCH_CHUNKED_CONFIGS:-pcp1,pcp2,pcp2-dcp2}
      BENCH_PROFILE="--profile-len 16384 --profile-mixed${BENCH_PROFILE_STACK:+ --profile-stack}"
      BENCH_PROFILE_CONFIGS=pcp2,pcp2-dcp2
    fi
    python3 "$here/bench_pcp.py" run ${BENCH_EAGER---eager} ${BENCH_CHUNK:+--chunk $BENCH_CHUNK} \
      ${BENCH_PARALLEL_ONE_GPU---parallel-one-gpu} \
      --configs "${BENCH_CONFIGS:-pcp1-stock,pcp1,pcp2,pcp2-dcp2,tp2}" \
      --prompt-lens "${BENCH_PROMPT_LENS:-4096,32768,131072}" \
      ${BENCH_PROFILE---profile-len 32768} \
      --profile-configs "${BENCH_PROFILE_CONFIGS:-pcp1,pcp2,pcp2-dcp2}" \
      --raw "$work/bench.json" \
      2>&1 | tee "$work/bench.log" | grep -E "^(pcp|tp)"
    rc=$?  # the stage's status is the bench run's
    for dir in "$work"/profile-*/; do  # the traces stay here; their per-step summary travels
      if ls "$dir"*.pt.trace.json* > /dev/null 2>&1; then  # no profile: not a failure
        python3 "$here/trace_steps.py" "$dir"*.pt.trace.json* --out "$dir/steps.json" \
          ${BENCH_PROFILE_STACK:+--python-out "$dir/python.json"} > "$dir/steps.txt" 2>&1
      fi
    done
    exit "$rc" ;;
  bench-serve)  # one server at a time: vllm bench serve times them
    python3 "$here/bench_pcp.py" model --out-dir /tmp/bench-models/qwen2.5-3b-shape
    for config in ${SERVE_CONFIGS:-pcp1 pcp2 pcp2-dcp2 tp2}; do
      case $config in
        pcp1) flags=(--prefill-context-parallel-size 1) env=(CUDA_VISIBLE_DEVICES=0) ;;
        pcp2) flags=(--prefill-context-parallel-size 2) env=() ;;
        # vLLM's all-reduce + RMSNorm fusion (on with torch.compile at TP > 1) failed
        # vLLM's memory profiling on this host (NVLink multicast is off here): off
        tp2) flags=(--tensor-parallel-size 2
                    --compilation-config '{"pass_config": {"fuse_allreduce_rms": false}}')
             env=() ;;
        pcp2-dcp2) flags=(--prefill-context-parallel-size 2 --decode-context-parallel-size 2)
                   env=() ;;
        pcp2-dcp2-queries|pcp2-dcp2-keys)  # one context exchange forced
          flags=(--prefill-context-parallel-size 2 --decode-context-parallel-size 2
                 --additional-config "{\"pcp_dcp_context_exchange\": \"${config##*-}\"}")
          env=() ;;
      esac
      env "${env[@]}" INPUT_LEN=${INPUT_LEN:-16384} PROMPTS=${PROMPTS:-16} \
        "$here/bench_serve.sh" /tmp/bench-models/qwen2.5-3b-shape \
        "${SERVE_TOKENIZER:-/tmp/models/qwen2.5-coder-0.5b}" "$work" "$config${SERVE_TAG-}" \
        --load-format dummy ${SERVE_EAGER-} ${SERVE_FLAGS-} "${flags[@]}" \
        > "$work/$config${SERVE_TAG-}.log" 2>&1
      echo "$config rc=$?"
    done ;;
  serve)
    if ls "$here"/../.gpu/extra/*.whl > /dev/null 2>&1; then  # lm-eval[api] needs tenacity
      python3 -m pip install -q --no-index --no-deps --target /tmp/site "$here"/../.gpu/extra/*.whl
    fi
    python3 "$here/check_serve_chat.py" --model "${MODELS_REAL:-/tmp/models/smollm2-135m}" \
      --git-rev "${GIT_REV:-unknown}" --out "$work/serve-chat-pcp.json" --log-dir "$work" &
    chat=$!
    flags=(--enforce-eager --gpu-memory-utilization 0.1 --kv-cache-memory-bytes $((8 << 30))
           --attention-backend FLASHINFER)
    gsm8k() {  # NAME PORT PCP [more vllm serve flags]
      local name=$1 port=$2; shift 2
      PORT=$port "$here/eval_gsm8k.sh" "${MODEL_GSM8K:-/tmp/models/qwen2.5-coder-0.5b}" \
        "${DATA_GSM8K:-$here/../.gpu/gsm8k}" "$work/gsm8k-$name.json" "${flags[@]}" \
        --prefill-context-parallel-size "$@" > "$work/gsm8k-$name.log" 2>&1
    }
    # PCP runs split every prompt (the default keeps gsm8k's short prompts whole)
    for config in ${GSM8K_CONFIGS-pcp1 pcp2 pcp2-dcp2}; do
      case $config in
        pcp1) gsm8k pcp1 8201 1 & ;;
        pcp2) gsm8k pcp2 8202 2 --additional-config '{"pcp_min_split_tokens": 2}' & ;;
        pcp2-dcp2) gsm8k pcp2-dcp2 8203 2 --decode-context-parallel-size 2 \
          --additional-config '{"pcp_min_split_tokens": 2}' & ;;
      esac
    done
    wait "$chat"; rc=$?  # the stage fails when the chat or abort check does
    wait
    for log in "$work"/gsm8k-*.log; do [ -e "$log" ] && tail -n 3 "$log"; done
    exit "$rc" ;;
  *) echo "unknown stage $stage" >&2; trap - EXIT; exit 2 ;;
esac
