# Shared set-up of the GPU benchmark scripts (sourced by kernels.sh, attention.sh, prompt.sh,
# train.sh, aggregate.sh and run_all.sh, never run alone): go to the repo root, check the CUDA
# device, install the carried wheels (.gpu-wheels/: dp-accounting and its needs, Opacus without
# its dependencies) and this repo (editable, no deps) unless SKIP_INSTALL=1. Sets PY, WHEELS,
# DEVICE, RESULTS; defines check_modules. Nothing is fetched: Hugging Face runs offline.
set -euo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/../.."
PY="${PYTHON:-python3}"
WHEELS="${GPU_WHEELS:-.gpu-wheels}"
DEVICE="${BENCH_DEVICE:-cuda}"
RESULTS="${BENCH_OUT:-benchmarks/results}"
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 MPLBACKEND=Agg PYTHONUNBUFFERED=1

echo "== $(date -u +%FT%TZ) repo $(pwd), python $("$PY" -c 'import sys; print(sys.version.split()[0])')"
if [[ "$DEVICE" == cuda* && -z "${DEVICE_CHECKED:-}" ]]; then  # run_all.sh checks once
    command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
    "$PY" -c 'import torch, sys; ok = torch.cuda.is_available(); print("torch", torch.__version__, "cuda", torch.version.cuda, "available", ok); sys.exit(0 if ok else 1)' \
        || { echo "torch sees no CUDA device; set BENCH_DEVICE=cpu for a CPU run" >&2; exit 1; }
fi

if [[ "${SKIP_INSTALL:-0}" != "1" ]]; then
    if [[ ! -d "$WHEELS" ]]; then
        echo "missing $WHEELS/: run 'make gpu-wheels' (or benchmarks/gpu/prepare.sh) on a machine with PyPI access and carry it along" >&2
        exit 1
    fi
    # The runner's Python may be an "externally managed" system interpreter on a throw-away machine.
    export PIP_BREAK_SYSTEM_PACKAGES=1 PIP_DISABLE_PIP_VERSION_CHECK=1
    echo "== dependencies from $WHEELS (no index)"
    "$PY" -m pip install -q --no-index --find-links "$WHEELS" "setuptools>=68" wheel "packaging>=24"
    "$PY" -m pip install -q --no-index --find-links "$WHEELS" dp-accounting dm-tree tqdm pyyaml
    # Opacus is pure Python; its needs (numpy, scipy, opt-einsum, torch) are on the machine.
    "$PY" -m pip install -q --no-deps --no-index --find-links "$WHEELS" opacus \
        || echo "   no opacus wheel in $WHEELS: benchmarks.train's Opacus rows will report the missing module" >&2
    echo "== vllm-dp-plugin (editable, no deps)"
    "$PY" -m pip install -q --no-deps --no-index --no-build-isolation --ignore-requires-python -e .
fi

# Print, for each Python module named, whether this interpreter can import it.
check_modules() {
    "$PY" - "$@" <<'PYEOF'
import importlib.util
import sys

for mod in sys.argv[1:]:
    try:
        found = importlib.util.find_spec(mod) is not None
    except ModuleNotFoundError:
        found = False
    print(f"  {mod}: {'present' if found else 'MISSING'}")
PYEOF
}
