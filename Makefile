# One entry point for people and CI. Everything installs into .venv from nothing.
PYTHON ?= python3.11
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(VENV)/bin/pip
DEMO_MODEL ?= models/demo-tiny
STAMP := $(VENV)/.installed
export RAY_USAGE_STATS_ENABLED := 0
export HF_HUB_OFFLINE := 1
export TRANSFORMERS_OFFLINE := 1
export TOKENIZERS_PARALLELISM := false

.PHONY: install serve test lint demo-model bench-offline clean prometheus

install: $(STAMP)

# torch is pinned first: an unpinned torch pulls a multi-GB CUDA build.
$(STAMP): pyproject.toml
	@command -v $(PYTHON) >/dev/null || { echo "need $(PYTHON)"; exit 1; }
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q torch==2.13.0
	$(PIP) install -q -e '.[test]' torch==2.13.0
	touch $(STAMP)

$(DEMO_MODEL)/config.json: | $(STAMP)
	$(PY) -m shards.demo_model $(DEMO_MODEL) --preset tiny

demo-model: $(DEMO_MODEL)/config.json

serve: install demo-model
	$(VENV)/bin/serve run serve_config.yaml

lint: install
	$(VENV)/bin/ruff check .

# Debian's prometheus, for the metrics test; where it cannot be had that test is skipped.
prometheus:
	@command -v prometheus >/dev/null 2>&1 || { [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null && \
	  (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq \
	   --no-install-recommends prometheus) >/dev/null 2>&1; } || \
	  echo "prometheus not installed: tests/deployments/test_prometheus.py will be skipped"

test: install lint prometheus
	$(PY) -m pytest -q -x --durations=15

bench-offline: install
	$(PY) -m benchmarks.offline

clean:
	rm -rf $(VENV) models .pytest_cache
