#!/usr/bin/env bash
# `vllm bench serve` against `vllm serve`: random long prompts at concurrency 4 and 16.
#
#   scripts/bench_serve.sh MODEL TOKENIZER OUT_DIR NAME [vllm serve flags ...]
#   scripts/bench_serve.sh /tmp/bench-models/qwen2.5-3b-shape /tmp/models/qwen2.5-coder-0.5b \
#       /tmp/serve pcp2 --load-format dummy --prefill-context-parallel-size 2
#
# Writes OUT_DIR/NAME-c4.json and OUT_DIR/NAME-c16.json (vllm bench serve's result files,
# TTFT/TPOT/ITL p50/p90/p99). INPUT_LEN (default 32768), OUTPUT_LEN (128) and PROMPTS (32)
# override the workload. Each concurrency draws its own prompts (seed = concurrency): the
# same prompts twice would be served from the prefix cache the first run filled.
# scripts/bench_pcp.py report --serve-dir OUT_DIR collects them.
set -euo pipefail
model=$1 tokenizer=$2 out=$3 name=$4; shift 4
port=${PORT:-8124}
mkdir -p "$out"
. "$(dirname "$0")/serve_lib.sh"
serve_until_healthy "$port" "$out/$name-server.log" 900 "$model" --tokenizer "$tokenizer" \
    --seed 0 --max-model-len $(( ${INPUT_LEN:-32768} + ${OUTPUT_LEN:-128} + 64 )) \
    --attention-backend FLASHINFER "$@"
for conc in 4 16; do
  vllm_cli bench serve --backend vllm --base-url "http://127.0.0.1:$port" --model "$model" \
      --tokenizer "$tokenizer" --dataset-name random --random-input-len "${INPUT_LEN:-32768}" \
      --random-output-len "${OUTPUT_LEN:-128}" --num-prompts "${PROMPTS:-32}" \
      --max-concurrency "$conc" --seed "$conc" --ignore-eos --percentile-metrics ttft,tpot,itl \
      --metric-percentiles 50,90,99 --save-result --result-dir "$out" \
      --result-filename "$name-c$conc.json"
done
