#!/usr/bin/env bash
# The GPU checks and benchmarks, one stage per call (each well under 10 minutes on 2 x H200).
#
#   scripts/run_gpu_checks.sh STAGE OUT_DIR
#
# Stages, in the order worth running them:
#   kernels      pytest tests/gpu (FlashInfer kernels as driven here vs the reference)
#   exact-pcp    PCP=2 vs PCP=1 on FlashInfer, random models, both chunking variants
#   exact-real   the same on SmolLM2 (/tmp/models/smollm2-135m)
#   exact-more   CUDA graphs, Ray, and PCP x DCP (interleave 1, 8, 16; 256 tokens)
#   serve-chat   vllm serve chat completion at PCP=1 and PCP=2
#   bench-a      TTFT/ITL: pcp1-stock, pcp1      bench-b   TTFT/ITL: pcp2, tp2
#   gsm8k        lm-eval gsm8k at PCP=1, PCP=2 (MODEL_GSM8K; DATA_GSM8K: a folder with
#                train.jsonl and test.jsonl, default .gpu/gsm8k of the checkout)
# Raw results land in OUT_DIR; scripts/check_exactness.py compare and
# scripts/bench_pcp.py report turn them into the committed result files.
set -euo pipefail
stage=$1 out=$2
here=$(cd "$(dirname "$0")" && pwd)
mkdir -p "$out"
export PYTHONUNBUFFERED=1
ex() { python3 "$here/check_exactness.py" "$@"; }
random_models=qwen2.5-3b-shape,llama-8kv-hd64,qwen2-mqa-1kv
case "$stage" in
  kernels)    python3 -m pytest -q "$here/../tests/gpu" 2>&1 | tee "$out/kernels.log" ;;
  exact-pcp)  ex models --out-dir /tmp/pcp-models --layers 4
              ex run --models "$random_models" --variants unchunked,chunked --configs pcp1,pcp2 \
                 --overlap --gpu-memory-utilization 0.4 --raw "$out/raw-pcp.json" ;;
  exact-real) ex run --models smollm2 --variants unchunked,chunked --configs pcp1,pcp2 \
                 --overlap --gpu-memory-utilization 0.4 --raw "$out/raw-real.json" ;;
  exact-more) ex models --out-dir /tmp/pcp-models --layers 4
              ex run --models qwen2.5-3b-shape --variants chunked \
                 --configs pcp1-graphs,pcp2-graphs,pcp1,pcp2-ray --raw "$out/raw-more.json"
              ex run --models qwen2-mqa-1kv,qwen2.5-3b-shape --variants chunked --max-tokens 256 \
                 --configs pcp1,pcp2,pcp2-dcp2-i1,pcp2-dcp2-i8,pcp2-dcp2-i16 \
                 --raw "$out/raw-dcp.json" ;;
  serve-chat) python3 "$here/check_serve_chat.py" --model "${MODELS_REAL:-/tmp/models/smollm2-135m}" \
                 --git-rev "${GIT_REV:-unknown}" --out "$out/serve-chat-pcp.json" --log-dir "$out" ;;
  bench-a)    python3 "$here/bench_pcp.py" run --configs pcp1-stock,pcp1 --raw "$out/bench-a.json" ;;
  bench-b)    python3 "$here/bench_pcp.py" run --configs pcp2,tp2 --raw "$out/bench-b.json" ;;
  gsm8k)      for pcp in 1 2; do
                "$here/eval_gsm8k.sh" "${MODEL_GSM8K:-/tmp/models/qwen2.5-coder-0.5b}" \
                  "${DATA_GSM8K:-$here/../.gpu/gsm8k}" "$out/gsm8k-pcp$pcp.json" \
                  --prefill-context-parallel-size "$pcp" --attention-backend FLASHINFER
              done ;;
  *) echo "unknown stage $stage" >&2; exit 2 ;;
esac
