#!/usr/bin/env bash
# Download, here, the wheels a GPU box without package registries needs to run nbval (scripts/gpu_check.sh):
# nbval, nbformat, ipykernel, ipywidgets, the server's packages and what they need, and gguf (scripts/gpu_carry.sh converts the
# carried SmolLM2 GGUF there with it), for CPython 3.12 on manylinux x86_64, into .whl/ (git-ignored), with
# .whl/requirements.txt naming them. gpu_check.sh installs them there, offline.
#
# Versions are the ones in this checkout's .venv (the tested stack), so run scripts/setup_env.sh first.
# Packages the GPU image already has (torch's image: pytest, packaging, pygments, psutil, ...) are left out:
# list them in GPU_HAS below (or pass more with GPU_HAS_EXTRA="name name").
set -euo pipefail
cd "$(dirname "$0")/.."

# openai, fastapi, uvicorn, pydantic, starlette, msgspec: notebook 08 (the server and its official client) and
# the engine core's messages; an H200 run without them failed 8 of notebook 08's 10 cells
ROOTS=(nbval nbformat ipykernel ipywidgets gguf openai fastapi uvicorn pydantic starlette msgspec)
GPU_HAS="attrs coverage iniconfig packaging pluggy psutil pygments pytest python-dateutil six typing-extensions pyyaml jinja2 markupsafe numpy tqdm ${GPU_HAS_EXTRA:-}"
PYVER=${GPU_PYTHON_VERSION:-3.12}

[ -x .venv/bin/python ] || { echo "gpu_wheels: no .venv here: run bash scripts/setup_env.sh first" >&2; exit 1; }
rm -rf .whl && mkdir -p .whl
# NAME==VERSION for the roots and everything they need on Linux/CPython $PYVER, minus what the GPU has.
.venv/bin/python - "$PYVER" "$GPU_HAS" "${ROOTS[@]}" >.whl/requirements.txt <<'EOF'
import importlib.metadata as md
import re
import sys

from packaging.markers import Marker
from packaging.requirements import Requirement

pyver, has, roots = sys.argv[1], set(sys.argv[2].split()), sys.argv[3:]
env = {"python_version": pyver, "python_full_version": pyver + ".0", "sys_platform": "linux",
       "platform_system": "Linux", "platform_machine": "x86_64", "implementation_name": "cpython",
       "platform_python_implementation": "CPython", "os_name": "posix", "extra": ""}
norm = lambda n: re.sub(r"[-_.]+", "-", n).lower()
found, stack = {}, list(roots)
while stack:
    name = norm(stack.pop())
    if name in found or name in has:
        continue
    dist = md.distribution(name)
    found[name] = dist.version
    for line in dist.requires or []:
        req = Requirement(line)
        if req.marker is None or req.marker.evaluate(env):
            stack.append(req.name)
for name in sorted(found):
    print(f"{name}=={found[name]}")
EOF
PLATFORMS=()
for p in manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_26_x86_64 manylinux_2_24_x86_64 \
         manylinux_2_17_x86_64 manylinux2014_x86_64 manylinux1_x86_64 manylinux_2_5_x86_64; do
    PLATFORMS+=(--platform "$p")
done
while read -r req; do
    .venv/bin/python -m pip download -q --no-deps --only-binary=:all: --python-version "$PYVER" \
        --implementation cp "${PLATFORMS[@]}" -d .whl "$req" \
      || .venv/bin/python -m pip download -q --no-deps --only-binary=:all: --python-version "$PYVER" \
        --implementation py -d .whl "$req"
done <.whl/requirements.txt
echo "gpu_wheels: $(ls .whl/*.whl | wc -l) wheels, $(du -sh .whl | cut -f1) in .whl/ (carry it with the working tree)"
