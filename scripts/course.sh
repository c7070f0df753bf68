#!/usr/bin/env bash
# Open the course: set up everything (once), then start JupyterLab on notebooks/.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh
.venv/bin/python -m tinypaged prepare
extra=()
[ "$(id -u)" = 0 ] && extra+=(--allow-root)   # containers often run as root; Jupyter refuses that by default
exec .venv/bin/jupyter lab --notebook-dir=. "${extra[@]}" notebooks/01_contiguous_kv_cache.ipynb "$@"
