"""pytest plugin (enabled in pyproject.toml): nbval does not compare stderr (logs, warnings).

It also imports tinypaged before anything else so TRITON_INTERPRET is decided before triton
is imported (see tinypaged/triton_mode.py)."""

import tinypaged  # noqa: F401


def pytest_collectstart(collector):
    if getattr(collector, "fspath", None) is not None and collector.fspath.ext == ".ipynb":
        collector.skip_compare += ("stderr",)
