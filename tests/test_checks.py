"""Every registered check passes on the implementation under test (see adapters.py)."""

import pytest

from tinypaged import checks
from adapters import implementation

checks._load_all()


@pytest.mark.parametrize("name", sorted(checks.REGISTRY))
def test_check_passes(name):
    status, msg = checks.evaluate(name, implementation(name))
    assert status == checks.PASS, f"{name}: {status} {msg}"
