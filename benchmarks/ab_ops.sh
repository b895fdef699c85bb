#!/usr/bin/env bash
# Same-call A/B of decode ops on one synthesized OLMoE file (device machine): eager profiles, then tg128 alternating.
#   OUT=... bash benchmarks/ab_ops.sh TYPE OPS_A OPS_B [DEPTHS]
set -uo pipefail
cd "$(dirname "$0")/.."
t=$1 a=$2 b=$3 depths=${4:-0}; f=/tmp/olmoe-1b-7b-$t.gguf; OUT=${OUT:-/tmp/moerun-out}; mkdir -p "$OUT"
[ -f "$f" ] || timeout 300 python3 -m moerun synth --preset olmoe-1b-7b --type "$t" -o "$f" --no-progress 2>&1 | tail -1
for ops in "$a" "$b"; do
  echo "--- profile $ops"
  timeout 200 python3 benchmarks/profile_decode.py "$f" --decode eager --ops "$ops" 2>&1 | grep -v "loading to" \
    | head -${PROFILE_LINES:-24}
done
for ops in "$a" "$b" "$a" "$b"; do
  echo "--- tg $ops"
  timeout 300 python3 -m moerun bench -m "$f" -p 0 -n 128 -r 5 -d "$depths" --ops "$ops" \
    --output-file "$OUT/bench-olmoe-1b-7b-$t-$ops.json" 2>&1 | grep -v "loading to"
done
