#!/usr/bin/env bash
# A whole GPU sitting as one background job, so that no stage waits on a call boundary
# and none is cut by the 10-minute limit of one device command.
#
#   bash scripts/gpu_sitting.sh stash                # every transfer: keep what it carried
#   setsid nohup bash scripts/gpu_sitting.sh setup MODEL... > /dev/null 2>&1 < /dev/null &
#   setsid nohup bash scripts/gpu_sitting.sh start > /tmp/sitting.log 2>&1 < /dev/null &
#   bash scripts/gpu_sitting.sh snapshot OUT_DIR     # later calls: progress + files so far
#   bash scripts/gpu_sitting.sh watch OUT_DIR [SECS] # or: a snapshot every WATCH_EVERY_S
#   bash scripts/gpu_sitting.sh jit OUT_DIR          # FlashInfer's compiled kernels, in parts
#   bash scripts/gpu_sitting.sh restore-jit DIR      # next host: unpack them before the start
#
# On the offline host files arrive in transfers of at most 64 MiB, and a path carried in one
# is gone from the project folder in the next. `stash` keeps each transfer's files in $STASH
# (default /tmp): the bundle's parts (.gpu/install.sh), the model parts (.gpu/models/
# prepare.sh), .gpu/jit, .gpu/gsm8k and .gpu/extra. `setup` runs once the bundle is complete,
# detached (setsid: a plain background job dies with its device call): it installs the bundle
# and a copy of the project, the extra wheels, the FlashInfer kernels of .gpu/jit, then builds
# each MODEL as soon as its parts have all arrived (SETUP_WAIT_S, default 900). `start` waits
# for a setup in progress to end. Both log to the progress log.
#
# Order: kernels, bench (the GPUs to itself: it times), then exact-dcp and serve side by
# side (neither times anything). Each stage of scripts/run_gpu_checks.sh keeps its work
# files in /tmp/gpu-checks/STAGE; a snapshot packs all of them (profiler traces left out)
# into OUT_DIR/snapshot.tgz and prints the progress log. STAGES overrides the order
# (default "kernels bench exact-dcp+serve"; "a+b" runs a and b at once). `start` first logs
# the variables that chose the sitting's stages and configurations.
#
# `watch` keeps OUT_DIR/snapshot.tgz fresh (each one replaces the last whole, so a call cut at
# its time limit still returns the newest) until the sitting's last line `done` or SECS (540)
# have passed; on a host without a sitting (a fresh one: the last was given back) it says so
# and ends at once (rc 3) instead of waiting out the call.
#
# A fresh host spends about 4 minutes compiling FlashInfer's kernels; `jit` packs the ones
# this host compiled (~/.cache/flashinfer) into OUT_DIR/jit/part-NN of 15 MiB (the device
# returns files of at most 16 MiB), `restore-jit` unpacks such parts on the next host.
set -uo pipefail
here=$(cd "$(dirname "$0")" && pwd)
root=${GPU_CHECKS_DIR:-/tmp/gpu-checks}
progress=$root/progress.log
stash=${STASH:-/tmp}
mkdir -p "$root/tgz"

log() { echo "$(date +%T) $*" >> "$progress"; }

use_site() {  # the bundle `setup` installs
  if [ -d "$stash/site" ]; then export PYTHONPATH=$stash/site${PYTHONPATH:+:$PYTHONPATH}; fi
  export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
}

stage() {
  log "start $1"
  bash "$here/run_gpu_checks.sh" "$1" "$root/tgz" > "$root/$1.out" 2>&1
  log "end $1 rc=$?"
}

run_stashed() {  # NAME ARGS: .gpu/models/NAME or .gpu/NAME as carried now, else its stashed copy
  local name=$1; shift
  for f in ".gpu/$name" ".gpu/models/$name" "$stash/gpu-stage/$name" "$stash/model-stage/$name"; do
    [ -f "$f" ] && { bash "$f" "$@"; return; }
  done
  echo "$name: not carried yet" >&2; return 127
}

restore_jit() {  # DIR: unpack the part-NN of `jit` into ~/.cache
  mkdir -p "$HOME/.cache"
  cat "$1"/part-* | tar xzf - -C "$HOME/.cache"
}

setup() {  # MODEL...: install, then each model once its parts are in
  trap 'log "setup done"' EXIT  # also after a failure: start waits for this line
  log "setup start"
  rm -rf "$stash/pcp-src" && mkdir -p "$stash/pcp-src"
  tar cf - --exclude=./.gpu . | tar xf - -C "$stash/pcp-src"
  cd "$stash/pcp-src" || return  # the project folder changes with every device call
  run_stashed install.sh --install > "$root/setup-install.log" 2>&1
  log "setup install rc=$? $(tail -n 1 "$root/setup-install.log")"
  use_site
  if ls "$stash"/extra/*.whl > /dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --target "$stash/site" "$stash"/extra/*.whl
  fi
  if ls "$stash"/jit/part-* > /dev/null 2>&1; then restore_jit "$stash/jit"; fi
  for model in "$@"; do
    local waited=0 listing
    # the listing is read whole first: `prepare.sh | grep -q` fails under pipefail when grep
    # stops at a line before the last (SIGPIPE), and the wait then never ends
    until listing=$(run_stashed prepare.sh 2> /dev/null)
          grep -q "^$model: \([0-9]\+\) of \1 parts$" <<< "$listing"; do
      [ "$waited" -ge "${SETUP_WAIT_S:-900}" ] && break
      sleep 2; waited=$((waited + 2))
    done
    run_stashed prepare.sh --build "$model" > "$root/setup-$model.log" 2>&1
    log "setup model $model rc=$?"
  done
}

snapshot_to() {  # DIR: the work files so far, replacing DIR/snapshot.tgz whole
  mkdir -p "$1"
  tar czf "$1/snapshot.part" --exclude='*.pt.trace.json*' --exclude=tgz \
    -C "$(dirname "$root")" "$(basename "$root")" && mv "$1/snapshot.part" "$1/snapshot.tgz"
}

watch() {  # OUT_DIR [SECS]
  # SECONDS counts whole seconds of the wall clock: one more keeps at least SECS
  local end=$((SECONDS + ${2:-540} + 1)) every=${WATCH_EVERY_S:-30}
  while :; do
    grep -q . "$progress" 2>/dev/null ||
      { echo "watch: no sitting on this host (empty $progress): a fresh host?"; return 3; }
    snapshot_to "$1"
    grep -q "^[0-9:]* done$" "$progress" && break  # the sitting's end, not "setup done"
    [ "$SECONDS" -ge "$end" ] && break
    sleep "$(( end - SECONDS < every ? end - SECONDS : every ))"
  done
  cat "$progress"
}

case "${1:-}" in
  stash)
    run_stashed install.sh > /dev/null 2>&1
    run_stashed prepare.sh 2> /dev/null
    for d in jit gsm8k extra; do
      if [ -d ".gpu/$d" ]; then mkdir -p "$stash/$d" && cp -r ".gpu/$d/." "$stash/$d/"; fi
    done
    echo "bundle parts: $(ls "$stash/gpu-stage" 2>/dev/null | grep -c '^part')" ;;
  setup)
    shift; setup "$@" ;;
  start)
    while grep -q "setup start" "$progress" 2>/dev/null && ! grep -q "setup done" "$progress"
    do sleep 2; done
    use_site
    log "sitting $(env | grep -E '^(GIT_REV|STAGES|BENCH_|SERVE_|DCP_|TP_DCP_|GSM8K_|MODEL_|MODELS_|DATA_GSM8K|INPUT_LEN|PROMPTS)' | sort | tr '\n' ' ')"
    for step in ${STAGES:-kernels bench exact-dcp+serve}; do
      for s in ${step//+/ }; do stage "$s" & done
      wait
    done
    log done ;;
  snapshot)
    snapshot_to "$2"; cat "$progress" ;;
  watch)
    shift; watch "$@" ;;
  jit)
    mkdir -p "$2/jit"
    tar czf - -C "$HOME/.cache" flashinfer | split -b 15M -d - "$2/jit/part-"
    du -sh "$HOME/.cache/flashinfer" "$2/jit" ;;
  restore-jit)
    restore_jit "$2" ;;
  *) echo "usage: $0 stash | setup MODEL... | start | snapshot OUT_DIR |" \
          "watch OUT_DIR [SECS] | jit OUT_DIR | restore-jit DIR" >&2; exit 2 ;;
esac
