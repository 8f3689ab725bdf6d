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
#   engine-proof  every layout against one GPU on vLLM's V1 runner (pcp1-v1, the runner
#              the plugin subclasses), one engine per MODEL:VARIANT:CONFIG[:GROUPS] job:
#              the exactness cases (PROOF_TOKENS greedy tokens, default 64), the feature
#              cases (n = 4 seeded, same-step bursts, prompt_logprobs, JSON schema,
#              penalties), the teacher-forced measure (chunked runs score pcp1-v1's
#              outputs; one-GPU floors pcp1-graphs and pcp1-flash-attn against pcp1), the
#              forced context exchanges, preemption, fp8 and the refusals (fp8 with -dcp,
#              sliding windows); models from /tmp/pcp-models (4 layers), the 36-layer
#              Qwen2.5-3B shape (tp4-pcp2-dcp2-i8) and SmolLM2; PROOF_BASE_JOBS and
#              PROOF_JOBS override the engines, PROOF_LANES (5) how many run at once,
#              PROOF_BASE_RAW takes the baselines from an earlier run's raw-base.json,
#              PROOF_FEATURE_BASE_RAW the feature baselines (raw-features-base.json). On a
#              host with fewer GPUs than a layout's ranks they share them
#              (tests/engine/shared_gpu.py; outputs only, never speed).
#              OUT_DIR/exactness-pcp.json, exactness-dcp.json, exactness-features.json,
#              exactness-teacher.json, memory.json (each rank's peak on the cases
#              against vLLM's profile run; tests/gpu/results/)
#   bench      TTFT/ITL: pcp1-stock and pcp1 (one per GPU, at once), then pcp2, pcp2-dcp2,
#              tp2 with the GPUs to themselves; records each KV pool in tokens, and a
#              torch-profiler table (kernels by CUDA time) of one 32K prefill per rank
#              (pcp1, pcp2, pcp2-dcp2), and per step and rank its GPU time in kernels,
#              NCCL, FlashInfer and idle (scripts/trace_steps.py: steps.json)
#   serve      vllm serve chat at -pcp 1, -pcp 2 and -pcp 2 -dcp 2 (with clients hanging up
#              mid-prefill), and gsm8k through lm-eval at -pcp 1, -pcp 2, -pcp 2 -dcp 2
#              and -tp 2 -pcp 2, every prompt split (MODEL_GSM8K; DATA_GSM8K; LIMIT=N:
#              the first N questions), servers side by side; GSM8K_CONFIGS picks some
#              ("pcp2-dcp2"; empty: chat and abort check only); SERVE_CHAT=0: gsm8k only;
#              GSM8K_KV_GIB (4) each rank's KV cache
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
#              MODEL_SOAK (default Qwen2.5-Coder-0.5B, 64K allowed past its 32K); with
#              fewer than 2 GPUs (the ranks share one over NCCL's sockets) the load
#              scales to 16 clients, prompts of 1K to 16K, 180 s (SOAK_CONCURRENCY,
#              SOAK_PROMPT_LENS, SOAK_DURATION_S override; serve-soak.json's plan
#              records it); OUT_DIR/serve-soak.json
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
layout_env() {  # VAR NAME: VAR=(the environment of NAME's layout, one KEY=VALUE each)
  local -n into_env=$1
  mapfile -t into_env < <(python3 "$here/layouts.py" env "$2")
}
models=qwen2.5-3b-shape,llama-8kv-hd64,qwen2-mqa-1kv,smollm2
share_gpus() {  # the checks of vllm serve: ranks share the GPUs where the host has fewer
  eval "$(python3 "$here/../tests/engine/shared_gpu.py" env)"
}
proof_results() {  # WORK OUT: the engine proof's result files from its raw files
  local rev=${GIT_REV:-$(git -C "$here" rev-parse HEAD 2> /dev/null || echo unknown)}
  local what="scripts/run_gpu_checks.sh engine-proof (check_exactness.py run --jobs ... and features run)"
  ex compare --raw "$1"/raw-base.json "$1"/raw-proof.json --layouts dcp1 \
    --git-rev "$rev" --command "$what" --out "$2/exactness-pcp.json"
  ex compare --raw "$1"/raw-base.json "$1"/raw-proof.json --layouts dcp \
    --git-rev "$rev" --command "$what" --out "$2/exactness-dcp.json"
  ex features compare --raw "$1"/raw-base.json "$1"/raw-features-base.json "$1"/raw-proof.json \
    "$1"/raw-features.json "$1"/raw-features-swa.json --git-rev "$rev" --command "$what" \
    --out "$2/exactness-features.json"
  ex teacher --raw "$1"/raw-base.json "$1"/raw-proof.json --git-rev "$rev" --command "$what" \
    --out "$2/exactness-teacher.json"
  python3 "$here/memory_report.py" --raw "$1"/raw-proof.json "$1"/raw-features.json \
    --git-rev "$rev" --command "$what" --out "$2/memory.json"  # forced exchanges: features
}
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
  engine-proof)  # every layout against one GPU on the V1 runner (pcp1-v1), by engine
    # (MODEL:VARIANT:CONFIG[:CASE GROUPS], PROOF_JOBS overrides): the exactness cases, the
    # feature cases, the teacher-forced measure, and the refusals; on a host with fewer
    # GPUs than a layout's ranks they share them (tests/engine/shared_gpu.py)
    # each model at its own max_model_len: SmolLM2's 8,192 positions cap its cases there
    export VLLM_PCP_CHECK_SAMPLED_TOKENS=1  # every PCP rank's sampled tokens held equal
    t=${PROOF_TOKENS:-64} r=qwen2.5-3b-shape s=smollm2 m=qwen2-mqa-1kv e=qwen3-moe-8e
    proof() { lanes --max-tokens "$t" "$@"; }
    feats() { ex features run --overlap --gpu-memory-utilization 0.05 --kv-cache-gib 2 \
                --max-tokens "$t" "$@"; }
    ex models --out-dir /tmp/pcp-models --layers 4 > "$work/models.log" 2>&1
    ex models --out-dir /tmp/pcp-models-full --layers 1000 --only $r >> "$work/models.log" 2>&1
    f=standard+features
    base=$r:chunked:pcp1-v1:$f,$r:unchunked:pcp1-v1:$f,$s:chunked:pcp1-v1:$f
    base+=,$s:unchunked:pcp1-v1,$m:chunked:pcp1-v1,$e:chunked:pcp1-v1:$f
    base+=,$r-full:chunked:pcp1-v1
    # the feature baselines are read only by the comparison: they run beside both phases
    if [ -n "${PROOF_FEATURE_BASE_RAW:-}" ]; then  # an earlier run's, same versions
      cp "$PROOF_FEATURE_BASE_RAW" "$work/raw-features-base.json"
    else
      feats --lanes 1 --one-gpu-lanes 2 --models $r --variants chunked \
        --configs "${PROOF_FEATURE_BASE:-pcp1-v1-fp8,pcp1-v1-preempt}" \
        --raw "$work/raw-features-base.json" \
        > "$work/features-base.log" 2>&1 &
    fi
    if [ -n "${PROOF_BASE_RAW:-}" ]; then  # baselines of an earlier run, same versions
      cp "$PROOF_BASE_RAW" "$work/raw-base.json"
    else
      proof --lanes 1 --one-gpu-lanes 8 --jobs "${PROOF_BASE_JOBS:-$base}" --teacher self \
        --raw "$work/raw-base.json" > "$work/base.log" 2>&1
    fi
    jobs=$r:chunked:pcp2:$f,$s:chunked:pcp2:$f,$r:chunked:pcp2-dcp2-i8:$f,$r:chunked:pcp4:$f
    jobs+=,$r:chunked:tp2-pcp2,$r:chunked:tp2-pcp2-dcp2-i1,$r-full:chunked:tp4-pcp2-dcp2-i8
    jobs+=,$r:chunked:pcp4-dcp4-i8,$r:chunked:pcp8,$e:chunked:pcp2:$f
    jobs+=,$s:chunked:pcp2-dcp2-i1:$f,$s:chunked:pcp2-dcp2-i16,$r:unchunked:pcp2
    jobs+=,$r:unchunked:pcp2-dcp2-i8,$m:chunked:pcp2,$m:chunked:tp2-dcp2-i8
    jobs+=,$m:chunked:tp2-pcp2,$m:chunked:tp2-pcp2-dcp2-i1,$s:chunked:pcp4:$f
    jobs+=,$s:chunked:pcp4-dcp4-i1,$s:chunked:pcp8,$r:chunked:pcp2-graphs
    jobs+=,$r:chunked:pcp2-dcp2-i8-graphs,$e:chunked:pcp2-dcp2-i1,$e:chunked:pcp4
    jobs+=,$r:chunked:pcp2-ray,$s:unchunked:pcp2,$r:chunked:pcp2-dcp2-i1
    jobs+=,$r:chunked:pcp2-dcp2-i16,$r:unchunked:pcp4
    jobs+=,$r:chunked:pcp1-v1-graphs  # pcp2-graphs's baseline, scoring pcp1-v1's outputs
    for model in $r $s $m $e; do  # the one-GPU floors
      for config in pcp1 pcp1-graphs pcp1-flash-attn; do jobs+=,$model:chunked:$config; done
    done
    jobs+=,$e:chunked:tp2  # vLLM's own expert sharding over two ranks, as -pcp 2 shards them
    proof --lanes "${PROOF_LANES:-5}" --one-gpu-lanes 2 --jobs "${PROOF_JOBS:-$jobs}" \
      --teacher "$work/raw-base.json" --raw "$work/raw-proof.json" > "$work/proof.log" 2>&1 &
    exchanges=pcp2-dcp2-i1-queries,pcp2-dcp2-i1-keys,pcp2-dcp2-i16-queries,pcp2-dcp2-i16-keys
    feats --lanes "${PROOF_FEATURE_LANES:-1}" --models $r --variants chunked --raw "$work/raw-features.json" \
      --configs "${PROOF_FEATURES:-$exchanges,pcp2-preempt,pcp4-preempt,pcp2-dcp2-i1-preempt,pcp2-fp8,pcp4-fp8,pcp2-dcp2-i1-fp8}" \
      > "$work/features.log" 2>&1 &
    feats --lanes 1 --models mistral-swa512 --variants unchunked --configs pcp2,pcp2-dcp2-i1-auto \
      --raw "$work/raw-features-swa.json" > "$work/features-swa.log" 2>&1 &
    wait
    proof_results "$work" "$out" ;;
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
      layout_env env "$config"
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
    share_gpus
    chat=  # SERVE_CHAT=0: gsm8k only
    if [ "${SERVE_CHAT:-1}" != 0 ]; then
      python3 "$here/check_serve_chat.py" --model "${MODELS_REAL:-/tmp/models/smollm2-135m}" \
        --git-rev "${GIT_REV:-unknown}" --out "$work/serve-chat-pcp.json" --log-dir "$work" &
      chat=$!
    fi
    gsm8k() {  # NAME PORT LAYOUT: lm-eval against a server of LAYOUT
      local name=$1 port=$2 layout
      layout_flags layout "$3" || return
      PORT=$port "$here/eval_gsm8k.sh" "${MODEL_GSM8K:-/tmp/models/qwen2.5-coder-0.5b}" \
        "$DATA_GSM8K" "$work/gsm8k-$name.json" --gpu-memory-utilization 0.05 \
        --kv-cache-memory-bytes $((${GSM8K_KV_GIB:-4} << 30)) --no-enable-flashinfer-autotune \
        "${layout[@]}" \
        > "$work/gsm8k-$name.log" 2>&1
    }
    # PCP runs split every prompt (the default keeps gsm8k's short prompts whole)
    for config in ${GSM8K_CONFIGS-pcp1 pcp2 pcp2-dcp2 tp2-pcp2}; do
      case $config in
        pcp1) gsm8k pcp1 8201 pcp1 & ;;
        pcp2) gsm8k pcp2 8202 pcp2-split-all & ;;
        pcp2-dcp2) gsm8k pcp2-dcp2 8203 pcp2-dcp2-split-all & ;;
        tp2-pcp2) gsm8k tp2-pcp2 8204 tp2-pcp2-split-all & ;;
      esac
    done
    rc=0
    [ -n "$chat" ] && { wait "$chat"; rc=$?; }  # the stage fails when the chat or abort check does
    wait
    for log in "$work"/gsm8k-*.log; do [ -e "$log" ] && tail -n 3 "$log"; done
    exit "$rc" ;;
  soak)  # the -pcp 1 reference answers while the soak servers start; soaks side by side
    share_gpus
    if [ "$(python3 -c 'import torch; print(torch.cuda.device_count())')" -lt 2 ]; then
      : "${SOAK_CONCURRENCY:=16}" "${SOAK_PROMPT_LENS:=1024,4096,16384}" "${SOAK_DURATION_S:=180}"
    fi
    model=${MODEL_SOAK:-/tmp/models/qwen2.5-coder-0.5b}
    export VLLM_ALLOW_LONG_MAX_MODEL_LEN=1  # 64K prompts are load here; texts stay short
    soak_flags=(--gpu-memory-utilization 0.05 --seed 0 --max-model-len 65792 --max-num-seqs 64
                --no-enable-flashinfer-autotune)
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
          --concurrency "${SOAK_CONCURRENCY:-64}" \
          ${SOAK_PROMPT_LENS:+--prompt-lens "$SOAK_PROMPT_LENS"} \
          --out "$work/soak-$name.json"
      ) > "$work/soak-$name.log" 2>&1
    }
    soak_one pcp1 8301 reference 2 &
    results=()
    for config in ${SOAK_CONFIGS:-pcp2 pcp2-dcp2}; do
      case $config in
        pcp2) soak_one pcp2 8302 soak 8 & ;;
        pcp2-dcp2) soak_one pcp2-dcp2 8303 soak 8 & ;;
      esac
      results+=("$work/soak-$config.json")
    done
    wait
    python3 "$here/serve_soak.py" merge "${results[@]}" --out "$work/serve-soak.json" \
      --command "scripts/run_gpu_checks.sh soak (serve_soak.py reference at -pcp 1, soak at ${SOAK_CONFIGS:-pcp2 pcp2-dcp2})"
    rc=$?
    cp "$work/serve-soak.json" "$out/serve-soak.json"
    exit "$rc" ;;
  faults)  # -pcp 1 answers the bad requests the others are held to; a dead rank last
    share_gpus
    model=${MODEL_FAULTS:-/tmp/models/qwen2.5-coder-0.5b}
    # 512 tokens a step: the dead rank's 30,000-token prompt prefills over 59 steps
    faults_flags=(--gpu-memory-utilization 0.05 --kv-cache-memory-bytes $((4 << 30)) --seed 0
                  --no-enable-flashinfer-autotune
                  --max-model-len 32768 --max-num-seqs 16 --max-num-batched-tokens 512
                  --enable-log-requests)
    faults_one() {  # NAME PORT LAYOUT: bad requests, then (not pcp1) a dead rank
      local name=$1 port=$2 layout
      ( . "$here/serve_lib.sh"
        layout_flags layout "$3" || exit
        layout_env env "$3"
        [ ${#env[@]} -eq 0 ] || export "${env[@]}"
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
    # on the V1 runner the plugin runs (vLLM 0.26.0 runs V2 at PCP = 1, which draws a seeded
    # request's random numbers otherwise): the seeded n > max_num_seqs case is held to it
    faults_one pcp1 8401 pcp1-v1 &
    results=("$work/faults-pcp1.json")
    for config in ${FAULTS_CONFIGS:-pcp2 pcp2-dcp2}; do
      case $config in  # every prompt split, the 1-token one too
        pcp2) faults_one pcp2 8402 pcp2-split-all & ;;
        pcp2-dcp2) faults_one pcp2-dcp2 8403 pcp2-dcp2-split-all & ;;
      esac
      results+=("$work/faults-$config.json" "$work/dead-rank-$config.json")
    done
    wait
    python3 "$here/serve_faults.py" merge "${results[@]}" --out "$work/serve-faults.json" \
      --command "scripts/run_gpu_checks.sh faults (serve_faults.py requests against -pcp 1 on the V1 runner and ${FAULTS_CONFIGS:-pcp2 pcp2-dcp2}, every prompt split; serve_faults.py dead-rank on the latter)"
    rc=$?
    cp "$work/serve-faults.json" "$out/serve-faults.json"
    exit "$rc" ;;
  *) echo "unknown stage $stage" >&2; trap - EXIT; exit 2 ;;
esac
