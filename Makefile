# Set-up and serving for the Triton LLM backend (CPU, no Docker).
#
#   make venv     .venv from Debian's /usr/bin/python3.11 + requirements.txt (pinned, hash-checked)
#   make model    models/smollm2-135m-instruct/ (HF safetensors folder converted from the GGUF)
#   make triton   .triton/backends/ (Triton backend directory assembled from the nvidia-pytriton wheel)
#   make kernels  .cache/kernels/ (our C++ low-bit kernels, built with torch's extension tooling)
#   make weights  what the served model reads from its GGUF (python -m backend.model.gguf_weights)
#   make draft    train an EAGLE-style draft head for the served model on this CPU in DRAFT_MINUTES (60) with
#                 DRAFT_SEED (0) on DRAFT_THREADS (2), into DRAFT_DIR (.cache/draft/eagle-smollm2-135m), the folder `draft_model` names;
#                 DRAFT_PROMPTS=FILE answers a deployment's own prompts (JSON lines) instead of the built-in ones
#                 (python -m backend.spec.train_draft; docs/trained_draft.md)
#   make serve    run tritonserver and the OpenAI front door in the foreground (HTTP_PORT=8000 GRPC_PORT=8001
#                 METRICS_PORT=8002 OPENAI_PORT=9000; API_KEY=... makes the front door require it); one Ctrl-C
#                 stops both
#   make test     make lint, then .venv/bin/python -m pytest tests $(PYTEST_ARGS)   (after make browser)
#   make lint     ruff check, ruff format --check, lint-imports (the import contracts in pyproject.toml)
#   make lm-eval  lm-eval in process vs. through a running front door (own .venv-lmeval; LM_EVAL_ARGS=...)
#   make browser  Debian's chromium for the web page's browser test, when missing and apt-get can run
#   make serve-replicas  N=2 replicas behind Debian's HAProxy on OPENAI_PORT (llm-serve-replicas)
#   make deploy-check    render, validate and lint deploy/ (Kubernetes manifests; also part of make test)
#   make llama-cpp       llama.cpp's llama-bench, llama-server and llama-batched-bench for the benchmark's sections 6
#                 and 9, built for this CPU from the hash-pinned llama-cpp-python sdist into .cache/llama.cpp/bin
#                 (about 8 minutes on 2 cores)
#   make bench    the benchmark report (llm-bench $(BENCH_ARGS)) into benchmarks/results, llama.cpp included
#   make bench-kquant    section 6 on the shipped GGUF re-quantized to KQUANT=Q4_K_M by llama.cpp, served from the
#                 file by both (benchmarks/results/q4_k_m)
#   make bench-sizes     1B-, 3B- and 8B-shaped random GGUFs (llama-quantize) through Triton against llama.cpp:
#                 READY, memory, batch 1 / 8 / 32, a long prompt (benchmarks/results/sizes; SIZES_ARGS=...)
#   make clean    remove .venv, .triton and .cache (keeps models/);  make clean-all also removes models/
#
# Every target is idempotent: finished work is skipped (stamp files / existing outputs).

# The venv MUST come from the system Python whose libpython3.11 the Triton python stub embeds
# (Debian's 3.11.2), not from pyenv's python3 on PATH: see README, "Quick start" (what `make` does).
PYTHON       ?= /usr/bin/python3.11
VENV         ?= .venv
MODEL_DIR    ?= models/smollm2-135m-instruct
TRITON_DIR   ?= .triton
MODEL_REPOSITORY ?= model_repository
HTTP_PORT    ?= 8000
GRPC_PORT    ?= 8001
METRICS_PORT ?= 8002
OPENAI_PORT  ?= 9000
# The front door's API key (make serve API_KEY=...; or LLM_API_KEY in the environment). Passed to it through
# the environment, never on a command line.
API_KEY      ?=
LLM_API_KEY  ?=
API_KEY      := $(or $(API_KEY),$(LLM_API_KEY))
PYTEST_ARGS  ?=

VENV_PY      := $(VENV)/bin/python
VENV_STAMP   := $(VENV)/.requirements.stamp
MODEL_STAMP  := $(MODEL_DIR)/model.gguf
TRITON_STAMP := $(TRITON_DIR)/backends/python/triton_python_backend_stub
KERNEL_STAMP := .cache/kernels/built.stamp

SHELL := /bin/bash
.SHELLFLAGS := -euo pipefail -c
.DELETE_ON_ERROR:
.DEFAULT_GOAL := help

.PHONY: help venv model triton kernels weights setup serve test lint browser clean clean-all

help:
	@sed -n '2,/^$$/p' $(firstword $(MAKEFILE_LIST)) | sed 's/^# \{0,1\}//'

venv: $(VENV_STAMP)
model: $(MODEL_STAMP)
triton: $(TRITON_STAMP)
kernels: $(KERNEL_STAMP)
setup: venv model triton kernels weights

# Re-runs (and re-installs) whenever requirements.txt or pyproject.toml changes. The project itself goes in
# editable (its console scripts llm-serve, llm-client, ... in $(VENV)/bin; the packages importable anywhere).
$(VENV_STAMP): requirements.txt pyproject.toml
	@test -x "$(PYTHON)" || { echo "error: $(PYTHON) not found (Debian: apt-get install python3.11-venv libpython3.11)" >&2; exit 1; }
	@if [ -f $(VENV)/pyvenv.cfg ] && ! grep -qx "home = $$(dirname $(PYTHON))" $(VENV)/pyvenv.cfg; then \
	  echo "$(VENV) was not built from $(PYTHON); recreating it"; rm -rf $(VENV); fi
	test -x "$(VENV_PY)" || $(PYTHON) -m venv $(VENV)
	$(VENV_PY) -m pip install --require-hashes --no-deps -r requirements.txt
	$(VENV_PY) -m pip install --quiet --no-deps --no-build-isolation --editable .
	touch $@

# llm-prepare-model itself skips a finished conversion; the venv is order-only so that editing
# requirements.txt does not redo the model.
$(MODEL_STAMP): launcher/prepare_model.py | $(VENV_STAMP)
	$(VENV)/bin/llm-prepare-model $(MODEL_DIR)
	@test -f $@ || { echo "error: $@ was not produced" >&2; exit 1; }; touch $@

# The C++ low-bit kernels (backend/model/kernels/lowbit.cpp), built once per source hash into .cache/kernels; one
# build serves every x86 CPU (the instruction set is chosen at run time). Where it cannot build, the server
# runs the pure-torch path and says so in its load log.
$(KERNEL_STAMP): $(wildcard backend/model/kernels/*.cpp backend/model/kernels/*.h) backend/model/kernels/__init__.py | $(VENV_STAMP)
	$(VENV_PY) -m backend.model.kernels
	@mkdir -p $(@D) && touch $@

# What the served model reads from its GGUF (the weights' resident bytes); servers read the file itself at load.
weights: model kernels
	$(VENV_PY) -m backend.model.gguf_weights $(MODEL_DIR)

# The draft head trains from the target's own generations, which it makes first (no data set is downloaded).
DRAFT_MINUTES ?= 60
DRAFT_SEED    ?= 0
DRAFT_THREADS ?= 2
DRAFT_DIR     ?= .cache/draft/eagle-smollm2-135m
DRAFT_PROMPTS ?=
DRAFT_STARTED := $(shell date +%s)
.PHONY: draft
draft: model kernels
	$(VENV_PY) -m backend.spec.train_draft --model $(MODEL_DIR) --out $(DRAFT_DIR) --minutes $(DRAFT_MINUTES) \
	  --started $(DRAFT_STARTED) --seed $(DRAFT_SEED) --threads $(DRAFT_THREADS) $(if $(DRAFT_PROMPTS),--prompts $(DRAFT_PROMPTS))

# Backend directory: the wheel's backends/* plus the stub for the venv's Python version.
$(TRITON_STAMP): $(VENV_STAMP)
	@site=$$($(VENV_PY) -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])'); \
	pyver=$$($(VENV_PY) -c 'import sys; print("%d.%d" % sys.version_info[:2])'); \
	src=$$site/pytriton/tritonserver; \
	stub=$$src/python_backend_stubs/$$pyver/triton_python_backend_stub; \
	test -d "$$src/backends" || { echo "error: $$src/backends missing (is nvidia-pytriton installed?)" >&2; exit 1; }; \
	test -f "$$stub" || { echo "error: no Triton python stub for Python $$pyver at $$stub" >&2; exit 1; }; \
	echo "assembling $(TRITON_DIR)/backends from $$src (stub: Python $$pyver)"; \
	rm -rf $(TRITON_DIR)/backends.tmp && mkdir -p $(TRITON_DIR)/backends.tmp; \
	cp -r "$$src"/backends/* $(TRITON_DIR)/backends.tmp/; \
	find $(TRITON_DIR)/backends.tmp -name __pycache__ -type d -prune -exec rm -rf {} +; \
	mkdir -p $(TRITON_DIR)/backends.tmp/python; \
	cp "$$stub" $(TRITON_DIR)/backends.tmp/python/triton_python_backend_stub; \
	chmod +x $(TRITON_DIR)/backends.tmp/python/triton_python_backend_stub; \
	rm -rf $(TRITON_DIR)/backends && mv $(TRITON_DIR)/backends.tmp $(TRITON_DIR)/backends
	@touch $@

serve: export LLM_API_KEY := $(API_KEY)
serve: venv model triton kernels weights
	$(VENV)/bin/llm-serve --model-repository $(MODEL_REPOSITORY) \
	  --http-port $(HTTP_PORT) --grpc-port $(GRPC_PORT) --metrics-port $(METRICS_PORT) --openai-port $(OPENAI_PORT)

test: venv lint model triton kernels weights browser
	$(VENV_PY) -m pytest tests $(PYTEST_ARGS)

# Lint (pyproject.toml): ruff's checks and its formatting, and import-linter's contracts (the engine's rooms in
# layers, a pure protocol room, a front door and client without the engine's heavy libraries).
lint: venv
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/lint-imports

# tests/integration/test_web_page.py drives a real headless browser. Where none is found ($$CHROMIUM or
# chromium on PATH) and apt-get can run (as root, or through password-less sudo), install Debian's
# chromium; otherwise warn: the test then fails and says why (it never skips).
browser:
	@if [ -n "$${CHROMIUM:-}" ] || command -v chromium >/dev/null || command -v chromium-browser >/dev/null \
	  || command -v google-chrome >/dev/null; then exit 0; fi; \
	$(call apt-install,chromium,the browser test)

# Debian's package $(1), installed where apt-get can run (as root, or through password-less sudo); otherwise a
# warning that $(2) will fail.
define apt-install
if [ "$$(id -u)" = 0 ]; then sudo=""; elif command -v sudo >/dev/null && sudo -n true 2>/dev/null; then sudo="sudo -n"; \
else echo "warning: no $(1) and no way to apt-get it; $(2) will fail" >&2; exit 0; fi; \
if ! command -v apt-get >/dev/null; then echo "warning: no $(1) and no apt-get; $(2) will fail" >&2; exit 0; fi; \
echo "installing Debian's $(1) for $(2)"; \
$$sudo apt-get update -qq && $$sudo env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $(1) >/dev/null \
  || echo "warning: installing $(1) failed; $(2) will fail" >&2
endef

# Replicas on one machine behind a real proxy (docs/deploy.md): N supervised launches on ports 8100 + 100 * i,
# Debian's HAProxy on OPENAI_PORT (least connections, health checks, retries of requests not yet answered).
# loadtest/failover.py kills one replica's tritonserver under load and reports (FAILOVER_ARGS=...).
N ?= 2
FAILOVER_ARGS ?=
.PHONY: haproxy serve-replicas failover deploy-check
haproxy:
	@if [ -n "$${HAPROXY:-}" ] || command -v haproxy >/dev/null || [ -x /usr/sbin/haproxy ]; then exit 0; fi; \
	$(call apt-install,haproxy,serve-replicas)

serve-replicas: venv model triton kernels weights haproxy
	$(VENV)/bin/llm-serve-replicas --replicas $(N) --port $(OPENAI_PORT)

failover: venv model triton kernels weights haproxy
	$(VENV)/bin/llm-failover $(FAILOVER_ARGS)

# The Kubernetes manifests under deploy/ (kubectl, yamllint and kubernetes-validate come with the venv).
deploy-check: venv
	$(VENV_PY) -m deploy.check

# The benchmark's peer (benchmarks/core/llama_cpp_build.py): needs cmake and a C++ compiler, installed where missing.
.PHONY: llama-cpp bench bench-kquant bench-sizes
BENCH_ARGS ?=
llama-cpp: venv
	@command -v cmake >/dev/null || { $(call apt-install,cmake,make llama-cpp); }
	@command -v c++ >/dev/null || { $(call apt-install,g++,make llama-cpp); }
	$(VENV_PY) -m benchmarks.core.llama_cpp_build

bench: venv model triton kernels weights llama-cpp
	$(VENV)/bin/llm-bench $(BENCH_ARGS)

# Section 6 on a K-quant file: the shipped GGUF re-quantized by llama.cpp's llama-quantize (KQUANT, default
# Q4_K_M), served straight from the file by us and loaded by llama-bench / llama-server.
KQUANT ?= Q4_K_M
bench-kquant: venv model triton kernels llama-cpp
	file=$$($(VENV_PY) -m benchmarks.core.llama_cpp_build --quantize $(KQUANT) | tail -1); \
	$(VENV)/bin/llm-bench --only 6 --model "$$file" --gguf "$$file" \
	  --out benchmarks/results/$$(echo $(KQUANT) | tr A-Z a-z) $(BENCH_ARGS)

# Real model sizes (benchmarks/tools/model_sizes.py): files generated once into .cache/llama.cpp/models.
SIZES_ARGS ?=
bench-sizes: venv triton kernels llama-cpp
	$(VENV_PY) -m benchmarks.tools.model_sizes $(SIZES_ARGS)

clean:
	rm -rf $(VENV) $(TRITON_DIR) .cache .pytest_cache

clean-all: clean
	rm -rf models

# lm-evaluation-harness in a virtual environment of its own (the server's .venv and its pins stay untouched):
# scores benchmarks/lm_eval's task in process and through the front door of a running `make serve`, and
# compares the two request by request (-m benchmarks.lm_eval.run $(LM_EVAL_ARGS); --skip-served: in process only).
LMEVAL_VENV  ?= .venv-lmeval
LM_EVAL_ARGS ?=
.PHONY: lm-eval lm-eval-venv
lm-eval-venv: $(LMEVAL_VENV)/.requirements.stamp
$(LMEVAL_VENV)/.requirements.stamp: benchmarks/lm_eval/requirements.txt
	@test -x "$(PYTHON)" || { echo "error: $(PYTHON) not found" >&2; exit 1; }
	test -x $(LMEVAL_VENV)/bin/python || $(PYTHON) -m venv $(LMEVAL_VENV)
	$(LMEVAL_VENV)/bin/pip install -r benchmarks/lm_eval/requirements.txt
	touch $@

lm-eval: lm-eval-venv
	$(LMEVAL_VENV)/bin/python -m benchmarks.lm_eval.run $(LM_EVAL_ARGS)
