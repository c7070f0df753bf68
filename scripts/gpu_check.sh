#!/usr/bin/env bash
# GPU check: run on a CUDA machine, from anywhere, in under 10 minutes. CI's GPU job runs exactly this.
#
#   0. a Python with CUDA torch: .venv if it has one, else the machine's python3 (tinypaged is then
#      installed into it with `pip install --no-deps --no-build-isolation -e .`, offline; wheels in
#      .whl/ from scripts/gpu_wheels.sh are installed too), else scripts/setup_env.sh builds .venv
#   1. tests/test_kernels.py + tests/test_triton_backend.py, compiled (the CPU runs them in the interpreter),
#      and tests/test_gpu_sizing.py (KV sizing from gpu_memory_utilization; skipped without CUDA)
#   2. benchmarks/bench_paged_attention.py --quick (pass --full to this script for the whole sweep)
#   3. nbval on every notebook with TINYPAGED_DEVICE=cuda: notebooks/ and solutions/ strict, exercises/
#      lax. Without nbval this step says SKIPPED; without SmolLM2 (not installed, and no network to get
#      it) the notebooks that load it are skipped and named.
#   4. grading: solutions/05 must get full marks, exercises/05 none (compiled kernels, stub detection)
#
# Ends with a one-screen summary: tests passed, notebooks passed, the kernel's bandwidth as a fraction of
# a device-to-device copy, paging overhead against an identity block table, speed-up over
# gather-then-attend. Logs go to ${OUT:-/tmp}/gpu_check_*.log. Exit status: 0 only if every step passed
# (a SKIPPED step does not fail the check, but the summary says so).

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
export TRANSFORMERS_NO_ADVISORY_WARNINGS=1 PIP_DEFAULT_TIMEOUT=10 PIP_RETRIES=1 PIP_BREAK_SYSTEM_PACKAGES=1
export PIP_DISABLE_PIP_VERSION_CHECK=1

has_cuda_torch() { "$1" -c "import sys, torch, triton; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; }

PY=""
for candidate in .venv/bin/python python3; do
    if command -v "$candidate" >/dev/null 2>&1 && has_cuda_torch "$candidate"; then PY=$candidate; break; fi
done
if [[ -z $PY ]]; then
    echo "== setup: no Python with CUDA torch -> bash scripts/setup_env.sh (log: $LOG_DIR/gpu_check_setup.log)"
    timeout 400 bash scripts/setup_env.sh >"$LOG_DIR/gpu_check_setup.log" 2>&1 || tail -n 20 "$LOG_DIR/gpu_check_setup.log"
    has_cuda_torch .venv/bin/python && PY=.venv/bin/python
fi
if [[ -z $PY ]]; then
    echo "gpu_check: no CUDA device visible to torch; nothing to check here (run the CPU tests instead)." >&2
    exit 1
fi
if ! (cd / && "$PY" -c "import tinypaged.kernels") 2>/dev/null; then  # from /: not the checkout on sys.path
    echo "== installing tinypaged into $PY (editable, no dependencies, offline)"
    if ! "$PY" -m pip install -q --no-deps --no-build-isolation -e . >"$LOG_DIR/gpu_check_install.log" 2>&1; then
        # No write access to that Python: a tree of links on PYTHONPATH does what the install would
        # (tinypaged/ as the package, kernels/ as tinypaged.kernels).
        SHIM="${TMPDIR:-/tmp}/tinypaged-shim"
        rm -rf "$SHIM" && mkdir -p "$SHIM/tinypaged"
        for f in "$PWD"/tinypaged/*; do ln -s "$f" "$SHIM/tinypaged/"; done
        ln -s "$PWD/kernels" "$SHIM/tinypaged/kernels"
        export PYTHONPATH="$SHIM${PYTHONPATH:+:$PYTHONPATH}"
        echo "   (pip could not install it: using links in $SHIM; see $LOG_DIR/gpu_check_install.log)"
    fi
    "$PY" -c "import tinypaged.kernels" || { tail -n 20 "$LOG_DIR/gpu_check_install.log"; exit 1; }
fi
if [[ -d .whl ]] && ! "$PY" -c "import nbval, nbformat, ipykernel" 2>/dev/null; then
    # Carried wheels (scripts/gpu_wheels.sh): installed beside the image's packages, never over them.
    SITE="${TMPDIR:-/tmp}/tinypaged-wheels"
    echo "== installing the carried wheels from .whl/ into $SITE (offline)"
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" .whl/*.whl \
        >"$LOG_DIR/gpu_check_wheels.log" 2>&1 || tail -n 20 "$LOG_DIR/gpu_check_wheels.log"
    export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"
fi
# SmolLM2 (converted once into ~/.cache/tinypaged): present, or convertible from its installed wheel?
SMOL=1
timeout 120 "$PY" -m tinypaged prepare >"$LOG_DIR/gpu_check_prepare.log" 2>&1 || SMOL=0
"$PY" -c "import torch, triton; print('gpu_check:', torch.cuda.get_device_name(), '| torch', torch.__version__, '| triton', triton.__version__, '| python', '$PY')"

FAILED=()
SUMMARY=()
FIGURES=()

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
    tail -n 15 "$log"
    local verdict="ok"
    (( rc == 124 || rc == 137 )) && verdict="TIMED OUT"
    (( rc != 0 && rc != 124 && rc != 137 )) && verdict="FAILED (rc=$rc)"
    [[ $verdict != ok ]] && FAILED+=("$name")
    # pytest's last line ("12 passed, 1 skipped in 3.4s") says how many; keep it in the summary.
    local counts
    counts=$(grep -E '^=*\s*[0-9]+ (passed|failed|error)' "$log" | tail -n 1 | sed -E 's/^=+ //; s/ =+$//; s/ in [0-9.]+s.*//')
    SUMMARY+=("$name: $verdict in $(( SECONDS - t0 ))s${counts:+ ($counts)}")
}

grade_05() {
    # Full marks for the solution, nothing for the untouched exercise.
    local out
    out=$("$PY" -m tinypaged.course grade solutions/05_triton_paged_attention.ipynb \
          exercises/05_triton_paged_attention.ipynb 2>/dev/null) || return 1
    echo "$out"
    grep -Eq '^solutions/05_triton_paged_attention.ipynb: ([0-9]+)/\1$' <<<"$out" \
        && grep -Eq '^exercises/05_triton_paged_attention.ipynb: 0/[1-9]' <<<"$out" \
        && ! grep -q 'FAIL' <<<"$out"
}

run_step kernel_tests 240 300 "$PY" -m pytest tests/test_kernels.py tests/test_triton_backend.py tests/test_gpu_sizing.py -q -rs -p no:randomly
run_step benchmark 120 200 "$PY" benchmarks/bench_paged_attention.py "${BENCH_ARGS[@]}"
FIGURES+=("$(grep -h '^summary:' "$LOG_DIR/gpu_check_benchmark.log" 2>/dev/null | sed 's/^summary: /  /')")

# Notebooks on the GPU: the lessons read TINYPAGED_DEVICE (tinypaged.course.lesson_prompts.LESSON_DEVICE).
NOTEBOOKS=(); EXERCISES=(); SKIPPED_NB=()
for nb in notebooks/*.ipynb solutions/*.ipynb exercises/*.ipynb; do
    if (( ! SMOL )) && grep -q 'smollm2-135m\|smollm2_folder\|get_tokenizer' "$nb"; then SKIPPED_NB+=("$nb"); continue; fi
    [[ $nb == exercises/* ]] && EXERCISES+=("$nb") || NOTEBOOKS+=("$nb")
done
NB_TOTAL=$(( ${#NOTEBOOKS[@]} + ${#EXERCISES[@]} ))
if ! "$PY" -c "import nbval, nbformat, ipykernel" 2>/dev/null; then
    SUMMARY+=("nbval: SKIPPED: nbval not installed (pip install nbval nbformat ipykernel, or carry .whl/ from scripts/gpu_wheels.sh)")
    NB_LINE="notebooks: SKIPPED (nbval not installed)"
else
    nbval_all() {
        local rc=0
        TINYPAGED_DEVICE=cuda "$PY" -m pytest -q -p no:randomly --nbval --nbval-current-env \
            --nbval-sanitize-with tests/nbval_sanitize.cfg --junitxml="$LOG_DIR/gpu_check_nbval.xml" "${NOTEBOOKS[@]}" || rc=1
        if (( ${#EXERCISES[@]} )); then
            TINYPAGED_DEVICE=cuda "$PY" -m pytest -q --nbval-lax --nbval-current-env \
                --junitxml="$LOG_DIR/gpu_check_nbval_lax.xml" "${EXERCISES[@]}" || rc=1
        fi
        return $rc
    }
    rm -f "$LOG_DIR"/gpu_check_nbval*.xml
    run_step nbval 240 40 bash -c "$(declare -f nbval_all); PY='$PY' LOG_DIR='$LOG_DIR' NOTEBOOKS=(${NOTEBOOKS[*]}) EXERCISES=(${EXERCISES[*]}); nbval_all"
    # A notebook passes when none of its cells failed (nbval reports one test per cell).
    NB_LINE=$("$PY" - "$LOG_DIR" "$NB_TOTAL" <<'EOF'
import sys, glob, xml.etree.ElementTree as ET
bad, seen, cells, failed = set(), set(), 0, 0
for f in glob.glob(f"{sys.argv[1]}/gpu_check_nbval*.xml"):
    for case in ET.parse(f).iter("testcase"):
        nb = (case.get("file") or case.get("classname", "")).split("::")[0]
        seen.add(nb)
        cells += 1
        if case.find("failure") is not None or case.find("error") is not None:
            bad.add(nb)
            failed += 1
print(f"notebooks: {len(seen - bad)} of {sys.argv[2]} passed on the GPU ({cells - failed} of {cells} cells)"
      + (f"; failed: {' '.join(sorted(bad))}" if bad else ""))
EOF
)
fi
(( ${#SKIPPED_NB[@]} )) && NB_LINE+="; ${#SKIPPED_NB[@]} skipped, SmolLM2 not installed: ${SKIPPED_NB[*]}"

run_step grading 60 0 bash -c "PY='$PY'; $(declare -f grade_05); grade_05"

echo
echo "================================ gpu_check summary ================================"
"$PY" -c "import torch; print('device:', torch.cuda.get_device_name(), '| torch', torch.__version__)"
printf '  %s\n' "${SUMMARY[@]}"
echo "  $NB_LINE"
echo "kernel (benchmarks/bench_paged_attention.py ${BENCH_ARGS[*]}):"
if [[ -n "${FIGURES[*]// /}" ]]; then printf '%s\n' "${FIGURES[@]}"; else echo "  (no figures: see $LOG_DIR/gpu_check_benchmark.log)"; fi
echo "total $(( SECONDS - START ))s; logs in $LOG_DIR; $( (( ${#FAILED[@]} )) && echo "FAILED: ${FAILED[*]}" || echo "all steps passed")"
(( ${#FAILED[@]} == 0 ))
