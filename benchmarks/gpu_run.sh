#!/usr/bin/env bash
# One device call on the GPU machine: set up, then run the named stages, logging each to $OUT.
#   benchmarks/gpu_run.sh kernels micro olmoe:q4_k_m tests
# Stages: kernels (Triton kernel + dequant tests on CUDA), micro (kernel micro-benchmarks),
#   olmoe:TYPE (synthesize the full-size OLMoE file, profile and bench reference vs fast decode),
#   tests (model and fast-decode tests with CUDA tensors), qwen3:TYPE (bench Qwen3-30B-A3B),
#   prefill:TYPE (prefill variants, profile, pp512/pp4096/tg128 of OLMoE), prefilltests (GEMM + prefill tests),
#   qgemmtests (GEMM kernel tests only), words:TYPE (word-kernel tests, micro-benchmark, profile and tg128 of
#   OLMoE with the word kernels vs the byte kernels, fast-decode tests), decodetests (decode kernels + steps),
#   pad:TYPE (Q6_K output on a padded copy vs the file's rows: tests, micro, profiles and tg128 of OLMoE),
#   ab:TYPE (tg128 of package trees abtree/NAME, NAME in AB_TREES, alternating; the synthesized file is kept),
#   ncu:TYPE (Nsight Compute counters of one eager OLMoE decode step, per kernel: benchmarks/ncu_step.py),
#   sanitize:TOOL (compute-sanitizer memcheck / racecheck / synccheck over tiny models' eager decode steps),
#   sanitizetest:TOOL:EXPR (compute-sanitizer TOOL over the CUDA kernel tests tests/kernels -k EXPR),
#   abops:TYPE:OPS,OPS,... (benchmarks/ab_ops.sh: same-call A/B of decode ops variants on synthesized OLMoE TYPE,
#   the file kept for the next call; rm:TYPE deletes it),
#   ab1:TYPE:OPS,OPS,... (the same in one process: `moerun bench --ops A,B --rounds $ROUNDS`, the summary table;
#   with AB1_TREE=NAME (export:AB1_TREE=old) the package in abtree/NAME runs it, e.g. an older commit's features),
#   llamacpp:build / llamacpp:TYPE[:DEPTHS] (llama.cpp's llama-bench beside moerun bench: benchmarks/llamacpp.sh),
#   sweepab:TYPE:KIND[:N] (sweep:TYPE of one KIND, then ab1 of the default and its N fastest other tiles),
#   attnab:TYPE[:N] (the attention micro, then ab1 of the default and the N long-phase features whose launch as the
#   step makes it, `step us`, is fastest in it),
#   export:VAR=VALUE / unset:VAR (environment of the later stages), pytest:EXPR (tests/kernels -k EXPR).
# Prefix the call with MOERUN_COMMIT=<this tree's git hash>: the device copy's .git may be stale (the bench
# JSON also records `source_sha`, a hash of the package's .py files, whatever git says).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/moerun-out}; mkdir -p "$OUT"
LOG="$OUT/log.txt"  # every stage's text output, one file (the device returns at most 8 files)
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl >/dev/null 2>&1
export PYTHONPATH=$PWD:/tmp/site PYTHONUNBUFFERED=1 MOERUN_CACHE=/tmp/moerun-cache
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$OUT/gpu.txt"
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" | tee -a "$OUT/gpu.txt"

bench() {  # bench FILE TAG ARGS...
  local f=$1 tag=$2; shift 2
  timeout 300 python3 -m moerun bench -m "$f" "$@" --output-file "$OUT/bench-$tag.json" 2>&1 | grep -v "loading to" \
    | tee -a "$LOG"
}

ab() {  # ab TYPE OPS_A TAG_A OPS_B TAG_B: synthesize OLMoE, eager profiles and tg128 of two sets of decode ops
  local t=$1 f=/tmp/olmoe-1b-7b-$1.gguf ops
  timeout 300 python3 -m moerun synth --preset olmoe-1b-7b --type "$t" -o "$f" --no-progress --force 2>&1 | tail -1
  for ops in "$2" "$4"; do
    timeout 200 python3 benchmarks/profile_decode.py "$f" --decode eager --ops "$ops" 2>&1 | grep -v "loading to" \
      | head -18 | tee -a "$LOG"
  done
  bench "$f" "olmoe-1b-7b-$t-$3" -p 0 -n 128 -r 5 -d 0,4096 --ops "$2"
  bench "$f" "olmoe-1b-7b-$t-$5" -p 0 -n 128 -r 5 -d 0,4096 --ops "$4"
  rm -f "$f"
}

for stage in "$@"; do
  echo "=== $stage $(date +%T)"
  case $stage in
    export:*) export "${stage#*:}" ;;  # export:VAR=VALUE for the stages after it
    unset:*) unset "${stage#*:}" ;;
    pytest:*) timeout 420 python3 -m pytest -q -x tests/kernels -k "${stage#*:}" 2>&1 | tail -3 | tee -a "$LOG" ;;
    kernels) timeout 420 python3 -m pytest -q -x tests/kernels tests/quant 2>&1 | tail -5 | tee -a "$LOG" ;;
    micro) timeout 240 python3 benchmarks/bench_qmatvec.py 2>&1 | tee -a "$LOG" ;;
    micro:*) timeout 300 python3 benchmarks/bench_qmatvec.py --types "${stage#*:}" ${ITILES:+--wtiles "" --itiles "$ITILES"} \
        ${KINDS:+--kinds "$KINDS"} ${AHEAD:+--ahead "$AHEAD"} 2>&1 | tee -a "$LOG" ;;  # ITILES: the integer kernels'
        # tiles only (bench_qmatvec.py --itiles); KINDS: of mv,gate_up,down,out; AHEAD: down's experts_ahead values
    sweep:*) timeout 420 python3 benchmarks/bench_qmatvec.py --types "${stage#*:}" --sweep ${KINDS:+--kinds "$KINDS"} --wtiles "" \
        ${BMS:+--bms "$BMS"} ${STEPS:+--steps "$STEPS"} \
        --json "$OUT/sweep-${stage#*:}.json" 2>&1 | tee -a "$LOG" ;;
    sweepab:*)  # sweepab:TYPE:KIND[:N]: sweep the F32 / F16 / BF16 byte kernels' KIND tiles (BMS / STEPS narrow it),
      # then time the default and the N (3) fastest other tiles in the whole step (ab1: DEPTHS, ROUNDS; the file stays)
      spec=${stage#*:}; t=${spec%%:*}; rest=${spec#*:}; kind=${rest%%:*}; n=${rest#*:}; [ "$n" = "$rest" ] && n=3
      timeout 420 python3 benchmarks/bench_qmatvec.py --types "$t" --sweep --kinds "$kind" --wtiles "" \
        ${BMS:+--bms "$BMS"} ${STEPS:+--steps "$STEPS"} --json "$OUT/sweep-$t-$kind.json" 2>&1 | tee -a "$LOG"
      ops=$(python3 benchmarks/sweep_ops.py "$OUT/sweep-$t-$kind.json" --kind "$kind" --top "$n" 2>&1) \
        && OUT=$OUT bash "$0" "ab1:$t:$ops" | grep -v "^===" || echo "$ops" | tee -a "$LOG" ;;
    attnab:*)  # attnab:TYPE[:N]: the attention micro (every long-phase feature's row), then ab1 of the default and
      # the N (3) features fastest at 4,096 positions in the whole step (DEPTHS, ROUNDS; the file stays)
      spec=${stage#*:}; t=${spec%%:*}; n=${spec#*:}; [ "$n" = "$spec" ] && n=3
      timeout 300 python3 benchmarks/bench_decode_ops.py --no-sweep --json "$OUT/decode_ops.json" 2>&1 | tee -a "$LOG"
      ops=$(python3 benchmarks/sweep_ops.py "$OUT/decode_ops.json" --attn --top "$n" 2>&1) \
        && OUT=$OUT bash "$0" "ab1:$t:$ops" | grep -v "^===" || echo "$ops" | tee -a "$LOG" ;;
    llamacpp:*)  # llamacpp:build, or llamacpp:TYPE[:DEPTHS] (default 0,4096): llama.cpp's llama-bench beside moerun
      # bench on one synthesized OLMoE file (benchmarks/llamacpp.sh; carry .llama/src, made by its `src` here)
      spec=${stage#*:}; t=${spec%%:*}; d=${spec#*:}; [ "$d" = "$spec" ] && d=0,4096
      if [ "$spec" = build ]; then OUT=$OUT bash benchmarks/llamacpp.sh build; else OUT=$OUT bash benchmarks/llamacpp.sh \
        bench "$t" "$d"; fi 2>&1 | tee -a "$LOG" ;;
    synth:*) t=${stage#*:}; timeout 300 python3 -m moerun synth --preset olmoe-1b-7b --type "$t" \
        -o /tmp/synth-$t.gguf --no-progress --force 2>&1 | tail -1 | tee -a "$LOG"; rm -f /tmp/synth-$t.gguf ;;
    qgemm) timeout 300 python3 benchmarks/bench_qgemm.py ${QGEMM_ARGS:-} 2>&1 | tee -a "$LOG" ;;
    exp) timeout 240 python3 benchmarks/exp_q4k.py 2>&1 | tee -a "$LOG" ;;
    attn) timeout 300 python3 benchmarks/bench_decode_ops.py --no-sweep 2>&1 | tee -a "$LOG" ;;
    attnsweep) timeout 400 python3 benchmarks/bench_decode_ops.py --json "$OUT/decode_ops.json" 2>&1 | tee -a "$LOG" ;;
    olmoe:*|qwen3:*)
      t=${stage#*:}; p=$([ "${stage%%:*}" = olmoe ] && echo olmoe-1b-7b || echo qwen3-30b-a3b)
      f=/tmp/$p-$t.gguf
      timeout 300 python3 -m moerun synth --preset "$p" --type "$t" -o "$f" --no-progress --force 2>&1 | tail -2
      [ -n "${REFERENCE:-}" ] && timeout 200 python3 benchmarks/profile_decode.py "$f" --decode reference 2>&1 \
        | grep -v "loading to" | tee -a "$LOG"
      timeout 200 python3 benchmarks/profile_decode.py "$f" --decode eager 2>&1 | grep -v "loading to" | tee -a "$LOG"
      [ -n "${REFERENCE:-}" ] && bench "$f" "$p-$t-reference" -p 512 -n 32 -r 2 --decode reference
      bench "$f" "$p-$t-fast" -p 512 -n 128 -r 5 -d 0,4096 --decode fast
      rm -f "$f" ;;
    prefill:*)  # prefill variants + kernel profile, then the bench's pp512 / pp4096
      t=${stage#*:}; f=/tmp/olmoe-1b-7b-$t.gguf
      timeout 300 python3 -m moerun synth --preset olmoe-1b-7b --type "$t" -o "$f" --no-progress --force 2>&1 | tail -1
      timeout 400 python3 benchmarks/bench_prefill.py "$f" --profile ${PREFILL_VARIANTS:+--variants "$PREFILL_VARIANTS"} \
        2>&1 | grep -v "loading to" | tee -a "$LOG"
      bench "$f" "olmoe-1b-7b-$t-prefill" -p 512,4096 -n ${PREFILL_TG:-128} -r 5
      rm -f "$f" ;;
    words:*)
      t=${stage#*:}
      timeout 300 python3 -m pytest -q -x tests/kernels/test_wmatvec.py tests/kernels/test_qmatvec.py 2>&1 | tail -2 \
        | tee -a "$LOG"
      timeout 300 python3 benchmarks/bench_qmatvec.py --types ${WTYPES:-q4_k} ${WTILES:+--wtiles "$WTILES"} 2>&1 | tee -a "$LOG"
      ab "$t" triton words triton-bytes bytes
      MOERUN_TEST_DEVICE=cuda timeout 400 python3 -m pytest -q -x tests/engine/test_fast_decode.py 2>&1 | tail -3 \
        | tee -a "$LOG" ;;
    pad:*)  # Q6_K words on padded word-aligned copies vs the file's rows: tests, micro-benchmark, profiles, tg128
      t=${stage#*:}
      MOERUN_TEST_DEVICE=cuda timeout 300 python3 -m pytest -q -x tests/kernels/test_wmatvec.py \
        tests/engine/test_fast_decode.py -k "padded or down_w or make_ops or fast_steps" 2>&1 | tail -2 | tee -a "$LOG"
      timeout 240 python3 benchmarks/bench_qmatvec.py --types q6_k --wtiles default 2>&1 | tee -a "$LOG"
      ab "$t" triton padded triton-unpadded unpadded ;;
    down:*)  # expert products: micro over word-kernel tiles, profile and tg128 of this tree vs abtree/old (run
      # first and third: the spread between repeats is the call's noise); abtree/old holds an older moerun package
      t=${stage#*:}; f=/tmp/olmoe-1b-7b-$t.gguf
      timeout 300 python3 benchmarks/bench_qmatvec.py --types q4_k,q6_k,q8_0 --kinds down,gate_up \
        --wtiles "${DOWN_WTILES:-default,2x4x1x2,4x4x2x2,2x2x1x2,2x1x1x2,1x2x1x2}" 2>&1 | tee -a "$LOG"
      timeout 300 python3 -m moerun synth --preset olmoe-1b-7b --type "$t" -o "$f" --no-progress --force 2>&1 | tail -1
      timeout 200 python3 benchmarks/profile_decode.py "$f" --decode eager 2>&1 | grep -v "loading to" | head -18 \
        | tee -a "$LOG"
      for tree in old new old new; do  # python -m puts the working directory first on sys.path: run from the tree
        d=$PWD; [ $tree = old ] && d=$PWD/abtree/old
        (cd "$d" && PYTHONPATH=$d:/tmp/site bench "$f" "olmoe-1b-7b-$t-$tree-tg" -p 0 -n 128 -r 5 -d ${DEPTHS:-0})
      done
      rm -f "$f" ;;
    ab:*)  # same-call A/B of package trees: abtree/NAME/moerun for each NAME in AB_TREES (default "base var"; "."
      # is this tree): one eager profile each, then tg128 in the order AB_TREES, AB_TREES (the repeat is the noise);
      # AB_OPS: the decode ops (--ops) of every tree
      t=${stage#*:}; f=/tmp/olmoe-1b-7b-$t.gguf; trees=${AB_TREES:-base var}; root=$PWD
      [ -f "$f" ] || timeout 300 python3 -m moerun synth --preset olmoe-1b-7b --type "$t" -o "$f" --no-progress \
        2>&1 | tail -1
      for tree in ${AB_PROFILE-$trees}; do  # AB_PROFILE: the trees to profile (default all; "" none)
        d=$PWD; [ "$tree" = . ] || d=$PWD/abtree/$tree
        echo "--- profile $tree" | tee -a "$LOG"
        (cd "$d" && PYTHONPATH=$d:/tmp/site timeout 200 python3 "$root/benchmarks/profile_decode.py" "$f" --decode eager \
          ${AB_OPS:+--ops "$AB_OPS"} 2>&1 \
          | grep -v "loading to" | head -${PROFILE_LINES:-18} | tee -a "$LOG")
      done
      for tree in $trees $trees; do
        d=$PWD; [ "$tree" = . ] || d=$PWD/abtree/$tree
        echo "--- tg $tree" | tee -a "$LOG"
        (cd "$d" && PYTHONPATH=$d:/tmp/site bench "$f" "olmoe-1b-7b-$t-${tree//./this}-tg" -p 0 -n 128 -r 5 -d ${DEPTHS:-0} \
          ${AB_OPS:+--ops "$AB_OPS"})
      done ;;
    tg:*|pp:*)  # just the bench: tg128 (words and depth 4096) or pp512 of OLMoE
      t=${stage#*:}; f=/tmp/olmoe-1b-7b-$t.gguf
      timeout 300 python3 -m moerun synth --preset olmoe-1b-7b --type "$t" -o "$f" --no-progress --force 2>&1 | tail -1
      if [ "${stage%%:*}" = tg ]; then bench "$f" "olmoe-1b-7b-$t-tg" -p 0 -n 128 -r 5 -d 0,4096
      else bench "$f" "olmoe-1b-7b-$t-pp" -p 512,4096 -n 0 -r 5; fi
      rm -f "$f" ;;
    sanitize:*)  # compute-sanitizer TOOL (memcheck, racecheck, synccheck, initcheck) over eager decode steps of tiny
      # models with every Triton decode kernel (benchmarks/sanitize_step.py; SANITIZE_ARGS narrows it)
      tool=${stage#*:}; CS=$(command -v compute-sanitizer || ls /usr/local/cuda*/bin/compute-sanitizer | head -1)
      PYTORCH_NO_CUDA_MEMORY_CACHING=1 timeout 500 "$CS" --tool "$tool" --error-exitcode 9 --print-limit 20 \
        python3 benchmarks/sanitize_step.py ${SANITIZE_ARGS:-} > "$OUT/sanitize-$tool.txt" 2>&1
      echo "compute-sanitizer $tool: exit $?" | tee -a "$LOG"; grep -v "^Warning\|UserWarning\|warnings.warn" \
        "$OUT/sanitize-$tool.txt" | tail -25 | tee -a "$LOG" ;;
    sanitizetest:*)  # sanitizetest:TOOL:EXPR: compute-sanitizer TOOL over the CUDA kernel tests tests/kernels -k EXPR
      # (the attention's multi-tile chunks and every long variant, which sanitize:TOOL's 64-token steps never reach)
      spec=${stage#*:}; tool=${spec%%:*}; CS=$(command -v compute-sanitizer || ls /usr/local/cuda*/bin/compute-sanitizer | head -1)
      PYTORCH_NO_CUDA_MEMORY_CACHING=1 timeout 500 "$CS" --tool "$tool" --error-exitcode 9 --print-limit 20 \
        python3 -m pytest -q -x tests/kernels -k "${spec#*:}" > "$OUT/sanitizetest-$tool.txt" 2>&1
      echo "compute-sanitizer $tool over pytest -k '${spec#*:}': exit $?" | tee -a "$LOG"
      grep -v "^Warning\|UserWarning\|warnings.warn" "$OUT/sanitizetest-$tool.txt" | tail -12 | tee -a "$LOG" ;;
    ncu:*)  # hardware counters of one eager decode step (Firecracker machines; --clock-control none: METHOD.md);
      # NCU_DEPTH: tokens prefilled first (default 16), so the attention runs at that depth; NCU_OPS: the decode ops
      # (--ops); NCU_KERNEL: only kernels whose name matches this regex (e.g. _attn_split)
      t=${stage#*:}; f=/tmp/olmoe-1b-7b-$t.gguf; NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu | head -1)
      [ -f "$f" ] || timeout 300 python3 -m moerun synth --preset olmoe-1b-7b --type "$t" -o "$f" --no-progress \
        2>&1 | tail -1
      tag=$t${NCU_OPS:+-${NCU_OPS//+/-}}
      timeout 400 "$NCU" --profile-from-start off --clock-control none --csv --page raw \
        ${NCU_KERNEL:+--kernel-name "regex:$NCU_KERNEL"} \
        --metrics "$(python3 benchmarks/ncu_step.py --metrics)" python3 benchmarks/ncu_step.py "$f" \
        --depth "${NCU_DEPTH:-16}" ${NCU_OPS:+--ops "$NCU_OPS"} > "$OUT/ncu-$tag.csv" 2> "$OUT/ncu-$tag.err"
      tail -3 "$OUT/ncu-$tag.err" | tee -a "$LOG"
      python3 benchmarks/ncu_step.py --summarise "$OUT/ncu-$tag.csv" 2>&1 | tee -a "$LOG" ;;
    decodetests)  # DECODE_TESTS_K: a pytest -k filter (e.g. "not unpadded and not bytes" for a shorter run)
      MOERUN_TEST_DEVICE=cuda timeout 560 python3 -m pytest -q tests/kernels/test_embed.py tests/kernels/test_wmatvec.py \
        tests/kernels/test_decode_ops.py tests/kernels/test_attention.py tests/kernels/test_imatvec.py tests/kernels/test_qmatvec.py \
        tests/kernels/test_gpu.py tests/engine/test_fast_decode.py tests/engine/test_decode_acceptance.py \
        ${DECODE_TESTS_K:+-k "$DECODE_TESTS_K"} 2>&1 | tail -8 | tee -a "$LOG" ;;
    abops:*)  # abops:TYPE:OPS,OPS,...: benchmarks/ab_ops.sh (profiles, then tg128 of each ops twice; DEPTHS, NO_PROFILE)
      spec=${stage#*:}; t=${spec%%:*}; IFS=, read -r -a variants <<< "${spec#*:}"
      OUT="$OUT" bash benchmarks/ab_ops.sh "$t" "${variants[@]}" 2>&1 | tee -a "$LOG" ;;  # the file stays (next call)
    ab1:*)  # ab1:TYPE:OPS,OPS,...: one process, one loaded model, the ops in turn (moerun bench --ops A,B --rounds)
      spec=${stage#*:}; t=${spec%%:*}; f=/tmp/olmoe-1b-7b-$t.gguf
      [ -f "$f" ] || timeout 300 python3 -m moerun synth --preset olmoe-1b-7b --type "$t" -o "$f" --no-progress \
        2>&1 | tail -1
      d=$PWD; [ -n "${AB1_TREE:-}" ] && d=$PWD/abtree/$AB1_TREE  # AB1_TREE: run it in abtree/NAME's package
      (cd "$d" && PYTHONPATH=$d:/tmp/site timeout 500 python3 -m moerun bench -m "$f" -p 0 -n 128 -r 5 \
        -d "${DEPTHS:-0}" --ops "${spec#*:}" --rounds "${ROUNDS:-2}" \
        --output-file "$OUT/ab1-olmoe-1b-7b-$t${AB1_TREE:+-$AB1_TREE}.json" > /tmp/ab1.txt 2>&1)
      grep -q '^| ops |' /tmp/ab1.txt && sed -n '/^| ops |/,$p' /tmp/ab1.txt | tee -a "$LOG" \
        || tail -5 /tmp/ab1.txt | tee -a "$LOG" ;;  # the summary, or the error (one ops: use tg:TYPE); the file stays
    rm:*) rm -f "/tmp/olmoe-1b-7b-${stage#*:}.gguf" ;;  # rm:TYPE: the synthesized OLMoE file abops kept
    qgemmtests) timeout 300 python3 -m pytest -q -x tests/kernels/test_qgemm.py 2>&1 | tail -3 | tee -a "$LOG" ;;
    prefilltests)
      timeout 300 python3 -m pytest -q -x tests/kernels/test_qgemm.py tests/kernels/test_prefill_ops.py 2>&1 | tail -3 | tee -a "$LOG"
      MOERUN_TEST_DEVICE=cuda timeout 300 python3 -m pytest -q -x tests/engine/test_fast_prefill.py 2>&1 | tail -5 \
        | tee -a "$LOG" ;;
    tests)
      MOERUN_TEST_DEVICE=cuda timeout 540 python3 -m pytest -q tests/models tests/engine -k "not llamacpp" 2>&1 \
        | tail -15 | tee -a "$LOG" ;;
  esac
done
