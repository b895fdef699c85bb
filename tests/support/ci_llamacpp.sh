#!/usr/bin/env bash
# Install llama-cpp-python (CPU only, built from source) into a venv, for the llama.cpp oracle tests.
#
# Usage: tests/support/ci_llamacpp.sh [path/to/venv]     (default: .venv)
#
# The first build takes ~10-25 minutes on 2 cores. pip keeps the built wheel in its wheel cache
# (`pip cache dir`/wheels, keyed by the sdist URL and the Python version, NOT by CMAKE_ARGS), so
# later runs with the same user/HOME, Python and index install it in seconds. If CMAKE_ARGS change,
# run `pip cache remove llama_cpp_python` first, or the old wheel is reused.
set -euo pipefail

VENV="${1:-.venv}"
VERSION="0.3.36"

if "$VENV/bin/python" -c "import llama_cpp, sys; sys.exit(llama_cpp.__version__ != '$VERSION')" 2>/dev/null; then
    echo "llama-cpp-python $VERSION already installed in $VENV"
    exit 0
fi

CMAKE_ARGS="-DGGML_NATIVE=OFF -DLLAMA_CURL=OFF -DGGML_BLAS=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF" \
    "$VENV/bin/pip" install --no-binary llama-cpp-python "llama-cpp-python==$VERSION"

"$VENV/bin/python" -c "import llama_cpp; print('llama-cpp-python', llama_cpp.__version__, 'OK')"
