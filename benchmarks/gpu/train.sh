#!/usr/bin/env bash
# DP training step time and peak memory on a CUDA machine (H100/H200 class) that has torch,
# transformers and matplotlib but no vLLM, no Opacus and no network.
#
#   make gpu-wheels                    # once, on a machine with PyPI access: fills .gpu-wheels/
#                                      # (it must include an opacus wheel: pip download opacus==1.6.0 --no-deps)
#   bash benchmarks/gpu/train.sh [bench options...]      # on the GPU machine, from anywhere
#
# .gpu-wheels/ (git-ignored) must travel with the checkout (e.g. as a carried path). The script
#   1. installs the missing pure/small dependencies and Opacus (pure Python; its needs numpy,
#      scipy, opt-einsum are on the machine) from .gpu-wheels/ only (setup.sh); without an opacus
#      wheel the Opacus rows report "No module named 'opacus'" and the rest still runs;
#   2. installs this repo editable without dependencies or index (setup.sh);
#   3. runs `python -m benchmarks.train --device cuda` once per autocast mode in
#      TRAIN_AUTOCAST (default "none bf16"): GPT-2 small (124M, tied 50257 vocab, random init),
#      batch 16 x 512 tokens; non-private vs ours (DPEngine, Phantom Clipping) vs Opacus ghost
#      clipping (tied: expected to fail; untied head) vs torch.func per-sample gradients, and
#      writes benchmarks/results/train-<gpu-name>[-bf16]-<date>.{md,json,png}. Options go to the
#      bench: e.g. `--model .gpu-model/smollm2-135m-instruct --methods non_private,ours` runs
#      SmolLM2's architecture with random weights (the directory holds its config.json and
#      tokenizer only: benchmarks/gpu/prepare.sh) -> train-smollm2-135m-instruct-<gpu-name>-...
#
# Environment: PYTHON (default python3), GPU_WHEELS (default .gpu-wheels), BENCH_DEVICE (default
# cuda), BENCH_OUT (default benchmarks/results), TRAIN_AUTOCAST (default "none bf16"),
# INSTALL_ONLY=1 (steps 1-2 only), SKIP_INSTALL=1 (skip steps 1-2). Dry run on a CPU box with the
# dev venv:
#   SKIP_INSTALL=1 BENCH_DEVICE=cpu BENCH_OUT=/tmp/dry PYTHON=.venv/bin/python \
#       bash benchmarks/gpu/train.sh --quick
# If $OUT is set (the device runner's output folder), the result files are copied there too.
source "$(dirname "${BASH_SOURCE[0]}")/setup.sh"

check_modules torch transformers peft opacus scipy opt_einsum matplotlib dp_accounting

[[ "${INSTALL_ONLY:-0}" == "1" ]] && exit 0

status=0  # a failed mode does not stop the next one; the script's exit status says it failed
for mode in ${TRAIN_AUTOCAST:-none bf16}; do
    echo "== train --device $DEVICE --autocast $mode --out $RESULTS $*"
    "$PY" -m benchmarks.train --device "$DEVICE" --autocast "$mode" --out "$RESULTS" "$@" \
        || status=$?
done

if [[ -n "${OUT:-}" && -d "${OUT}" ]]; then
    cp "$RESULTS"/train-* "$OUT"/ 2>/dev/null || true
    echo "== copied results to $OUT"
fi
exit "$status"
