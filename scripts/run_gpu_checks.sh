#!/usr/bin/env bash
# The GPU checks and benchmarks of one sitting on 2 x H200, one stage per call (each under
# 10 minutes once FlashInfer's kernels are compiled).
#
#   scripts/run_gpu_checks.sh STAGE OUT_DIR
#
# Stages, in the order worth running them:
#   exact     the exactness matrix, engines in parallel lanes on a fixed KV pool each:
#             kernel tests (pytest tests/gpu); PCP=2 vs PCP=1 on the random models and
#             SmolLM2 (/tmp/models/smollm2-135m), chunked prefill on and off; CUDA graphs
#             and Ray; PCP x DCP at interleave 1, 8, 16 with 256 greedy tokens
#   bench     TTFT/ITL of pcp1-stock and pcp1 (one per GPU, at once), then pcp2, tp2,
#             pcp2-dcp2 (GPUs to themselves; also records each KV pool in tokens)
#   serve     vllm serve chat at PCP=1 and PCP=2, and gsm8k through lm-eval at PCP=1,
#             PCP=2 and PCP=2 x DCP=2 (MODEL_GSM8K; DATA_GSM8K: a folder with train.jsonl and
#             test.jsonl, default .gpu/gsm8k of the checkout), servers side by side
# Raw results land in OUT_DIR; scripts/check_exactness.py compare and
# scripts/bench_pcp.py report turn them into the committed result files.
set -uo pipefail
stage=$1 out=$2
here=$(cd "$(dirname "$0")" && pwd)
mkdir -p "$out"
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1
ex() { python3 "$here/check_exactness.py" "$@"; }
lanes() { ex run --overlap --kv-cache-gib 2 --gpu-memory-utilization 0.05 "$@"; }
random_models=qwen2.5-3b-shape,llama-8kv-hd64,qwen2-mqa-1kv
dcp_configs=pcp1,pcp2-dcp2-i1,pcp2-dcp2-i8,pcp2-dcp2-i16
case "$stage" in
  exact)
    ex models --out-dir /tmp/pcp-models --layers 4 > "$out/models.log" 2>&1
    python3 -m pytest -q "$here/../tests/gpu" > "$out/kernels.log" 2>&1 &
    lanes --lanes 2 --models "$random_models,smollm2" --variants unchunked,chunked \
      --configs pcp1,pcp2 --raw "$out/raw-pcp.json" > "$out/pcp.log" 2>&1 &
    lanes --lanes 4 --one-gpu-lanes 2 --models "$random_models,smollm2" --variants chunked \
      --max-tokens 256 \
      --configs "$dcp_configs" --raw "$out/raw-dcp.json" > "$out/dcp.log" 2>&1 &
    lanes --lanes 1 --models qwen2.5-3b-shape --variants unchunked --max-tokens 256 \
      --configs pcp1,pcp2-dcp2-i8 --raw "$out/raw-dcp-unchunked.json" > "$out/dcp-u.log" 2>&1 &
    lanes --lanes 1 --models qwen2.5-3b-shape --variants chunked \
      --configs pcp1-graphs,pcp2-graphs,pcp2-ray --raw "$out/raw-more.json" > "$out/more.log" 2>&1 &
    wait ;;
  bench)
    python3 "$here/bench_pcp.py" run --eager --parallel-one-gpu \
      --configs pcp1-stock,pcp1,pcp2,tp2,pcp2-dcp2 --raw "$out/bench.json" ;;
  serve)
    python3 "$here/check_serve_chat.py" --model "${MODELS_REAL:-/tmp/models/smollm2-135m}" \
      --git-rev "${GIT_REV:-unknown}" --out "$out/serve-chat-pcp.json" --log-dir "$out" &
    flags=(--enforce-eager --gpu-memory-utilization 0.1 --kv-cache-memory-bytes $((8 << 30))
           --attention-backend FLASHINFER)
    gsm8k() {  # NAME PORT PCP [more vllm serve flags]
      local name=$1 port=$2; shift 2
      PORT=$port "$here/eval_gsm8k.sh" "${MODEL_GSM8K:-/tmp/models/qwen2.5-coder-0.5b}" \
        "${DATA_GSM8K:-$here/../.gpu/gsm8k}" "$out/gsm8k-$name.json" "${flags[@]}" \
        --prefill-context-parallel-size "$@" > "$out/gsm8k-$name.log" 2>&1
    }
    gsm8k pcp1 8201 1 &
    gsm8k pcp2 8202 2 &
    gsm8k pcp2-dcp2 8203 2 --decode-context-parallel-size 2 \
      --additional-config '{"pcp_unverified_dcp": true}' &
    wait ;;
  *) echo "unknown stage $stage" >&2; exit 2 ;;
esac
