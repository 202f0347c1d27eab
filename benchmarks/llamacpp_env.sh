#!/usr/bin/env bash
# Optional llama.cpp baseline for benchmarks/quant_decode.py: builds llama-cpp-python from its PyPI
# sdist into its own venv (never the project venv). ~25 min of 2 cores per build, so it runs under
# `nice -n 19`. Two builds, because llama.cpp behaves differently on this machine class:
#   portable  CMAKE_ARGS="-DGGML_NATIVE=OFF -DGGML_AVX512=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON"
#             (works for every batch size)
#   native    the default build (-march=native kernels; fast batch-1 decode, crashed on batches of
#             2+ tokens in an earlier report; 0.3.36 has not crashed here)
# Usage: benchmarks/llamacpp_env.sh [portable|native]...   (default: portable native)
set -euo pipefail
cd "$(dirname "$0")/.."
VERSION=0.3.36
PYTHON=${PYTHON:-python3.11}
variants=("$@")
[ ${#variants[@]} -eq 0 ] && variants=(portable native)
for v in "${variants[@]}"; do
  case "$v" in
    portable) args="-DGGML_NATIVE=OFF -DGGML_AVX512=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON" ;;
    native) args="" ;;
    *) echo "unknown variant '$v' (portable|native)" >&2; exit 2 ;;
  esac
  env_dir=.bench-envs/llamacpp-$v
  if [ -x "$env_dir/bin/python" ] && "$env_dir/bin/python" -c "import llama_cpp" 2>/dev/null; then
    echo "$env_dir: llama-cpp-python already installed"; continue
  fi
  "$PYTHON" -m venv "$env_dir"
  echo "building llama-cpp-python==$VERSION ($v, CMAKE_ARGS='$args') into $env_dir"
  CMAKE_ARGS="$args" CMAKE_BUILD_PARALLEL_LEVEL=2 nice -n 19 \
    "$env_dir/bin/pip" install --no-cache-dir "llama-cpp-python==$VERSION"
done
