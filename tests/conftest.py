"""Fixtures shared by the test modules (opt in with ``pytestmark = pytest.mark.usefixtures(...)``)."""

import functools

import pytest
import torch

import tinypaged.engine.core as engine_core

# One model per (name, dtype, device, seed): weights are read-only at inference, so engines can share them.
_cached_load_model = functools.lru_cache(maxsize=None)(engine_core.load_model)


@pytest.fixture(scope="module")
def shared_weights():
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(engine_core, "load_model", _cached_load_model)
        yield


@pytest.fixture(scope="module")
def one_thread():
    """The "tiny" model's ops are small: one torch thread is faster on a shared CPU (restored after)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)
