#!/usr/bin/env bash
# The whole test suite, from a fresh clone: set up, then package tests, nbval on every notebook, and the
# browser test (every lesson in JupyterLab; skipped, with one line saying so, where no Chromium is found).
# The real vLLM (CPU build) gets its own environment, .venv-vllm (about 3.5 GB, 5-10 minutes to build the
# first time): tests/test_vllm_parity.py and notebook 06's vLLM cells run on it, so it is built here.
# vLLM's share of a run: the parity tests start 6 vLLM engines, notebook 06 starts 10 (eager, no compile);
# docs/RESULTS.md ("The test suite") gives the measured times. CI's job limit must cover the first build.
#
# Each step runs on two pytest-xdist workers (the machine's two cores), one torch thread each: two 2-thread
# processes on two cores wait on each other's threads and run slower than one thread each. vLLM binds one core
# (TINYPAGED_VLLM_CORES): two bound OpenMP threads beside a second worker made its eager steps 10-20x slower.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh
bash scripts/vllm_env.sh
export PATH="$PWD/.venv/bin:$PATH" PYTHONHASHSEED=0 MPLBACKEND=Agg TOKENIZERS_PARALLELISM=false
export HF_HUB_OFFLINE=1 TRANSFORMERS_NO_ADVISORY_WARNINGS=1 OMP_NUM_THREADS=1 TINYPAGED_VLLM_CORES=1
python -m tinypaged prepare                      # convert SmolLM2 once (cached afterwards)
python -m tinypaged.course check             # exercises must match their solutions
# --dist loadfile: a test file stays on one worker (its module fixtures, e.g. the one vLLM subprocess, run once)
# (the browser tests run in the last step; tests/test_site.py builds the site with scripts/site.sh)
python -m pytest -q -n 2 --dist loadfile tests --deselect tests/test_browser.py::test_lesson_runs_in_jupyterlab \
  --deselect tests/test_site.py::test_site_in_chromium "$@"
# Notebooks and solutions: strict output comparison (a notebook stays on one worker: its cells share a kernel;
# notebook 06, the longest, is named first so that it starts first). Exercises: run, outputs not compared.
python -m pytest -q -p no:randomly -n 2 --dist loadfile --nbval --nbval-current-env --nbval-sanitize-with tests/nbval_sanitize.cfg \
  notebooks/06_serving_and_knobs.ipynb notebooks solutions
python -m pytest -q -n 2 --dist loadfile --nbval-lax --nbval-current-env exercises
bash scripts/site.sh                                  # the static site (build/site/index.html), from the stored outputs
bash scripts/browser_test.sh -n 2 --dist worksteal     # one JupyterLab and Chromium per worker
