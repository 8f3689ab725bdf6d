# Sourced by the scripts that drive `vllm serve` (eval_gsm8k.sh, bench_serve.sh).

VLLM_CLI=(python3 -c "from vllm.entrypoints.cli.main import main; main()")
vllm_cli() { "${VLLM_CLI[@]}" "$@"; }

# serve_until_healthy PORT LOG WAIT_S MODEL [vllm serve flags ...]
# Starts `vllm serve MODEL --port PORT flags` in the background with its output in LOG,
# stops it when the calling script exits, and returns once /health answers (or after
# WAIT_S seconds); exits 1 with the log's tail if the server dies first.
serve_until_healthy() {
  local port=$1 log=$2 wait_s=$3 model=$4; shift 4
  # A plain command, not the vllm_cli function: $! is then the server itself (a
  # function would run in a subshell whose death leaves the server running).
  "${VLLM_CLI[@]}" serve "$model" --port "$port" "$@" > "$log" 2>&1 &
  server=$!
  trap 'kill $server 2>/dev/null; wait $server 2>/dev/null || true' EXIT
  for _ in $(seq "$wait_s"); do
    python3 -c "import urllib.request as u; u.urlopen('http://127.0.0.1:$port/health', timeout=2)" \
        2>/dev/null && return 0
    kill -0 $server 2>/dev/null || { tail -40 "$log"; exit 1; }
    sleep 1
  done
}
