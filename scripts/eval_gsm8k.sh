#!/usr/bin/env bash
# gsm8k (5-shot, all 1,319 test questions) through lm-eval's local-completions against `vllm serve`.
#
#   scripts/eval_gsm8k.sh MODEL DATA_DIR OUT_JSON [vllm serve flags ...]
#   scripts/eval_gsm8k.sh /tmp/models/qwen2.5-coder-0.5b path/to/gsm8k gsm8k-pcp2.json \
#       --prefill-context-parallel-size 2 --attention-backend FLASHINFER
#
# Starts the server with the given flags, waits for /health, runs lm-eval, writes lm-eval's
# results JSON to OUT_JSON and stops the server. LIMIT=N evaluates the first N questions only.
set -euo pipefail
model=$1 data=$(cd "$2" && pwd) out=$3; shift 3
here=$(cd "$(dirname "$0")/.." && pwd)
port=${PORT:-8123}
work=$(mktemp -d)
sed "s#@DATA_DIR@#$data#g" "$here/configs/lm_eval/gsm8k_local.yaml" > "$work/gsm8k_local.yaml"

. "$here/scripts/serve_lib.sh"
serve_until_healthy "$port" "$work/server.log" 600 "$model" --seed 0 "$@"

python3 -m lm_eval --model local-completions \
    --model_args "model=$model,base_url=http://127.0.0.1:$port/v1/completions,num_concurrent=64,max_retries=3,tokenized_requests=False,tokenizer_backend=huggingface,tokenizer=$model" \
    --tasks gsm8k_local --include_path "$work" --num_fewshot 5 --batch_size 1 \
    ${LIMIT:+--limit "$LIMIT"} --output_path "$work/results"
python3 - "$work/results" "$out" <<'PY'
import glob, json, sys
path = sorted(glob.glob(f"{sys.argv[1]}/**/results_*.json", recursive=True))[-1]
res = json.load(open(path))["results"]["gsm8k_local"]
json.dump({"exact_match_strict": res["exact_match,strict-match"],
           "exact_match_flexible": res["exact_match,flexible-extract"],
           "lm_eval_results": res}, open(sys.argv[2], "w"), indent=1)
print(open(sys.argv[2]).read())
PY
