#!/usr/bin/env bash
# The course as a static web site, built from the notebooks' stored outputs (nothing is run, nothing is
# fetched): build/site/index.html, one page per lesson, the docs, and search. Open that file in a browser.
#
# Sphinx with MyST-NB and the Furo theme (pyproject.toml's "site" extra) are installed on first use into an
# environment of the site's own, build/site-venv (about 250 MB: reading the course needs neither torch nor the
# model), always: building the site never installs anything into the course's .venv (reading the course must not
# change the learner's environment). The configuration is docs/site/ (conf.py says what is done to the stored
# outputs that would load from a CDN, and strips nbval's markers from the code shown); the build runs with network
# connections refused. Sources are copied into build/site-src (docs/site/index.md and README.md for the landing
# page, notebooks/, four docs) with their times kept, so a second run rebuilds only what changed.
# scripts/test.sh calls this; tests/test_site.py checks it.
set -euo pipefail
cd "$(dirname "$0")/.."
venv=build/site-venv
PY=${PYTHON:-python3}
mkdir -p build
exec 9>build/.site.lock  # two builds at once would share build/site-src (and the environment)
if command -v flock >/dev/null 2>&1; then flock 9; fi
if [ ! -x $venv/bin/python ]; then
  "$PY" -c 'import sys; sys.exit(0 if sys.version_info >= (3, 11) else "the site build needs Python 3.11 or newer")'
  "$PY" -m venv $venv
fi
VPY=$venv/bin/python

# The pinned tools, once (a stamp records which pins were installed).
extra=$("$VPY" -c "import tomllib; print(' '.join(tomllib.load(open('pyproject.toml', 'rb'))['project']['optional-dependencies']['site']))")
stamp=$venv/.tinypaged-site-installed
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$extra" ]; then
  echo "== installing the site's tools into $venv: $extra"
  "$VPY" -m pip install -q $extra
  echo "$extra" > "$stamp"
fi

src=build/site-src out=build/site
rm -rf "$src"
mkdir -p "$src/notebooks" "$src/docs"
cp -p README.md docs/site/index.md "$src/"
cp -p notebooks/*.ipynb "$src/notebooks/"
cp -p docs/GLOSSARY.md docs/ARCHITECTURE.md docs/VLLM_MAP.md docs/RESULTS.md "$src/docs/"

# A changed configuration (or tool) rebuilds every page; otherwise Sphinx rebuilds what changed.
config=$(cat $(find docs/site -type f ! -name "*.pyc" | sort) <(echo "$extra") | sha256sum | cut -c1-16)
fresh=()
[ -f build/site-doctrees/.config ] && [ "$(cat build/site-doctrees/.config)" = "$config" ] || fresh=(-E)
# -W: a warning (a broken cross-reference, an unreadable notebook, an output that cannot be shown) fails the build.
"$VPY" docs/site/build.py -b html -q -W --keep-going "${fresh[@]}" -c docs/site -d build/site-doctrees "$src" "$out"
echo "$config" > build/site-doctrees/.config
echo "site: $out/index.html"
