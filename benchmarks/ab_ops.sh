#!/usr/bin/env bash
# Same-call A/B of decode ops on one synthesized OLMoE file (device machine): eager profiles, then tg128 of each
# ops in turn, twice (A B C A B C), so drift between runs shows.
#   OUT=... [DEPTHS=0,4096] [PROFILE_LINES=24] [NO_PROFILE=1 | PROFILE_OPS="A B"] bash benchmarks/ab_ops.sh TYPE OPS...
# The synthesized file stays in /tmp for the next call on a warm machine (delete it when done).
# OPS: any --ops name, e.g. triton, triton-words, triton+FEATURE (moerun/kernels/ops.py); OPS:step
# times tg with `--tg-loop step` (the host waits for each token) instead of the default stream loop.
set -uo pipefail
cd "$(dirname "$0")/.."
t=$1; shift; f=/tmp/olmoe-1b-7b-$t.gguf; OUT=${OUT:-/tmp/moerun-out}; mkdir -p "$OUT"
[ -f "$f" ] || timeout 300 python3 -m moerun synth --preset olmoe-1b-7b --type "$t" -o "$f" --no-progress 2>&1 | tail -1
if [ -z "${NO_PROFILE:-}" ]; then
  for ops in ${PROFILE_OPS:-"$@"}; do
    [[ $ops == *:step ]] && continue  # the same kernels as without :step
    echo "--- profile $ops"
    timeout 200 python3 benchmarks/profile_decode.py "$f" --decode eager --ops "$ops" 2>&1 | grep -v "loading to" \
      | head -"${PROFILE_LINES:-24}"
  done
fi
for run in $(seq "${RUNS:-2}"); do
  for v in "$@"; do
    ops=${v%:step} loop=stream; [[ $v == *:step ]] && loop=step
    echo "--- tg $v (run $run)"
    timeout 300 python3 -m moerun bench -m "$f" -p 0 -n 128 -r 5 -d "${DEPTHS:-0}" --ops "$ops" --tg-loop $loop \
      --output-file "$OUT/bench-olmoe-1b-7b-$t-${ops//+/_}-$loop-$run.json" 2>&1 | grep -v "loading to"
  done
done
