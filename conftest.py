"""Root conftest: nbval ignores stderr (logs, warnings), and tinypaged is imported before anything
else so TRITON_INTERPRET is decided before triton is (see tinypaged/triton_mode.py)."""

import tinypaged  # noqa: F401


def pytest_collectstart(collector):
    if collector.fspath and collector.fspath.ext == ".ipynb":
        collector.skip_compare += ("stderr",)
