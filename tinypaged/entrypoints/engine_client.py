"""``EngineClient``: the one interface the server's routes use to reach an engine, wherever it runs.

vLLM v1 has one ``EngineCoreClient`` interface with an in-process implementation (``InprocClient``) and
multi-process ones (``SyncMPClient``, ``AsyncMPClient``). tinypaged has the same two sides:

* ``EngineLoop`` (``engine_loop.py``): the engine in this process, stepped by one background thread
  (``--no-multiprocessing``, ``TINYPAGED_ENABLE_MULTIPROCESSING=0``, ``create_app(llm)``);
* ``CoreClient`` (``core_client.py``): the engine core in its own process, over ZeroMQ (``serve``'s default).

Both are ``EngineClient``s (checked in ``tests/test_engine_client.py``); the routes call nothing else of them. Their
contract:

* ``submit`` adds a request (a prompt as ``{"prompt_token_ids": [...]}``): it raises ``ValueError`` / ``TypeError``
  (a bad request), ``Overloaded`` (past ``max_num_seqs + max_queued`` in flight), ``ShuttingDown`` or ``EngineDead``
  before anything is queued; otherwise the request's outputs stream to ``deliver`` as ``Event``\\ s (each sample's
  newly settled text and token ids), and it gets exactly one final event per sample (finished, aborted, or failed
  with ``error``), or a single ``Rejection``;
* who runs the engine's own checks when: ``EngineLoop`` runs them inside ``submit`` (which raises); ``CoreClient``'s
  adds are fire-and-forget (vLLM v1's), so the core's checks (``InputProcessor``: a prompt that can never fit in
  the KV cache, a priority under a non-priority policy, a plug-in's rule) come back after ``submit`` returned, as
  the request's first and only event, a ``Rejection``. A caller that must refuse a rejected request before it
  answers (the server's routes: a 400, not a 200 and then an error) waits for each request's first event;
* ``abort`` ends a request wherever it is (a no-op once it has ended); ``drain`` stops taking requests and waits for
  those in flight; ``stop`` shuts the engine down, ending what is left.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol, runtime_checkable

from tinypaged.entrypoints.engine_loop import Event

if TYPE_CHECKING:
    from tinypaged.entrypoints.engine_loop import Submission


@dataclass
class Rejection(Event):
    """A request the engine refused after ``submit`` had returned: its one and only event (``finished``, ``error``
    the engine's message, ``kind`` the class of what its checks raised: ValueError, TypeError or
    NotImplementedError). Nothing of the request was queued, and it has already ended (``num_in_flight``)."""

    kind: str = "ValueError"

    def exception(self) -> Exception:
        """What a ``submit`` that checked at once would have raised."""
        return {"TypeError": TypeError, "NotImplementedError": NotImplementedError}.get(self.kind, ValueError)(
            self.error)


@runtime_checkable
class EngineClient(Protocol):
    """What ``EngineLoop`` and ``CoreClient`` both offer (see the module docstring for the contract)."""

    max_queued: int  # requests that may wait beyond the max_num_seqs that run (the server may set it)
    observer: object  # None, or the server's metrics: on_step, on_token_gap, on_finish (set by the server)

    @property
    def num_in_flight(self) -> int:
        """Requests submitted and not yet ended."""

    def start(self) -> EngineClient:
        """Start stepping (the thread, or the core process); returns itself."""

    def next_id(self, prefix: str) -> str:
        """A fresh request id, ``prefix-N``."""

    def submit(self, request_id: str, prompt, params, deliver: Callable[[Event], None],
               priority: int = 0) -> Submission:
        """Add one request; its outputs stream to ``deliver``."""

    def abort(self, request_id: str) -> None:
        """End a request wherever it is."""

    def engine_metrics(self) -> dict:
        """The engine's ``get_metrics()``, read between two steps."""

    def drain(self, timeout: float = 30.0) -> bool:
        """Stop taking requests; True once none is in flight (within ``timeout``)."""

    def stop(self) -> None:
        """Shut the engine down; open requests end (aborted)."""
