#!/usr/bin/env bash
# GPU check for the Triton kernels: run on a CUDA machine, from anywhere.
#
#   1. tests/test_kernels.py, compiled (the same tests the CPU runs in the interpreter)
#   2. benchmarks/bench_paged_attention.py (pass --quick to this script for a short sweep)
#   3. the Triton notebook(s) under nbval, if they exist
#
# Logs go to ${OUT:-/tmp}/gpu_check_*.log; a summary is printed at the end.
# Each step gets a time limit so the whole script stays under 10 minutes.
# Exit status: 0 only if every step that ran passed.

set -uo pipefail
cd "$(dirname "$0")/.."

LOG_DIR="${OUT:-/tmp}"
mkdir -p "$LOG_DIR"
BENCH_ARGS=()
[[ "${1:-}" == "--quick" ]] && BENCH_ARGS=(--quick)

# Use the project's virtualenv when there is one; compile, never interpret.
[[ -f .venv/bin/activate ]] && . .venv/bin/activate
unset TRITON_INTERPRET

if ! python -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)"; then
    echo "gpu_check: no CUDA device visible; nothing to check here (run the CPU tests instead)." >&2
    exit 1
fi
python -c "import torch; print('gpu_check:', torch.cuda.get_device_name(), '| torch', torch.__version__)"

TOTAL_BUDGET=570          # seconds for all steps together (< 10 min with start-up)
START=$SECONDS
FAILED=()
SUMMARY=()

# run_step NAME MAX_SECONDS RESERVE_SECONDS CMD...: run CMD with a limit of MAX_SECONDS,
# cut down so that RESERVE_SECONDS stay for the steps after it.
run_step() {
    local name=$1 max=$2 reserve=$3; shift 3
    local left=$(( TOTAL_BUDGET - (SECONDS - START) - reserve ))
    local limit=$(( max < left ? max : left ))
    local log="$LOG_DIR/gpu_check_${name}.log"
    if (( limit < 10 )); then
        SUMMARY+=("$name: SKIPPED (out of time)"); FAILED+=("$name"); return
    fi
    echo "== $name (limit ${limit}s) -> $log"
    local t0=$SECONDS
    timeout --kill-after=10 "$limit" "$@" >"$log" 2>&1
    local rc=$?
    tail -n 30 "$log"
    local verdict="ok"
    (( rc == 124 || rc == 137 )) && verdict="TIMED OUT"
    (( rc != 0 && rc != 124 && rc != 137 )) && verdict="FAILED (rc=$rc)"
    [[ $verdict != ok ]] && FAILED+=("$name")
    SUMMARY+=("$name: $verdict in $(( SECONDS - t0 ))s")
}

run_step kernels_pytest 200 330 python -m pytest tests/test_kernels.py -q -rs
run_step benchmark 300 90 python benchmarks/bench_paged_attention.py "${BENCH_ARGS[@]}"

NOTEBOOKS=()
for nb in notebooks/05_triton_paged_attention.ipynb solutions/05_*.ipynb; do
    [[ -f $nb ]] && NOTEBOOKS+=("$nb")
done
if (( ${#NOTEBOOKS[@]} )); then
    run_step notebooks_nbval 150 0 python -m pytest --nbval "${NOTEBOOKS[@]}" -q
else
    SUMMARY+=("notebooks_nbval: skipped (no Triton notebooks yet)")
fi

echo
echo "== summary (logs in $LOG_DIR, total $(( SECONDS - START ))s)"
printf '  %s\n' "${SUMMARY[@]}"
(( ${#FAILED[@]} == 0 ))
