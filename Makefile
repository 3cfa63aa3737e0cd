# Set-up and serving for the Triton LLM backend (CPU, no Docker).
#
#   make venv     .venv from Debian's /usr/bin/python3.11 + requirements.txt (pinned, hash-checked)
#   make model    models/smollm2-135m-instruct/ (HF safetensors folder converted from the GGUF)
#   make triton   .triton/backends/ (Triton backend directory assembled from the nvidia-pytriton wheel)
#   make kernels  .cache/kernels/ (our C++ low-bit kernels, built with torch's extension tooling)
#   make weights  .cache/weights/ (the model's GGUF blocks, checked and packed for the kernels)
#   make serve    run tritonserver and the OpenAI front door in the foreground (HTTP_PORT=8000 GRPC_PORT=8001
#                 METRICS_PORT=8002 OPENAI_PORT=9000); one Ctrl-C stops both
#   make test     .venv/bin/python -m pytest tests $(PYTEST_ARGS)   (after make browser)
#   make browser  Debian's chromium for the web page's browser test, when missing and apt-get can run
#   make clean    remove .venv, .triton and .cache (keeps models/);  make clean-all also removes models/
#
# Every target is idempotent: finished work is skipped (stamp files / existing outputs).

# The venv MUST come from the system Python whose libpython3.11 the Triton python stub embeds
# (Debian's 3.11.2), not from pyenv's python3 on PATH: see docs (environment.md).
PYTHON       ?= /usr/bin/python3.11
VENV         ?= .venv
MODEL_DIR    ?= models/smollm2-135m-instruct
TRITON_DIR   ?= .triton
MODEL_REPOSITORY ?= model_repository
HTTP_PORT    ?= 8000
GRPC_PORT    ?= 8001
METRICS_PORT ?= 8002
OPENAI_PORT  ?= 9000
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

.PHONY: help venv model triton kernels weights setup serve test browser clean clean-all

help:
	@sed -n '2,14p' $(firstword $(MAKEFILE_LIST)) | sed 's/^# \{0,1\}//'

venv: $(VENV_STAMP)
model: $(MODEL_STAMP)
triton: $(TRITON_STAMP)
kernels: $(KERNEL_STAMP)
setup: venv model triton kernels weights

# Re-runs (and re-installs) whenever requirements.txt changes.
$(VENV_STAMP): requirements.txt
	@test -x "$(PYTHON)" || { echo "error: $(PYTHON) not found (Debian: apt-get install python3.11-venv libpython3.11)" >&2; exit 1; }
	@if [ -f $(VENV)/pyvenv.cfg ] && ! grep -qx "home = $$(dirname $(PYTHON))" $(VENV)/pyvenv.cfg; then \
	  echo "$(VENV) was not built from $(PYTHON); recreating it"; rm -rf $(VENV); fi
	test -x "$(VENV_PY)" || $(PYTHON) -m venv $(VENV)
	$(VENV_PY) -m pip install --require-hashes --no-deps -r requirements.txt
	touch $@

# prepare_model.py itself skips a finished conversion; the venv is order-only so that editing
# requirements.txt does not redo the model.
$(MODEL_STAMP): scripts/prepare_model.py | $(VENV_STAMP)
	$(VENV_PY) scripts/prepare_model.py $(MODEL_DIR)
	@test -f $@ || { echo "error: $@ was not produced" >&2; exit 1; }; touch $@

# The C++ low-bit kernels (backend/kernels/lowbit.cpp), built once per source hash into .cache/kernels; one
# build serves every x86 CPU (the instruction set is chosen at run time). Where it cannot build, the server
# runs the pure-torch path and says so in its load log.
$(KERNEL_STAMP): $(wildcard backend/kernels/*.cpp) backend/kernels/__init__.py | $(VENV_STAMP)
	$(VENV_PY) -m backend.kernels
	@mkdir -p $(@D) && touch $@

# The model's GGUF blocks, checked against its fp32 weights and packed for the kernel, into .cache/weights
# (keyed by the files and the code; a few seconds when already there), so that servers start without it.
weights: model kernels
	$(VENV_PY) -m backend.gguf_weights $(MODEL_DIR)

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

serve: venv model triton kernels weights
	$(VENV_PY) scripts/serve.py --model-repository $(MODEL_REPOSITORY) \
	  --http-port $(HTTP_PORT) --grpc-port $(GRPC_PORT) --metrics-port $(METRICS_PORT) --openai-port $(OPENAI_PORT)

test: venv model triton kernels weights browser
	$(VENV_PY) -m pytest tests $(PYTEST_ARGS)

# tests/integration/test_web_page.py drives a real headless browser. Where none is found ($$CHROMIUM or
# chromium on PATH) and apt-get can run (as root, or through password-less sudo), install Debian's
# chromium; otherwise warn: the test then fails and says why (it never skips).
browser:
	@if [ -n "$${CHROMIUM:-}" ] || command -v chromium >/dev/null || command -v chromium-browser >/dev/null \
	  || command -v google-chrome >/dev/null; then exit 0; fi; \
	if [ "$$(id -u)" = 0 ]; then sudo=""; elif command -v sudo >/dev/null && sudo -n true 2>/dev/null; then sudo="sudo -n"; \
	else echo "warning: no chromium and no way to apt-get it; the browser test will fail" >&2; exit 0; fi; \
	if ! command -v apt-get >/dev/null; then echo "warning: no chromium and no apt-get; the browser test will fail" >&2; exit 0; fi; \
	echo "installing Debian's chromium for the browser test"; \
	$$sudo apt-get update -qq && $$sudo env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null \
	  || echo "warning: installing chromium failed; the browser test will fail" >&2

clean:
	rm -rf $(VENV) $(TRITON_DIR) .cache .pytest_cache

clean-all: clean
	rm -rf models
