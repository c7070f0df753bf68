#!/usr/bin/env bash
# Open the course: set up everything (once), then start JupyterLab on notebooks/.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh
.venv/bin/python -m tinypaged prepare
exec .venv/bin/jupyter lab --notebook-dir=. notebooks/01_contiguous_kv_cache.ipynb "$@"
