#!/usr/bin/env bash
# Every GPU check in one call of the device machine (H100/H200, about 4-5 minutes):
#
#   bash benchmarks/gpu/prepare.sh          # here, once: .gpu-wheels/ and .gpu-model/ (carry both)
#   bash benchmarks/gpu/run_all.sh          # on the GPU machine, from anywhere
#
# Steps, in this order, each under `timeout` (its cap, or what is left of RUN_BUDGET_S if less; a
# step that fails or times out does not stop the next one; STEPS="kernels prompt" runs a subset):
#   install    setup.sh once (INSTALL_ONLY=1 kernels.sh): the carried wheels, this repo
#   kernels    kernels.sh: the Triton kernels against their torch references, natively on CUDA
#   attention  attention.sh --parts speed --speed-n 16384,32768 --tree-plan none: the DP state
#              query vs exact SDPA (target >= 5x at both n)
#   prompt     prompt.sh --tables 128000x4096 --parts nearest,roofline: the nearest-candidate kernel
#              vs a torch GEMM of its scoring part (target >= 50% of the GEMM's FLOP/s)
#   aggregate  aggregate.sh: answer-level aggregation's member batch (k = 21) vs one plain request
#              (target <= 3x)
#   train      train.sh --model $GPU_MODEL --methods non_private,ours, fp32 and bf16 autocast: the DP
#              step vs non-private on SmolLM2's architecture (target <= 1.2x)
# SmolLM2 runs with random weights (GPU_MODEL holds its config.json and tokenizer: the weights are
# too large to carry, and step and generation times do not depend on them).
#
# Output: $RUN_DIR (default /tmp/gpu-run) gets results/ (every result file, named with the device
# and the date) and logs/<step>.log; $OUT (the device runner's folder; else $RUN_DIR) gets
# run_all.log (everything printed), summary.md (each step's status, seconds and target lines) and
# results.tar.gz (results/ and logs/). Exit status: the number of steps that did not end ok.
#
# Environment: as setup.sh (PYTHON, GPU_WHEELS, BENCH_DEVICE, SKIP_INSTALL), plus GPU_MODEL (default
# .gpu-model/smollm2-135m-instruct), RUN_BUDGET_S (default 300: all steps together), STEPS,
# STEP_CAP_SCALE (default 1) and QUICK=1 (toy sizes). Dry run of every step on a CPU box with the
# dev venv (about 6 minutes on 2 cores):
#   QUICK=1 SKIP_INSTALL=1 BENCH_DEVICE=cpu PYTHON=.venv/bin/python TRITON_INTERPRET=1 \
#       RUN_BUDGET_S=3600 STEP_CAP_SCALE=10 bash benchmarks/gpu/run_all.sh
set -uo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
RUN_DIR="${RUN_DIR:-/tmp/gpu-run}"
DEST="${OUT:-$RUN_DIR}"
BUDGET="${RUN_BUDGET_S:-300}"
MIN_STEP_S=20  # a step with less time left is skipped
CAP_SCALE="${STEP_CAP_SCALE:-1}"  # multiplies every step's cap (a slow CPU box's dry run)
MODEL="${GPU_MODEL:-.gpu-model/smollm2-135m-instruct}"
STEPS="${STEPS:-install kernels attention prompt aggregate train}"
NAMES=() STATES=() TIMES=()

if [[ "${QUICK:-0}" == "1" ]]; then
    ATTENTION=(--quick --parts speed --tree-plan none)
    PROMPT=(--quick --parts nearest,roofline)
    AGGREGATE=(--quick)
    TRAIN=(--quick --model "$MODEL" --methods non_private,ours)
else
    ATTENTION=(--parts speed --speed-n 16384,32768 --tree-plan none)
    PROMPT=(--tables 128000x4096 --batches 512,4096 --parts nearest,roofline --min-time 0.3 --max-repeats 5)
    AGGREGATE=()
    TRAIN=(--model "$MODEL" --methods non_private,ours --warmup 2 --steps 5 --timeout 90)
fi

# step NAME CAP_S COMMAND...: COMMAND under `timeout` (CAP_S or the budget left), its output to
# the screen and logs/NAME.log; records its state (ok, FAILED, TIMEOUT, skipped) and seconds.
step() {
    local name=$1 cap=$(($2 * CAP_SCALE)) state rc start=$SECONDS
    shift 2
    [[ " $STEPS " == *" $name "* ]] || return 0
    local left=$((BUDGET - SECONDS))
    local limit=$((cap < left ? cap : left))
    if ((limit < MIN_STEP_S)); then
        state="skipped: ${left} s of the ${BUDGET} s budget left"
    else
        echo "== [$name] $(date -u +%T) limit ${limit} s: $*"
        timeout -k 10 "$limit" "$@" 2>&1 | tee "$RUN_DIR/logs/$name.log"
        rc=${PIPESTATUS[0]}
        case $rc in
            0) state=ok ;;
            124 | 137) state="TIMEOUT after ${limit} s" ;;
            *) state="FAILED (exit $rc)" ;;
        esac
    fi
    echo "== [$name] $state, $((SECONDS - start)) s"
    NAMES+=("$name") STATES+=("$state") TIMES+=($((SECONDS - start)))
}

# Each step's state and time, and the target lines (PASS / FAIL / n/a) and pytest counts it printed.
summary() {
    echo "# run_all.sh, $(date -u +%FT%TZ), device $DEVICE${QUICK:+ (QUICK=$QUICK)}, budget ${BUDGET} s, total ${SECONDS} s"
    local i
    for i in "${!NAMES[@]}"; do
        echo
        echo "## ${NAMES[i]}: ${STATES[i]} (${TIMES[i]} s)"
        echo
        grep -hE '^\s*(PASS|FAIL|n/a)\b|^(FAILED|ERROR) |[0-9]+ (passed|failed|errors?)\b' \
            "$RUN_DIR/logs/${NAMES[i]}.log" 2>/dev/null | sed 's/^ */- /'
    done
}

main() {
    local install=1
    [[ "${SKIP_INSTALL:-0}" == "1" ]] && install=0
    export SKIP_INSTALL=1 # the install runs as a step, under its timeout
    mkdir -p "$RUN_DIR/results" "$RUN_DIR/logs"
    source "$HERE/setup.sh" # repo root, the CUDA check, PY, DEVICE, check_modules
    set +e
    export PYTHON="$PY" BENCH_DEVICE="$DEVICE" BENCH_OUT="$RUN_DIR/results" DEVICE_CHECKED=1
    [[ -f "$MODEL/config.json" ]] || echo "!! no $MODEL/config.json: aggregate and train will fail (benchmarks/gpu/prepare.sh, carry .gpu-model)"

    SECONDS=0
    ((install)) && step install 120 env INSTALL_ONLY=1 SKIP_INSTALL=0 bash "$HERE/kernels.sh"
    step kernels 120 env -u OUT bash "$HERE/kernels.sh"
    step attention 90 env -u OUT bash "$HERE/attention.sh" "${ATTENTION[@]}"
    step prompt 120 env -u OUT bash "$HERE/prompt.sh" "${PROMPT[@]}"
    step aggregate 90 env -u OUT GPU_MODEL="$MODEL" bash "$HERE/aggregate.sh" "${AGGREGATE[@]}"
    step train 200 env -u OUT bash "$HERE/train.sh" "${TRAIN[@]}"

    summary | tee "$RUN_DIR/summary.md"
    [[ "$DEST" -ef "$RUN_DIR" ]] || cp "$RUN_DIR/summary.md" "$DEST/"
    tar -czf "$DEST/results.tar.gz" -C "$RUN_DIR" results logs summary.md
    echo "== wrote $DEST/summary.md, $DEST/results.tar.gz ($(du -h "$DEST/results.tar.gz" | cut -f1))"
    local failed=0 state
    for state in "${STATES[@]}"; do [[ "$state" == ok ]] || failed=$((failed + 1)); done
    echo "== $failed of ${#STATES[@]} steps did not end ok"
    return "$failed"
}

mkdir -p "$DEST"
main 2>&1 | tee "$DEST/run_all.log"
exit "${PIPESTATUS[0]}"
