"""``EngineLoop`` (in-process) and ``CoreClient`` (the engine core in its own process) are both ``EngineClient``s:
the one interface the server's routes use (vLLM's ``EngineCoreClient``: ``InprocClient`` / ``AsyncMPClient``)."""
from __future__ import annotations

import inspect
from types import SimpleNamespace

import pytest

from tinypaged.entrypoints.core_client import CoreClient
from tinypaged.entrypoints.engine_client import EngineClient
from tinypaged.entrypoints.engine_loop import EngineLoop

METHODS = ["start", "next_id", "submit", "abort", "engine_metrics", "drain", "stop"]


def _params(fn) -> list[tuple[str, object]]:
    return [(p.name, p.default) for p in inspect.signature(fn).parameters.values()]


def test_the_protocol_lists_what_the_routes_use():
    members = {n for n in vars(EngineClient) if not n.startswith("_")} | set(EngineClient.__annotations__)
    assert members == set(METHODS) | {"num_in_flight", "max_queued", "observer"}


@pytest.mark.parametrize("cls", [EngineLoop, CoreClient])
def test_both_clients_offer_every_method_with_the_same_parameters(cls):
    for name in METHODS:
        assert _params(getattr(cls, name)) == _params(getattr(EngineClient, name)), f"{cls.__name__}.{name}"
    assert isinstance(cls.num_in_flight, property)


def test_unstarted_clients_are_engine_clients():
    loop = EngineLoop(SimpleNamespace(), text_of=None)  # neither starts anything until start()
    client = CoreClient({"model": "tiny"})
    for obj in (loop, client):
        assert isinstance(obj, EngineClient) and obj.num_in_flight == 0 and obj.next_id("cmpl") == "cmpl-0"
