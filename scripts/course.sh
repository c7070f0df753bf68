#!/usr/bin/env bash
# Open the course: set up everything (once), then start JupyterLab on notebooks/.
#   bash scripts/course.sh --with-vllm   also builds .venv-vllm, the real vLLM beside the course (optional)
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh
.venv/bin/python -m tinypaged prepare
if [ "${1:-}" = "--with-vllm" ]; then
  shift
  bash scripts/vllm_env.sh
elif [ ! -f .venv-vllm/.vllm-installed ]; then
  echo "Optional: notebook 06 can run the real vLLM beside tinypaged: bash scripts/course.sh --with-vllm" \
       "(or bash scripts/vllm_env.sh) installs it in .venv-vllm (about 3.5 GB, 5-10 minutes, once)."
fi
extra=()
[ "$(id -u)" = 0 ] && extra+=(--allow-root)   # containers often run as root; Jupyter refuses that by default
exec .venv/bin/jupyter lab --notebook-dir=. "${extra[@]}" notebooks/01_contiguous_kv_cache.ipynb "$@"
