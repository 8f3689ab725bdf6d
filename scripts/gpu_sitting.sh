#!/usr/bin/env bash
# A whole GPU sitting as one background job, so that no stage waits on a call boundary
# and none is cut by the 10-minute limit of one device command.
#
#   setsid nohup bash scripts/gpu_sitting.sh start > /tmp/sitting.log 2>&1 < /dev/null &
#   bash scripts/gpu_sitting.sh snapshot OUT_DIR     # later calls: progress + files so far
#   bash scripts/gpu_sitting.sh jit OUT_DIR          # FlashInfer's compiled kernels, in parts
#   bash scripts/gpu_sitting.sh restore-jit DIR      # next host: unpack them before the start
#
# Order: kernels, bench (the GPUs to itself: it times), then exact-dcp and serve side by
# side (neither times anything). Each stage of scripts/run_gpu_checks.sh keeps its work
# files in /tmp/gpu-checks/STAGE; a snapshot packs all of them (profiler traces left out)
# into OUT_DIR/snapshot.tgz and prints the progress log. STAGES overrides the order
# (default "kernels bench exact-dcp+serve"; "a+b" runs a and b at once).
#
# A fresh host spends about 4 minutes compiling FlashInfer's kernels; `jit` packs the ones
# this host compiled (~/.cache/flashinfer) into OUT_DIR/jit/part-NN of 15 MiB (the device
# returns files of at most 16 MiB), `restore-jit` unpacks such parts on the next host.
set -uo pipefail
here=$(cd "$(dirname "$0")" && pwd)
root=${GPU_CHECKS_DIR:-/tmp/gpu-checks}
progress=$root/progress.log
mkdir -p "$root/tgz"

stage() {
  echo "$(date +%T) start $1" >> "$progress"
  bash "$here/run_gpu_checks.sh" "$1" "$root/tgz" > "$root/$1.out" 2>&1
  local rc=$?
  echo "$(date +%T) end $1 rc=$rc" >> "$progress"
}

case "${1:-}" in
  start)
    for step in ${STAGES:-kernels bench exact-dcp+serve}; do
      for s in ${step//+/ }; do stage "$s" & done
      wait
    done
    echo "$(date +%T) done" >> "$progress" ;;
  snapshot)
    mkdir -p "$2"
    tar czf "$2/snapshot.tgz" --exclude='*.pt.trace.json*' --exclude=tgz \
      -C "$(dirname "$root")" "$(basename "$root")"
    cat "$progress" ;;
  jit)
    mkdir -p "$2/jit"
    tar czf - -C "$HOME/.cache" flashinfer | split -b 15M -d - "$2/jit/part-"
    du -sh "$HOME/.cache/flashinfer" "$2/jit" ;;
  restore-jit)
    mkdir -p "$HOME/.cache"
    cat "$2"/part-* | tar xzf - -C "$HOME/.cache" ;;
  *) echo "usage: $0 start | snapshot OUT_DIR | jit OUT_DIR | restore-jit DIR" >&2; exit 2 ;;
esac
