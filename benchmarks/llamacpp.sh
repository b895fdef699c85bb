#!/usr/bin/env bash
# llama.cpp's own llama-bench beside `moerun bench`, on the same synthesized file and the same GPU: the issue's
# baseline (DESIGN.md: H200 figures) re-measured on whatever card runs it.
#   benchmarks/llamacpp.sh src
#       (a machine with PyPI) llama.cpp's source from the llama-cpp-python sdist (LLAMA_CPP_PYTHON, default 0.3.36),
#       pruned to what llama-bench's CUDA build needs, into .llama/src (~22 MB; `echo /.llama/ >> .git/info/exclude`,
#       then carry .llama/src to the GPU machine)
#   benchmarks/llamacpp.sh build
#       (the GPU machine) configure + build llama-bench with CUDA for this GPU's architecture into .llbuild (kept on
#       a warm machine, so a build cut by a time limit resumes in the next call; BUILD_JOBS, default nproc + 2)
#   benchmarks/llamacpp.sh bench TYPE [DEPTHS]
#       (the GPU machine) synthesize OLMoE-1B-7B TYPE, then `llama-bench -ngl 99 -fa 1 -p 0 -n 128 -r 5 -d DEPTHS` and
#       `moerun bench -p 0 -n 128 -r 5 -d DEPTHS` on it (DEPTHS default 0,4096); JSON into $OUT, one table at the end
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/moerun-out}; mkdir -p "$OUT"
SRC=.llama/src BUILD=.llbuild

case ${1:-} in
  src)
    v=${LLAMA_CPP_PYTHON:-0.3.36}; tmp=$(mktemp -d)
    python3 -m pip download -q --no-deps --no-binary=:all: "llama-cpp-python==$v" -d "$tmp" || exit 1
    tar xzf "$tmp"/llama_cpp_python-"$v".tar.gz -C "$tmp" || exit 1
    s=$tmp/llama_cpp_python-$v/vendor/llama.cpp
    rm -rf "$SRC"; mkdir -p "$SRC/tools" "$SRC/ggml/src"
    cp -r "$s"/{CMakeLists.txt,LICENSE,cmake,common,include,src,vendor} "$SRC"/
    cp -r "$s/tools/llama-bench" "$SRC/tools/"
    cp -r "$s"/ggml/{CMakeLists.txt,cmake,include} "$SRC/ggml/"
    for f in "$s"/ggml/src/*; do  # every backend but CPU and CUDA (and HIP's headers, which CUDA's build includes) left out
      case $(basename "$f") in ggml-*) case $(basename "$f") in ggml-cpu|ggml-cuda|ggml-hip|ggml-*.*) ;; *) continue ;; esac ;; esac
      cp -r "$f" "$SRC/ggml/src/"
    done
    printf 'find_package(Threads REQUIRED)\nllama_add_compile_flags()\nadd_subdirectory(llama-bench)\n' \
      > "$SRC/tools/CMakeLists.txt"  # llama-bench alone of the tools
    ggml=$(sed -n 's/^set(GGML_VERSION_\(MAJOR\|MINOR\|PATCH\) \([0-9]*\))/\2/p' "$s/ggml/CMakeLists.txt" | paste -sd.)
    echo "llama.cpp vendored by llama-cpp-python $v (ggml $ggml)" > "$SRC/VERSION"
    rm -rf "$tmp"; cat "$SRC/VERSION"; du -sh "$SRC" ;;
  build)
    [ -f "$SRC/CMakeLists.txt" ] || { echo "no llama.cpp source in $SRC: run '$0 src' where PyPI is reachable" >&2; exit 1; }
    arch=$(nvidia-smi --query-gpu=compute_cap --format=csv,noheader | head -1 | tr -d .)
    # GIT_CEILING_DIRECTORIES: llama.cpp's build info must not take this repository's commit for its own
    # (the logs go to $OUT only on failure: the device returns at most 8 files)
    [ -f "$BUILD/build.ninja" ] || GIT_CEILING_DIRECTORIES=$PWD/.llama cmake -S "$SRC" -B "$BUILD" -G Ninja \
      -DCMAKE_BUILD_TYPE=Release -DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES="$arch" -DGGML_NATIVE=OFF \
      -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=OFF -DLLAMA_BUILD_APP=OFF \
      -DLLAMA_BUILD_TOOLS=ON -DLLAMA_OPENSSL=OFF -DLLAMA_CURL=OFF > /tmp/llamacpp-cmake.txt 2>&1 \
      || { cp /tmp/llamacpp-cmake.txt "$OUT/"; tail -20 /tmp/llamacpp-cmake.txt; exit 1; }
    cmake --build "$BUILD" --target llama-bench -j "${BUILD_JOBS:-$(($(nproc) + 2))}" > /tmp/llamacpp-build.txt 2>&1
    rc=$?; [ $rc = 0 ] || cp /tmp/llamacpp-build.txt "$OUT/"; tail -3 /tmp/llamacpp-build.txt; exit $rc ;;
  bench)
    t=${2:?TYPE}; depths=${3:-0,4096}; f=/tmp/olmoe-1b-7b-$t.gguf; lb=$BUILD/bin/llama-bench
    [ -x "$lb" ] || { echo "no $lb: run '$0 build' first" >&2; exit 1; }
    cat "$SRC/VERSION" 2>/dev/null
    [ -f "$f" ] || timeout 300 python3 -m moerun synth --preset olmoe-1b-7b --type "$t" -o "$f" --no-progress | tail -1
    # (stderr kept only on failure: the device returns at most 8 files)
    timeout 300 "$lb" -m "$f" -ngl 99 -fa 1 -p 0 -n 128 -r 5 -d "$depths" -o json > "$OUT/llamacpp-olmoe-$t.json" \
      2> /tmp/llamacpp-olmoe-$t.err || { cp /tmp/llamacpp-olmoe-$t.err "$OUT/"; tail -5 /tmp/llamacpp-olmoe-$t.err; }
    timeout 400 python3 -m moerun bench -m "$f" -p 0 -n 128 -r 5 -d "$depths" \
      --output-file "$OUT/moerun-olmoe-$t.json" 2>&1 | grep -v "loading to" | grep "^|"
    python3 - "$OUT/llamacpp-olmoe-$t.json" "$OUT/moerun-olmoe-$t.json" "$t" <<'EOF'
import json, sys
lc, mr, t = json.load(open(sys.argv[1])), json.load(open(sys.argv[2])), sys.argv[3]
print(f"| file | depth | llama.cpp tg128 (llama-bench, {lc[0].get('gpu_info', '?')}) | moerun tg128 | ratio |")
print("|---|---:|---:|---:|---:|")
ours = {int(r["depth"]): r["tps_median"] for r in mr["results"] if r["kind"] == "tg"}
for r in lc:
    d, theirs = int(r.get("n_depth", 0)), r["avg_ts"]
    m = ours.get(d)
    print(f"| {t} | {d} | {theirs:.1f} | {m:.1f} | {m / theirs:.2f}x |" if m else f"| {t} | {d} | {theirs:.1f} | - | - |")
EOF
    ;;
  *) sed -n '2,16p' "$0"; exit 2 ;;
esac
