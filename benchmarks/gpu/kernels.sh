#!/usr/bin/env bash
# The Triton kernels (nearest-candidate fast pass, DPTree leaf histogram and gather-contract)
# against their torch references, natively on a CUDA machine (H100/H200 class) that has only torch
# + triton (+ pytest) installed and no network.
#
#   make gpu-wheels                          # once, on a machine with PyPI access: fills .gpu-wheels/
#   bash benchmarks/gpu/kernels.sh [pytest options...]   # on the GPU machine, from anywhere
#
# The script
#   1-2. installs the carried wheels and this repo (setup.sh);
#   3. runs pytest on tests/kernels/test_nearest_kernel.py and test_tree_kernels.py with
#      KERNEL_TEST_DEVICE=cuda (tests/kernels/conftest.py: every kernel test runs on CUDA tensors
#      and fails, not skips, without CUDA or triton; the CPU-interpreter launchers skip), writing
#      the report and a JUnit XML to benchmarks/results/kernels-<device>-<date>.{log,xml}
#      (<device>: gpu-<family>, e.g. gpu-h100).
#
# Environment: as attention.sh. On a CPU box BENCH_DEVICE=cpu runs the same tests under triton's
# interpreter instead (set TRITON_INTERPRET=1 for the in-process run the dry run uses):
#   SKIP_INSTALL=1 BENCH_DEVICE=cpu BENCH_OUT=/tmp/dry PYTHON=.venv/bin/python TRITON_INTERPRET=1 \
#       bash benchmarks/gpu/kernels.sh
# If $OUT is set (the device runner's output folder), the result files are copied there too.
source "$(dirname "${BASH_SOURCE[0]}")/setup.sh"

check_modules torch triton pytest dp_accounting vllm_dp_plugin.kernels.nearest

[[ "${INSTALL_ONLY:-0}" == "1" ]] && exit 0

[[ "$DEVICE" == cuda* ]] && export KERNEL_TEST_DEVICE=cuda
STEM="$RESULTS/kernels-$("$PY" -c "from vllm_dp_plugin.benchmarks.lib.environment import device_label; print(device_label('$DEVICE', short=True))")-$(date +%F)"
mkdir -p "$RESULTS"
echo "== pytest (KERNEL_TEST_DEVICE=${KERNEL_TEST_DEVICE:-} TRITON_INTERPRET=${TRITON_INTERPRET:-}) -> $STEM.{log,xml}"
status=0
"$PY" -m pytest -p no:cacheprovider -rA --junitxml "$STEM.xml" "$@" \
    tests/kernels/test_nearest_kernel.py tests/kernels/test_tree_kernels.py 2>&1 | tee "$STEM.log" || status=$?

if [[ -n "${OUT:-}" && -d "${OUT}" ]]; then
    cp "$STEM".* "$OUT"/ 2>/dev/null || true
    echo "== copied results to $OUT"
fi
exit "$status"
