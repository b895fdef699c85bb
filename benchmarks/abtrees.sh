#!/usr/bin/env bash
# Package trees for a same-call A/B on the GPU machine (`gpu_run.sh ab:TYPE` with AB_TREES="NAME ..."):
#   benchmarks/abtrees.sh NAME=REF [NAME=REF ...]        e.g. base=main var=wip-prologues
# writes abtree/NAME/moerun from git ref REF (abtree/ is git-excluded; carry it: run(..., carry=[".whl", "abtree"])).
# A variant's tweak goes on top afterwards, e.g. a tile: echo 'TYPE_WTILES[("gate_up", Q4_K)] = WTile(4, 4)' \
#   >> abtree/r4/moerun/kernels/triton/wmatvec.py
set -euo pipefail
cd "$(dirname "$0")/.."
grep -qx "/abtree/\|abtree" .git/info/exclude 2>/dev/null || echo "abtree" >> .git/info/exclude
for spec in "$@"; do
  name=${spec%%=*} ref=${spec#*=}
  [ "$name" != "$spec" ] || { echo "want NAME=REF, got $spec" >&2; exit 2; }
  rm -rf "abtree/$name" && mkdir -p "abtree/$name"
  git archive "$ref" moerun | tar -x -C "abtree/$name"
  echo "abtree/$name: $(git rev-parse --short "$ref") ($ref)"
done
