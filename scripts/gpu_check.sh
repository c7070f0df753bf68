#!/usr/bin/env bash
# GPU check: run on a CUDA machine, from anywhere, in under 9 minutes (TOTAL_BUDGET). CI's GPU job runs exactly this.
#
#   0. a Python with CUDA torch: .venv if it has one, else the machine's python3 (tinypaged is then
#      installed into it with `pip install --no-deps --no-build-isolation -e .`, offline; wheels in
#      .whl/ from scripts/gpu_wheels.sh are installed beside it), else scripts/setup_env.sh builds .venv.
#      SmolLM2: already converted, or joined from parts carried by scripts/gpu_carry.sh (build/gpu-carry/),
#      or converted from its installed wheel; without it the notebooks that load it are skipped and named.
#   1. nbval on every notebook with TINYPAGED_DEVICE=cuda: notebooks/ and solutions/ strict (the same stored
#      outputs as on the CPU), exercises/ lax; GPU_CHECK_NB_JOBS notebooks at once (default 3), and a
#      notebook that fails among others is run once more alone. Cells passed / total per notebook; cells
#      tagged needs-vllm-cpu / needs-vllm-router count as skipped where vLLM's CPU build or vllm-router is
#      absent (as on the H200 machine: tinypaged/course/nbval_plugin.py), never as failed.
#   2. grading: every solution must get full marks, every untouched exercise none
#   3. benchmarks/bench_gpu_throughput.py: tinypaged vs transformers generate_batch, SmolLM2-1.7B's shapes
#   4. tests/test_kernels.py + tests/test_triton_backend.py + tests/test_fused_elementwise.py, compiled (the CPU
#      runs them in the interpreter),
#      tests/test_cuda_graphs.py (CUDA-graph decode against eager),
#      and tests/test_gpu_sizing.py (KV sizing from gpu_memory_utilization)
#   5. benchmarks/bench_paged_attention.py --quick (pass --full to this script for the whole sweep)
# GPU_CHECK_STEPS=nbval,grading,... runs only those steps, GPU_CHECK_NOTEBOOKS="solutions/05_*.ipynb ..." only
# those notebooks (a rerun of what is left, or a run split over several calls). Each step has its own
# time limit, cut so that the steps after it keep their share of TOTAL_BUDGET.
#
# Ends with a one-screen summary. Logs go to $LOG_DIR (${TMPDIR:-/tmp}/gpu_check); with $OUT set, three
# files land there: gpu_check_summary.txt, gpu_check_logs.tar.gz (every log and junit file) and
# bench_gpu_throughput.json (a device run returns at most 8 files). Exit status: 0 only if every step
# passed (a SKIPPED step does not fail the check, but the summary says so).

set -uo pipefail
cd "$(dirname "$0")/.."

LOG_DIR="${GPU_CHECK_LOGS:-${TMPDIR:-/tmp}/gpu_check}"
rm -rf "$LOG_DIR" && mkdir -p "$LOG_DIR"
BENCH_ARGS=(--quick)
[[ "${1:-}" == "--full" ]] && BENCH_ARGS=()
STEPS=",${GPU_CHECK_STEPS:-nbval,grading,gpu_throughput,kernel_tests,benchmark},"
NB_JOBS=${GPU_CHECK_NB_JOBS:-3}

TOTAL_BUDGET=${GPU_CHECK_BUDGET:-500}   # seconds for everything, setup included: run it with a 560 s limit
START=$SECONDS

# Compile, never interpret; quiet, deterministic, offline; unbuffered so a timed-out log keeps its rows.
unset TRITON_INTERPRET
export PYTHONHASHSEED=0 MPLBACKEND=Agg TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1
export TRANSFORMERS_NO_ADVISORY_WARNINGS=1 PIP_DEFAULT_TIMEOUT=10 PIP_RETRIES=1 PIP_BREAK_SYSTEM_PACKAGES=1
export PIP_DISABLE_PIP_VERSION_CHECK=1 TQDM_DISABLE=1

has_cuda_torch() { "$1" -c "import sys, torch, triton; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; }

PY=""
for candidate in .venv/bin/python python3; do
    if command -v "$candidate" >/dev/null 2>&1 && has_cuda_torch "$candidate"; then PY=$candidate; break; fi
done
if [[ -z $PY ]]; then
    echo "== setup: no Python with CUDA torch -> bash scripts/setup_env.sh (log: $LOG_DIR/setup.log)"
    timeout 400 bash scripts/setup_env.sh >"$LOG_DIR/setup.log" 2>&1 || tail -n 20 "$LOG_DIR/setup.log"
    has_cuda_torch .venv/bin/python && PY=.venv/bin/python
fi
if [[ -z $PY ]]; then
    echo "gpu_check: no CUDA device visible to torch; nothing to check here (run the CPU tests instead)." >&2
    exit 1
fi
if ! (cd / && "$PY" -c "import tinypaged.kernels") 2>/dev/null; then  # from /: not the checkout on sys.path
    echo "== installing tinypaged into $PY (editable, no dependencies, offline)"
    if ! "$PY" -m pip install -q --no-deps --no-build-isolation -e . >"$LOG_DIR/install.log" 2>&1; then
        # No write access to that Python: a tree of links on PYTHONPATH does what the install would
        # (tinypaged/ as the package, kernels/ as tinypaged.kernels).
        SHIM="${TMPDIR:-/tmp}/tinypaged-shim"
        rm -rf "$SHIM" && mkdir -p "$SHIM/tinypaged"
        for f in "$PWD"/tinypaged/*; do ln -s "$f" "$SHIM/tinypaged/"; done
        ln -s "$PWD/kernels" "$SHIM/tinypaged/kernels"
        export PYTHONPATH="$SHIM${PYTHONPATH:+:$PYTHONPATH}"
        echo "   (pip could not install it: using links in $SHIM; see $LOG_DIR/install.log)"
    fi
    "$PY" -c "import tinypaged.kernels" || { tail -n 20 "$LOG_DIR/install.log"; exit 1; }
fi
SITE="${TMPDIR:-/tmp}/tinypaged-wheels"
if [[ -d .whl ]] && ! "$PY" -c "import nbval, nbformat, ipykernel, gguf" 2>/dev/null; then
    # Carried wheels (scripts/gpu_wheels.sh): installed beside the image's packages, never over them.
    echo "== installing the carried wheels from .whl/ into $SITE (offline)"
    timeout 120 "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" \
        .whl/*.whl >"$LOG_DIR/wheels.log" 2>&1 || tail -n 20 "$LOG_DIR/wheels.log"
fi
[[ -d $SITE ]] && export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"  # a later run reuses what an earlier installed

SUMMARY=()
FAILED=()
# SmolLM2: parts carried by scripts/gpu_carry.sh are joined (and converted) first; then present, or
# convertible from an installed wheel?
if compgen -G "build/gpu-carry/stage-*/MANIFEST" >/dev/null || [[ -d build/gpu-carry/received ]]; then
    echo "== SmolLM2 from the carried parts (scripts/gpu_carry.sh join) -> $LOG_DIR/smollm2_join.log"
    GPU_CARRY_PYTHON=$PY timeout 180 bash scripts/gpu_carry.sh join >"$LOG_DIR/smollm2_join.log" 2>&1
    rc=$?
    tail -n 5 "$LOG_DIR/smollm2_join.log"
    case $rc in
        0) SUMMARY+=("smollm2_join: ok") ;;
        3) SUMMARY+=("smollm2_join: INCOMPLETE ($(grep -o 'missing: .*' "$LOG_DIR/smollm2_join.log" | head -n 1 | cut -c1-80))") ;;
        5) SUMMARY+=("smollm2_join: converted, but DIFFERS from the CPU's copy (see the log)"); FAILED+=(smollm2_join) ;;
        *) SUMMARY+=("smollm2_join: FAILED (rc=$rc)"); FAILED+=(smollm2_join) ;;
    esac
fi
SMOL=1
timeout 120 "$PY" -m tinypaged prepare >"$LOG_DIR/prepare.log" 2>&1 || SMOL=0
"$PY" -c "import torch, triton, transformers; print('gpu_check:', torch.cuda.get_device_name(), '| torch', torch.__version__, '| CUDA', torch.version.cuda, '| triton', triton.__version__, '| transformers', transformers.__version__, '| python', '$PY')" \
    | tee "$LOG_DIR/versions.txt"

FIGURES=()

# Each step's time limit (seconds), in the order they run.
ORDER=(nbval grading gpu_throughput kernel_tests benchmark)
declare -A MAX=([nbval]=240 [grading]=80 [gpu_throughput]=150 [kernel_tests]=120 [benchmark]=60)

# run_step NAME CMD...: run CMD with a limit of MAX[NAME], cut down so that the selected steps after it
# keep half of theirs. Steps not in GPU_CHECK_STEPS are left out.
run_step() {
    local name=$1; shift
    [[ $STEPS == *",$name,"* ]] || return 0
    local reserve=0 later=0 s
    for s in "${ORDER[@]}"; do
        (( later )) && [[ $STEPS == *",$s,"* ]] && reserve=$(( reserve + MAX[$s] / 2 ))
        [[ $s == "$name" ]] && later=1
    done
    local max=${MAX[$name]}
    local left=$(( TOTAL_BUDGET - (SECONDS - START) - reserve ))
    local limit=$(( max < left ? max : left ))
    local log="$LOG_DIR/${name}.log"
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

# -- 1. notebooks on the GPU: the lessons read TINYPAGED_DEVICE (tinypaged.course.lesson_prompts.LESSON_DEVICE)
NOTEBOOKS=(); EXERCISES=(); SKIPPED_NB=()
for nb in ${GPU_CHECK_NOTEBOOKS:-notebooks/*.ipynb solutions/*.ipynb exercises/*.ipynb}; do
    if (( ! SMOL )) && grep -q 'smollm2-135m\|smollm2_folder\|get_tokenizer' "$nb"; then SKIPPED_NB+=("$nb"); continue; fi
    [[ $nb == exercises/* ]] && EXERCISES+=("$nb") || NOTEBOOKS+=("$nb")
done
NB_TOTAL=$(( ${#NOTEBOOKS[@]} + ${#EXERCISES[@]} ))
NB_LINES=()
if [[ $STEPS != *",nbval,"* ]]; then
    NB_LINES=("notebooks: not run (GPU_CHECK_STEPS)")
elif ! "$PY" -c "import nbval, nbformat, ipykernel" 2>/dev/null; then
    SUMMARY+=("nbval: SKIPPED: nbval not installed (pip install nbval nbformat ipykernel, or carry .whl/ from scripts/gpu_wheels.sh)")
    NB_LINES=("notebooks: SKIPPED (nbval not installed)")
else
    # One pytest per notebook, its own junit file: nbval reports one test per cell.
    nbval_one() {
        local nb=$1 xml="$LOG_DIR/nbval_$(echo "$1" | tr '/.' '__').xml" mode=(--nbval -p no:randomly --nbval-sanitize-with tests/nbval_sanitize.cfg)
        [[ $nb == exercises/* ]] && mode=(--nbval-lax -p no:randomly)
        # TINYPAGED_SKIP_ABSENT: a cell tagged needs-vllm-cpu / needs-vllm-router is SKIPPED where that is absent
        # (tinypaged/course/nbval_plugin.py): this machine has neither, and the stored output is the real one's
        TINYPAGED_SKIP_ABSENT=1 TINYPAGED_DEVICE=cuda OMP_NUM_THREADS=4 "$PY" -m pytest -q -rs "${mode[@]}" --nbval-current-env \
            --junitxml="$xml" "$nb" >"$LOG_DIR/nbval_$(echo "$nb" | tr '/.' '__').log" 2>&1
        echo "$nb: rc=$?"
    }
    export -f nbval_one
    rm -f "$LOG_DIR"/nbval_*.xml
    nbval_run() {
        printf '%s\n' "$@" | xargs -P "$NB_JOBS" -I{} bash -c 'nbval_one "$1"' _ {} | tee "$LOG_DIR/nbval_rounds.txt"
        local failed=() nb
        mapfile -t failed < <(grep -v ': rc=0$' "$LOG_DIR/nbval_rounds.txt" | sed 's/: rc=.*//')
        (( ${#failed[@]} )) || return 0
        (( NB_JOBS > 1 )) || return 1
        # A notebook that failed beside others runs once more alone, so that a failure is its own.
        echo "again, one at a time: ${failed[*]}"
        for nb in "${failed[@]}"; do nbval_one "$nb"; done | tee "$LOG_DIR/nbval_alone.txt"
        ! grep -qv ': rc=0$' "$LOG_DIR/nbval_alone.txt"
    }
    export -f nbval_run
    export PY LOG_DIR NB_JOBS
    run_step nbval bash -c 'nbval_run "$@"' _ "${NOTEBOOKS[@]}" "${EXERCISES[@]}"
    # Cells passed / total per notebook, from the junit files (the last run of each notebook counts).
    mapfile -t NB_LINES < <("$PY" - "$LOG_DIR" "$NB_TOTAL" <<'EOF'
import glob, re, sys, xml.etree.ElementTree as ET
log_dir, total = sys.argv[1], int(sys.argv[2])
path = lambda name: re.sub(r"^(notebooks|solutions|exercises)\.", r"\1/", name)  # junit writes folder.file
per = {}
for f in sorted(glob.glob(f"{log_dir}/nbval_*.xml")):
    cells = failed = skipped = 0
    nb = None
    for case in ET.parse(f).iter("testcase"):
        nb = nb or path((case.get("file") or case.get("classname", "")).split("::")[0])
        cells += 1
        failed += case.find("failure") is not None or case.find("error") is not None
        skipped += case.find("skipped") is not None
    if nb:
        per[nb] = (cells - failed - skipped, cells, skipped)
ok = [nb for nb, (p, c, s) in per.items() if p + s == c]
skips = sum(s for *_, s in per.values())
print(f"notebooks: {len(ok)} of {total} passed on the GPU ({sum(p for p, *_ in per.values())} of "
      f"{sum(c for _, c, _ in per.values())} cells, {skips} skipped: NBVAL_SKIP, or a dependency absent here); "
      f"{total - len(per)} gave no result")
for nb, (p, c, s) in sorted(per.items()):
    print(f"  {nb}: {p}/{c} cells" + (f", {s} skipped" if s else "") + ("" if p + s == c else "  FAILED"))
EOF
)
fi
[[ -s $LOG_DIR/nbval_alone.txt ]] && NB_LINES+=("  run again alone after failing beside others: $(sed 's/: rc=0$/ (then passed)/; s/: rc=[0-9]*$/ (failed again)/' "$LOG_DIR/nbval_alone.txt" | xargs)")
(( ${#SKIPPED_NB[@]} )) && NB_LINES+=("  ${#SKIPPED_NB[@]} skipped, SmolLM2 not installed: ${SKIPPED_NB[*]}")

# -- 2. grading: full marks for every solution, nothing for an untouched exercise
grade_all() {
    local out
    out=$(TINYPAGED_DEVICE=cuda "$PY" -m tinypaged.course grade --jobs 4 $(command -v bwrap >/dev/null || echo --unsafe-no-sandbox) solutions/*.ipynb exercises/*.ipynb 2>&1)
    local rc=$?
    echo "$out"
    (( rc == 0 )) || return 1
    local bad=0 nb
    for nb in solutions/*.ipynb; do
        grep -Eq "^$nb: ([0-9]+)/\1$" <<<"$out" || { echo "NOT FULL MARKS: $nb"; bad=1; }
    done
    for nb in exercises/*.ipynb; do
        grep -Eq "^$nb: 0/[1-9]" <<<"$out" || { echo "AN UNTOUCHED EXERCISE SCORED: $nb"; bad=1; }
    done
    return $bad
}
export -f grade_all
run_step grading bash -c grade_all

# -- 3. the engine's speed: tinypaged vs transformers generate_batch on the same GPU
run_step gpu_throughput "$PY" benchmarks/bench_gpu_throughput.py --json "$LOG_DIR/bench_gpu_throughput.json"
fig=$(sed -n '/^random Llama/,/^figures written/p' "$LOG_DIR/gpu_throughput.log" 2>/dev/null | grep -v '^figures written' | sed 's/^/  /')
[[ -n $fig ]] && FIGURES+=("$fig")

# -- 4-5. the kernel: compiled tests, then the benchmark
run_step kernel_tests "$PY" -m pytest tests/test_kernels.py tests/test_triton_backend.py tests/test_fused_elementwise.py tests/test_gpu_sizing.py tests/test_cuda_graphs.py -q -rs -p no:randomly
run_step benchmark "$PY" benchmarks/bench_paged_attention.py "${BENCH_ARGS[@]}"
fig=$(grep -h '^summary:' "$LOG_DIR/benchmark.log" 2>/dev/null | sed 's/^summary: /  /')
[[ -n $fig ]] && FIGURES+=("$fig")

{
    echo
    echo "================================ gpu_check summary ================================"
    cat "$LOG_DIR/versions.txt"
    printf '  %s\n' "${SUMMARY[@]}"
    printf '%s\n' "${NB_LINES[@]}"
    echo "engine and kernel figures (benchmarks/bench_gpu_throughput.py, bench_paged_attention.py ${BENCH_ARGS[*]}):"
    if (( ${#FIGURES[@]} )); then printf '%s\n' "${FIGURES[@]}"; else echo "  (no figures: see the logs)"; fi
    echo "total $(( SECONDS - START ))s; logs in $LOG_DIR; $( (( ${#FAILED[@]} )) && echo "FAILED: ${FAILED[*]}" || echo "all steps passed")"
} | tee "$LOG_DIR/summary.txt"
if [[ -n ${OUT:-} ]]; then
    mkdir -p "$OUT"
    cp "$LOG_DIR/summary.txt" "$OUT/gpu_check_summary.txt"
    [[ -f $LOG_DIR/bench_gpu_throughput.json ]] && cp "$LOG_DIR/bench_gpu_throughput.json" "$OUT/"
    tar -C "$(dirname "$LOG_DIR")" -czf "$OUT/gpu_check_logs.tar.gz" "$(basename "$LOG_DIR")"
fi
(( ${#FAILED[@]} == 0 ))
