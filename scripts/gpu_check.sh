#!/usr/bin/env bash
# GPU check for stage 5 (the Triton kernels): run on a CUDA machine, from anywhere, in under 10 minutes.
#
#   0. the environment: if .venv cannot import tinypaged with a CUDA torch, run scripts/setup_env.sh
#      (it installs the CUDA build of torch when nvidia-smi works)
#   1. tests/test_kernels.py + tests/test_triton_backend.py, compiled (the CPU runs them in the interpreter)
#   2. benchmarks/bench_paged_attention.py --quick (pass --full to this script for the whole sweep)
#   3. nbval on notebooks/05 and solutions/05 (strict), exercises/05 (lax)
#   4. grading: solutions/05 must get full marks, exercises/05 none (compiled kernels, stub detection)
#
# Logs go to ${OUT:-/tmp}/gpu_check_*.log; a summary is printed at the end.
# Each step gets a time limit so the whole script stays under 10 minutes.
# Exit status: 0 only if every step passed.

set -uo pipefail
cd "$(dirname "$0")/.."

LOG_DIR="${OUT:-/tmp}"
mkdir -p "$LOG_DIR"
BENCH_ARGS=(--quick)
[[ "${1:-}" == "--full" ]] && BENCH_ARGS=()

TOTAL_BUDGET=570          # seconds for everything, setup included (< 10 min with start-up)
START=$SECONDS

# Compile, never interpret; quiet, deterministic, offline; unbuffered so a timed-out log keeps its rows.
unset TRITON_INTERPRET
export PYTHONHASHSEED=0 MPLBACKEND=Agg TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1
export TRANSFORMERS_NO_ADVISORY_WARNINGS=1 PIP_DEFAULT_TIMEOUT=10 PIP_RETRIES=1

env_ok() {
    [[ -x .venv/bin/python ]] && .venv/bin/python -c \
        "import sys, torch, triton, nbval, tinypaged; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null
}
if ! env_ok; then
    echo "== setup: .venv missing or without CUDA torch -> bash scripts/setup_env.sh (log: $LOG_DIR/gpu_check_setup.log)"
    timeout 300 bash scripts/setup_env.sh >"$LOG_DIR/gpu_check_setup.log" 2>&1 || tail -n 20 "$LOG_DIR/gpu_check_setup.log"
fi
[[ -f .venv/bin/activate ]] && . .venv/bin/activate

if ! python -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)"; then
    echo "gpu_check: no CUDA device visible to torch; nothing to check here (run the CPU tests instead)." >&2
    exit 1
fi
python -c "import torch, triton; print('gpu_check:', torch.cuda.get_device_name(), '| torch', torch.__version__, '| triton', triton.__version__)"

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

grade_05() {
    # Full marks for the solution, nothing for the untouched exercise.
    local out
    out=$(python -m tinypaged.coursework grade solutions/05_triton_paged_attention.ipynb \
          exercises/05_triton_paged_attention.ipynb 2>/dev/null) || return 1
    echo "$out"
    grep -Eq '^solutions/05_triton_paged_attention.ipynb: ([0-9]+)/\1$' <<<"$out" \
        && grep -Eq '^exercises/05_triton_paged_attention.ipynb: 0/[1-9]' <<<"$out" \
        && ! grep -q 'FAIL' <<<"$out"
}

run_step kernels_pytest 240 260 python -m pytest tests/test_kernels.py tests/test_triton_backend.py -q -rs -p no:randomly
run_step benchmark 180 150 python benchmarks/bench_paged_attention.py "${BENCH_ARGS[@]}"
run_step notebooks_nbval 150 40 bash -c 'python -m pytest -q -p no:randomly --nbval --nbval-current-env \
    --nbval-sanitize-with tests/nbval_sanitize.cfg notebooks/05_triton_paged_attention.ipynb \
    solutions/05_triton_paged_attention.ipynb \
    && python -m pytest -q --nbval-lax --nbval-current-env exercises/05_triton_paged_attention.ipynb'
run_step grading 60 0 bash -c "$(declare -f grade_05); grade_05"

echo
echo "== summary (logs in $LOG_DIR, total $(( SECONDS - START ))s)"
printf '  %s\n' "${SUMMARY[@]}"
(( ${#FAILED[@]} == 0 ))
