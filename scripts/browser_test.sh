#!/usr/bin/env bash
# The browser test (tests/test_browser.py): every lesson run in JupyterLab in a headless Chromium,
# and the static site of the course opened page by page (tests/test_site.py),
# with screenshots in ${TINYPAGED_BROWSER_OUT:-build/browser-test}. scripts/test.sh calls this.
#
# Chromium comes from the distribution (Debian/Ubuntu: apt-get install chromium); Playwright, which
# drives it, is pyproject.toml's "browser" extra and is installed into .venv here on first use.
# Without a Chromium this prints one line and succeeds, unless TINYPAGED_REQUIRE_BROWSER=1 (CI).
set -euo pipefail
cd "$(dirname "$0")/.."
export PATH="$PWD/.venv/bin:$PATH"

chromium=${TINYPAGED_CHROMIUM:-$(command -v chromium || command -v chromium-browser || true)}
if [ -z "$chromium" ] || [ ! -x "$chromium" ]; then
  msg="browser test skipped: no Chromium found; to run it, install one (sudo apt-get install chromium) or set TINYPAGED_CHROMIUM=/path/to/chromium"
  if [ "${TINYPAGED_REQUIRE_BROWSER:-0}" = 1 ]; then echo "${msg/skipped/FAILED}" >&2; exit 1; fi
  echo "$msg"
  exit 0
fi
if ! python -c "import playwright" 2>/dev/null; then
  extra=$(python -c "import tomllib; print(' '.join(tomllib.load(open('pyproject.toml', 'rb'))['project']['optional-dependencies']['browser']))")
  echo "== installing the browser test's Python packages: $extra"
  python -m pip install -q $extra
fi
export TINYPAGED_CHROMIUM="$chromium"
# ... and the static site (tests/test_site.py: every page, image and link of build/site in Chromium)
python -m pytest -q -p no:randomly tests/test_browser.py tests/test_site.py \
  -k "test_lesson_runs_in_jupyterlab or test_site_in_chromium" "$@"
