#!/usr/bin/env bash
# The GPU checks and benchmarks, one stage at a time, on a machine with vLLM and this
# plugin installed (2 x H200 for the stages that run PCP, DCP or TP at 2). The first engine
# on a machine compiles FlashInfer's kernels (about 4 minutes); later ones reuse them.
#
#   scripts/run_gpu_checks.sh STAGE OUT_DIR
#
# Configurations are named as in scripts/layouts.py (their flags are defined there only);
# GSM8K text is read from DATA_GSM8K (a folder with train.jsonl and test.jsonl, default
# /tmp/gsm8k), models from /tmp/models and /tmp/pcp-models.
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
#              text (DATA_GSM8K) under DCP_TEXT_CONFIGS
#   exact-tp-dcp  -tp 2 -dcp 2 (PCP = 1) at interleave 1, 8, 16 and with CUDA graphs
#              against PCP = 1, the 1-kv-head model, chunked and unchunked prefill
#              (TP_DCP_CONFIGS picks configurations)
#   exact-features  the feature cases against PCP=1 on FlashInfer (check_exactness.py
#              features, scripts/exactness_features.py): n = 4 seeded sampling, a same-step
#              burst under each pcp_dcp_context_exchange, split prompts of odd and even
#              lengths, prompt_logprobs, a JSON schema, penalties, fp8 KV (refused with
#              -dcp), preemption in a 12288-token pool; -pcp 2 and -pcp 2 -dcp 2 (interleave
#              1, 16), chunked and unchunked, on FEATURE_MODELS (default qwen2.5-3b-shape,
#              FEATURE_CONFIGS its configurations) and the MoE model qwen3-moe-8e
#              (FEATURE_MOE_CONFIGS); the sliding-window model mistral-swa512 must be refused
#              at start-up, error text and seconds to failure recorded (FEATURE_SWA_CONFIGS;
#              empty: none); FEATURE_TAG suffixes the raw files; OUT_DIR/exactness-features.json
#              (tests/gpu/results/exactness-features.json) from every raw file of the stage
#   teacher    teacher-forced exactness: the pcp1 greedy output (256 tokens, chunked) of each
#              case of the exact-pcp models appended to its prompt and scored with
#              prompt_logprobs in each configuration; on one GPU the floors only (pcp1,
#              pcp1-graphs, pcp1-flash-attn), on two also pcp2, pcp2-dcp2-i1, pcp2-dcp2-i16
#              (GPU_COUNT overrides the count, TEACHER_CONFIGS the configurations,
#              TEACHER_VARIANTS the variants, default chunked; TEACHER_SOURCE: a raw file
#              of pcp1 runs whose outputs are scored instead of new ones);
#              OUT_DIR/exactness-teacher.json (tests/gpu/results/exactness-teacher.json)
#   bench      TTFT/ITL: pcp1-stock and pcp1 (one per GPU, at once), then pcp2, pcp2-dcp2,
#              tp2 with the GPUs to themselves; records each KV pool in tokens, and a
#              torch-profiler table (kernels by CUDA time) of one 32K prefill per rank
#              (pcp1, pcp2, pcp2-dcp2), and per step and rank its GPU time in kernels,
#              NCCL, FlashInfer and idle (scripts/trace_steps.py: steps.json)
#   serve      vllm serve chat at PCP=1 and PCP=2 (with clients hanging up mid-prefill),
#              and gsm8k through lm-eval at PCP=1,
#              PCP=2 and PCP=2 x DCP=2, every prompt split (MODEL_GSM8K; DATA_GSM8K),
#              servers side by side;
#              GSM8K_CONFIGS picks some ("pcp2-dcp2"; empty: chat and abort check only)
#   bench-serve  vllm bench serve at concurrency 4 and 16 against one server at a time
#              (SERVE_CONFIGS, default "pcp1 pcp2 pcp2-dcp2 tp2", any layout: e.g.
#              pcp2-dcp2-queries and pcp2-dcp2-keys; INPUT_LEN 16384, PROMPTS
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
#   latency    TTFT through vLLM's own tool: vllm bench latency --input-len N --output-len 1,
#              one process per configuration and length (scripts/bench_latency.py);
#              LATENCY_CONFIGS (default pcp1,pcp2,pcp2-dcp2; on one GPU pcp1-stock,pcp1),
#              LATENCY_LENS (default 32768,131072), BENCH_EAGER as for bench;
#              OUT_DIR/latency.json (benchmarks/results/latency*.json)
#   kernel-choice  one GPU: FlashInfer's paged and ragged prefill kernels (fa2, fa3, auto)
#              for one rank's new tokens at -pcp 2 and 4, the K/V gather and copy, the
#              one-GPU attention (scripts/bench_kernel_choice.py; KERNEL_CHOICE_CASES
#              overrides its --cases); OUT_DIR/kernel-choice.json
#   soak       vllm serve under load (scripts/serve_soak.py): -pcp 2 and -pcp 2 -dcp 2
#              (SOAK_CONFIGS) side by side on both GPUs, 64 streaming clients each,
#              prompts of 1K to 64K tokens, a tenth cancelled mid-stream, for
#              SOAK_DURATION_S (default 420: the stage takes about 10 minutes, a 600 s
#              soak about 13), then greedy texts against a -pcp 1 server's;
#              MODEL_SOAK (default Qwen2.5-Coder-0.5B, 64K allowed past its 32K);
#              OUT_DIR/serve-soak.json
#   faults     bad requests at -pcp 1, -pcp 2, -pcp 2 -dcp 2 (scripts/serve_faults.py,
#              answers held to -pcp 1's), then at -pcp 2 and -pcp 2 -dcp 2 a worker
#              killed mid-prefill (FAULTS_CONFIGS picks them); MODEL_FAULTS;
#              OUT_DIR/serve-faults.json
# bench: BENCH_CONFIGS, BENCH_PROMPT_LENS, BENCH_PROFILE ("--profile-decode 16": decode steps
# instead of a 32K prefill; empty: no profile), BENCH_PROFILE_CONFIGS override; BENCH_PARALLEL_ONE_GPU= (empty)
# runs the one-GPU configurations one after the other (cleaner ITL); BENCH_EAGER= (empty)
# runs with vLLM's CUDA graphs (default: --eager); BENCH_CHUNK=8192 times chunked prefill at
# that many tokens per step (default: unchunked)
# Work files go to /tmp/gpu-checks/STAGE (GPU_CHECKS_DIR overrides /tmp/gpu-checks); OUT_DIR
# gets them packed as STAGE.tgz (profiler traces left out), the stage's result file named
# above, and a summary on stdout. scripts/check_exactness.py compare and
# scripts/bench_pcp.py report turn the raw files into the committed result files.
set -uo pipefail
stage=$1 out=$2
here=$(cd "$(dirname "$0")" && pwd)
work=${GPU_CHECKS_DIR:-/tmp/gpu-checks}/$stage
mkdir -p "$out" "$work"
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1
export DATA_GSM8K=${DATA_GSM8K:-/tmp/gsm8k}
ex() { python3 "$here/check_exactness.py" "$@"; }
lanes() { ex run --overlap --kv-cache-gib 2 --gpu-memory-utilization 0.05 "$@"; }
judge() {  # judge NAME LOGS ARGS...: ex ARGS --out WORK/NAME.json --git-rev --command "$what",
  # NAME.json to OUT_DIR, the tails of WORK/LOGS*.log; the stage's status is the comparison's
  local name=$1 logs=$2
  shift 2
  ex "$@" --out "$work/$name.json" \
    --git-rev "${GIT_REV:-$(git -C "$here" rev-parse HEAD 2> /dev/null || echo unknown)}" \
    --command "$what"
  local rc=$?
  cp "$work/$name.json" "$out/" 2> /dev/null
  tail -n 30 "$work/$logs"*.log
  exit "$rc"
}
layout_flags() {  # VAR NAME [--cuda-graphs | --eager]: VAR=(the vllm serve flags of NAME)
  local -n into=$1
  local _lines
  _lines=$(python3 "$here/layouts.py" serve-flags "${@:2}") || return
  mapfile -t into <<< "$_lines"
}
models=qwen2.5-3b-shape,llama-8kv-hd64,qwen2-mqa-1kv,smollm2
pack() {  # profiler traces left out (hundreds of MB); their per-step tables go in
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
    # the real model and the 1-kv-head model first
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
  exact-features)  # OUT_DIR/exactness-features.json: the feature cases, refusals among them
    ex models --out-dir /tmp/pcp-models --layers 4 > "$work/models.log" 2>&1
    features() { ex features run --overlap --kv-cache-gib 2 --gpu-memory-utilization 0.05 "$@"; }
    moe=${FEATURE_MOE_CONFIGS-pcp1,pcp2,pcp2-dcp2-i1-auto,pcp2-dcp2-i16-auto}
    swa=${FEATURE_SWA_CONFIGS-pcp1,pcp2,pcp2-dcp2-i1-auto,pcp2-dcp2-i16-auto}
    if [ -n "${FEATURE_MODELS-qwen2.5-3b-shape}" ]; then
      features --lanes 6 --one-gpu-lanes 2 --models "${FEATURE_MODELS-qwen2.5-3b-shape}" \
        --variants chunked,unchunked ${FEATURE_CONFIGS:+--configs "$FEATURE_CONFIGS"} \
        --raw "$work/raw-features${FEATURE_TAG-}.json" > "$work/features${FEATURE_TAG-}.log" 2>&1 &
    fi
    if [ -n "$moe" ]; then
      features --lanes 2 --one-gpu-lanes 1 --models qwen3-moe-8e --variants chunked,unchunked \
        --configs "$moe" --raw "$work/raw-features-moe${FEATURE_TAG-}.json" \
        > "$work/features-moe${FEATURE_TAG-}.log" 2>&1 &
    fi
    if [ -n "$swa" ]; then  # refusals: no case runs
      features --lanes 1 --models mistral-swa512 --variants unchunked --configs "$swa" \
        --raw "$work/raw-features-swa${FEATURE_TAG-}.json" \
        > "$work/features-swa${FEATURE_TAG-}.log" 2>&1 &
    fi
    wait
    what="scripts/run_gpu_checks.sh exact-features: check_exactness.py features run --overlap"
    what+=" --kv-cache-gib 2 (${FEATURE_MODELS-qwen2.5-3b-shape}: ${FEATURE_CONFIGS:-the default"
    what+=" configurations}, chunked and unchunked; qwen3-moe-8e: $moe, chunked and unchunked;"
    what+=" mistral-swa512: $swa, unchunked), features compare"
    judge exactness-features features features compare --raw "$work"/raw-features*.json ;;
  teacher)  # OUT_DIR/exactness-teacher.json: per-case max / p99, one-GPU floors, the goal
    ex models --out-dir /tmp/pcp-models --layers 4 > "$work/models.log" 2>&1
    gpus=${GPU_COUNT:-$(python3 -c 'import torch; print(torch.cuda.device_count())')}
    configs=pcp1,pcp1-graphs,pcp1-flash-attn
    if [ "$gpus" -ge 2 ]; then configs=$configs,pcp2,pcp2-dcp2-i1,pcp2-dcp2-i16; fi
    configs=${TEACHER_CONFIGS:-$configs} variants=${TEACHER_VARIANTS:-chunked}
    continuations=${TEACHER_SOURCE:-$work/raw-teacher-gen.json}
    if [ -z "${TEACHER_SOURCE:-}" ]; then  # pcp1's greedy outputs
      lanes --lanes 1 --one-gpu-lanes 4 --variants chunked --max-tokens 256 \
        --models "$models" --configs pcp1 --raw "$continuations" > "$work/teacher-gen.log" 2>&1
    fi
    lanes --lanes 4 --one-gpu-lanes 4 --variants "$variants" --max-tokens 256 \
      --models "$models" --configs "$configs" --teacher "$continuations" \
      --raw "$work/raw-teacher.json" > "$work/teacher.log" 2>&1
    what="scripts/run_gpu_checks.sh teacher on $gpus GPUs: check_exactness.py"
    if [ -n "${TEACHER_SOURCE:-}" ]; then what+=" (the pcp1 outputs of $TEACHER_SOURCE)"
    else what+=" run --configs pcp1 --variants chunked --max-tokens 256,"; fi
    what+=" run --teacher --configs $configs --variants $variants --max-tokens 256"
    what+=" (both --overlap --kv-cache-gib 2), teacher"
    judge exactness-teacher teacher teacher --raw "$work/raw-teacher.json" ;;
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
      layout_flags flags "$config" --cuda-graphs || { echo "$config rc=2"; continue; }
      mapfile -t env < <(python3 "$here/layouts.py" env "$config")
      if [ "$(python3 "$here/layouts.py" gpus "$config")" = 1 ]; then
        env+=(CUDA_VISIBLE_DEVICES=0)  # a one-GPU server on the first GPU
      fi
      env "${env[@]}" INPUT_LEN=${INPUT_LEN:-16384} PROMPTS=${PROMPTS:-16} \
        "$here/bench_serve.sh" /tmp/bench-models/qwen2.5-3b-shape \
        "${SERVE_TOKENIZER:-/tmp/models/qwen2.5-coder-0.5b}" "$work" "$config${SERVE_TAG-}" \
        --load-format dummy ${SERVE_EAGER-} ${SERVE_FLAGS-} "${flags[@]}" \
        > "$work/$config${SERVE_TAG-}.log" 2>&1
      echo "$config rc=$?"
    done ;;
  latency)  # TTFT through vllm bench latency, one process per configuration and length
    python3 "$here/bench_latency.py" --configs "${LATENCY_CONFIGS:-pcp1,pcp2,pcp2-dcp2}" \
      --input-lens "${LATENCY_LENS:-32768,131072}" ${BENCH_EAGER---eager} \
      --log-dir "$work" --out "$work/latency.json" 2>&1 | tee "$work/latency.log"
    rc=${PIPESTATUS[0]}
    [ -f "$work/latency.json" ] && cp "$work/latency.json" "$out/latency.json"
    exit "$rc" ;;
  kernel-choice)  # one GPU, 2.5 to 3 minutes (FlashInfer's first compiles included)
    python3 "$here/bench_kernel_choice.py" --out "$work/kernel-choice.json" \
      ${KERNEL_CHOICE_CASES:+--cases "$KERNEL_CHOICE_CASES"} 2>&1 | tee "$work/kernel-choice.log"
    rc=${PIPESTATUS[0]}
    [ -f "$work/kernel-choice.json" ] && cp "$work/kernel-choice.json" "$out/kernel-choice.json"
    exit "$rc" ;;
  serve)
    python3 "$here/check_serve_chat.py" --model "${MODELS_REAL:-/tmp/models/smollm2-135m}" \
      --git-rev "${GIT_REV:-unknown}" --out "$work/serve-chat-pcp.json" --log-dir "$work" &
    chat=$!
    gsm8k() {  # NAME PORT LAYOUT: lm-eval against a server of LAYOUT
      local name=$1 port=$2 layout
      layout_flags layout "$3" || return
      PORT=$port "$here/eval_gsm8k.sh" "${MODEL_GSM8K:-/tmp/models/qwen2.5-coder-0.5b}" \
        "$DATA_GSM8K" "$work/gsm8k-$name.json" --gpu-memory-utilization 0.1 \
        --kv-cache-memory-bytes $((8 << 30)) "${layout[@]}" > "$work/gsm8k-$name.log" 2>&1
    }
    # PCP runs split every prompt (the default keeps gsm8k's short prompts whole)
    for config in ${GSM8K_CONFIGS-pcp1 pcp2 pcp2-dcp2}; do
      case $config in
        pcp1) gsm8k pcp1 8201 pcp1 & ;;
        pcp2) gsm8k pcp2 8202 pcp2-split-all & ;;
        pcp2-dcp2) gsm8k pcp2-dcp2 8203 pcp2-dcp2-split-all & ;;
      esac
    done
    wait "$chat"; rc=$?  # the stage fails when the chat or abort check does
    wait
    for log in "$work"/gsm8k-*.log; do [ -e "$log" ] && tail -n 3 "$log"; done
    exit "$rc" ;;
  soak)  # the -pcp 1 reference answers while the soak servers start; soaks side by side
    model=${MODEL_SOAK:-/tmp/models/qwen2.5-coder-0.5b}
    export VLLM_ALLOW_LONG_MAX_MODEL_LEN=1  # 64K prompts are load here; texts stay short
    soak_flags=(--gpu-memory-utilization 0.1 --seed 0 --max-model-len 65792 --max-num-seqs 64)
    soak_one() {  # NAME PORT MODE KV_GIB: a server of layout NAME, serve_soak.py MODE
      local name=$1 port=$2 mode=$3 kv_gib=$4 layout
      ( . "$here/serve_lib.sh"  # a subshell each: its own $server and EXIT trap
        layout_flags layout "$name" || exit
        flags=("${soak_flags[@]}" --kv-cache-memory-bytes $((kv_gib << 30)) "${layout[@]}")
        serve_until_healthy "$port" "$work/$name-server.log" 900 "$model" "${flags[@]}"
        python3 "$here/serve_soak.py" "$mode" --port "$port" --model "$model" --name "$name" \
          --server-pid "$server" --server-command "vllm serve $model ${flags[*]}" \
          --reference "$work/soak-pcp1.json" --reference-wait-s 60 \
          --duration-s "${SOAK_DURATION_S:-420}" --request-timeout-s 120 \
          --out "$work/soak-$name.json"
      ) > "$work/soak-$name.log" 2>&1
    }
    soak_one pcp1 8301 reference 2 &
    results=()
    for config in ${SOAK_CONFIGS:-pcp2 pcp2-dcp2}; do
      case $config in
        pcp2) soak_one pcp2 8302 soak 16 & ;;
        pcp2-dcp2) soak_one pcp2-dcp2 8303 soak 16 & ;;
      esac
      results+=("$work/soak-$config.json")
    done
    wait
    python3 "$here/serve_soak.py" merge "${results[@]}" --out "$work/serve-soak.json"
    rc=$?
    cp "$work/serve-soak.json" "$out/serve-soak.json"
    exit "$rc" ;;
  faults)  # -pcp 1 answers the bad requests the others are held to; a dead rank last
    model=${MODEL_FAULTS:-/tmp/models/qwen2.5-coder-0.5b}
    # 512 tokens a step: the dead rank's 30,000-token prompt prefills over 59 steps
    faults_flags=(--gpu-memory-utilization 0.1 --kv-cache-memory-bytes $((4 << 30)) --seed 0
                  --max-model-len 32768 --max-num-seqs 16 --max-num-batched-tokens 512
                  --enable-log-requests)
    faults_one() {  # NAME PORT LAYOUT: bad requests, then (not pcp1) a dead rank
      local name=$1 port=$2 layout
      ( . "$here/serve_lib.sh"
        layout_flags layout "$3" || exit
        serve_until_healthy "$port" "$work/$name-server.log" 900 "$model" \
          "${faults_flags[@]}" "${layout[@]}"
        held_to=()
        [ "$name" = pcp1 ] || held_to=(--reference "$work/faults-pcp1.json")
        python3 "$here/serve_faults.py" requests --port "$port" --model "$model" \
          --name "$name" --max-num-seqs 16 "${held_to[@]}" --reference-wait-s 120 \
          --out "$work/faults-$name.json"
        [ "$name" = pcp1 ] || python3 "$here/serve_faults.py" dead-rank --port "$port" \
          --model "$model" --name "$name" --server-pid "$server" \
          --server-log "$work/$name-server.log" --out "$work/dead-rank-$name.json"
      ) > "$work/faults-$name.log" 2>&1
    }
    faults_one pcp1 8401 pcp1 &
    results=("$work/faults-pcp1.json")
    for config in ${FAULTS_CONFIGS:-pcp2 pcp2-dcp2}; do
      case $config in  # every prompt split, the 1-token one too
        pcp2) faults_one pcp2 8402 pcp2-split-all & ;;
        pcp2-dcp2) faults_one pcp2-dcp2 8403 pcp2-dcp2-split-all & ;;
      esac
      results+=("$work/faults-$config.json" "$work/dead-rank-$config.json")
    done
    wait
    python3 "$here/serve_faults.py" merge "${results[@]}" --out "$work/serve-faults.json"
    rc=$?
    cp "$work/serve-faults.json" "$out/serve-faults.json"
    exit "$rc" ;;
  *) echo "unknown stage $stage" >&2; trap - EXIT; exit 2 ;;
esac
