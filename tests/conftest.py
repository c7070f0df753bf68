"""Fixtures shared by the test modules (opt in with ``pytestmark = pytest.mark.usefixtures(...)``)."""

import functools

import pytest
import torch

import tinypaged.engine.llm_engine as llm_engine

# One model per (name, dtype, device, seed): weights are read-only at inference, so engines can share them.
_cached_load_model = functools.lru_cache(maxsize=None)(llm_engine.load_model)


@pytest.fixture(scope="module")
def shared_weights():
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(llm_engine, "load_model", _cached_load_model)
        yield


@pytest.fixture(scope="module")
def one_thread():
    """The "tiny" model's ops are small: one torch thread is faster on a shared CPU (restored after)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)
