"""The requests ``CoreClient`` has in flight to the engine core process: the bookkeeping of the server's side.

``RequestTable`` owns, for each request from ``book`` until its end (vLLM's front end keeps the same in
``OutputProcessor.request_states``):

* ``live``: request id -> its ``Submission`` (the caller's ``deliver``);
* ``count``: how many are live (always ``len(live)``), read without the lock by ``num_in_flight`` and ``drain``;
* ``texts``: request id -> (its params, {sample index: ``SampleText``}), the samples' text, read and grown by the
  reader thread (``ServerText.text_of``), created and dropped here with ``live``;
* ``pending``: request id (until ``Added`` / ``Rejected``) or metrics ticket (until ``MetricsReply``) -> the
  ``Future`` its caller waits on;
* ``lock``, which guards all of these and also every send on the input socket (a ZeroMQ socket is not
  thread-safe), so that booking a request and sending it is one step, and a failed send leaves nothing booked.

Invariant: a request leaves ``live`` once, under the lock (``settle`` for a rejection, ``finish``, ``fail``,
``fail_all``), and whoever takes it out delivers its final events; so a submitted request ends exactly once, and
no request is live after ``fail_all``. Nothing is sent to a core that has died (``core_dead``).
"""

from __future__ import annotations

import itertools
import threading
from concurrent.futures import Future

from tinypaged.entrypoints import engine_core as msg
from tinypaged.entrypoints.engine_loop import EngineDead, Event, Overloaded, Submission
from tinypaged.sequence import FinishReason


class RequestTable:
    """The requests in flight to the core and the replies awaited (see the module docstring)."""

    def __init__(self, channel, core_dead):
        self.channel = channel  # CoreChannel: sent on under self.lock only
        self._core_dead = core_dead  # () -> bool: the core process has died
        self.lock = threading.Lock()  # guards live, count, texts, pending and the input socket
        self.live: dict[str, Submission] = {}
        self.count = 0
        self.texts: dict[str, tuple] = {}  # request id -> (its params, {sample index: SampleText})
        self.pending: dict[object, Future] = {}  # request id / metrics ticket -> its reply
        self._tickets = itertools.count()

    def book(self, request_id: str, sub: Submission, params, data: bytes, max_num_seqs: int,
             max_queued: int) -> Future:
        """Book a request and send its encoded ``Add``; the returned future gets ``Added`` or ``Rejected`` (or
        ``EngineDead``). Raises Overloaded past the queue bound, ValueError for an id in use; nothing stays booked
        if it raises."""
        fut: Future = Future()
        with self.lock:
            if self.count >= max_num_seqs + max_queued:
                raise Overloaded(f"{self.count} requests are in flight; the queue bound is max_num_seqs "
                                 f"({max_num_seqs}) + max_queued ({max_queued})")
            if request_id in self.live or request_id in self.pending:
                raise ValueError(f"Request id {request_id!r} is already in use")
            self.count += 1
            self.live[request_id] = sub
            self.texts[request_id] = (params, {})
            self.pending[request_id] = fut
            try:
                self.channel.send_bytes(data)
            except BaseException:  # nothing was sent: unbook, so no failure can leak a slot
                self.count -= 1
                self.live.pop(request_id, None)
                self.texts.pop(request_id, None)
                self.pending.pop(request_id, None)
                raise
        return fut

    def settle(self, m) -> None:
        """The core's verdict on an ``Add`` (``Added`` or ``Rejected``: then the request is unbooked)."""
        with self.lock:
            fut = self.pending.pop(m.request_id, None)
            if isinstance(m, msg.Rejected) and self.live.pop(m.request_id, None) is not None:
                self.count -= 1
                self.texts.pop(m.request_id, None)
        if fut is not None:
            fut.set_result(m)

    def ask_metrics(self) -> Future:
        """Send ``GetMetrics``; the returned future gets the values (or ``EngineDead``)."""
        fut: Future = Future()
        with self.lock:
            ticket = ("metrics", next(self._tickets))
            self.pending[ticket] = fut
            self.channel.send(msg.GetMetrics(ticket[1]))
        return fut

    def answer_metrics(self, m) -> None:
        with self.lock:
            fut = self.pending.pop(("metrics", m.ticket), None)
        if fut is not None:
            fut.set_result(m.values)

    def send_if_live(self, message, request_id: str | None = None) -> None:
        """Send ``message`` unless the core has died (or, given ``request_id``, that request has ended)."""
        with self.lock:
            if not self._core_dead() and (request_id is None or request_id in self.live):
                self.channel.send(message)

    def finish(self, request_id: str) -> tuple[Submission | None, dict]:
        """Unbook a request the core finished: (its submission, or None if it had ended here; its samples)."""
        with self.lock:
            sub = self.live.pop(request_id, None)
            if sub is not None:
                self.count -= 1
            _, samples = self.texts.pop(request_id, (None, {}))
        return sub, samples

    def fail(self, request_id: str, why: str) -> None:
        """End one request here with an error event and abort it in the core (its blocks freed)."""
        with self.lock:
            sub = self.live.pop(request_id, None)
            self.texts.pop(request_id, None)
            if sub is None:
                return
            self.count -= 1
            if not self._core_dead():
                self.channel.send(msg.Abort([request_id]))
        sub.deliver(Event(request_id, 0, "", [], True, None, None, why))

    def fail_all(self, message: str, reason) -> None:
        """End every request (a final event each; ``reason`` ABORT: no error) and every awaited reply
        (``EngineDead``: a waiting ``submit`` raises it instead of its request getting an event)."""
        with self.lock:
            live, self.live, self.count, self.texts = self.live, {}, 0, {}
            pending, self.pending = self.pending, {}
        for fut in pending.values():
            if not fut.done():
                fut.set_result(EngineDead(message))
        for rid, sub in live.items():
            if rid in pending:  # its submit raises instead
                continue
            error = None if reason == FinishReason.ABORT else message
            sub.deliver(Event(rid, 0, "", [], True, reason, None, error))
