#!/usr/bin/env bash
# What travels to the GPU machine besides the tracked tree, made here (a machine with PyPI access
# and the dev venv: `make install`); both folders are git-ignored and carried:
#   .gpu-wheels/   `make gpu-wheels`: dp-accounting and its needs, Opacus, the editable build's tools
#                  (the GPU machine has torch, triton, transformers, peft, ... but nothing else);
#   .gpu-model/smollm2-135m-instruct/   SmolLM2-135M-Instruct's config.json, generation_config.json
#                  and tokenizer, no weights (3.5 MB; the converted weights are 540 MB): the
#                  benchmarks build the architecture with random weights from it
#                  (`lib.scenarios.load_causal_lm`). Copied from .models/ (converted on first use).
#
#   bash benchmarks/gpu/prepare.sh           # then carry .gpu-wheels and .gpu-model
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
PY="${PYTHON:-.venv/bin/python}"
SOURCE=.models/smollm2-135m-instruct
TARGET="${GPU_MODEL:-.gpu-model/smollm2-135m-instruct}"

make gpu-wheels
[[ -f "$SOURCE/config.json" ]] || "$PY" -m vllm_dp_plugin.cli import-model smollm2-135m-instruct "$SOURCE"
mkdir -p "$TARGET"
cp "$SOURCE"/{config.json,generation_config.json,tokenizer.json,tokenizer_config.json} "$TARGET"/
du -sh .gpu-wheels "$TARGET"
