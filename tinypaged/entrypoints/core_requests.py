"""The requests ``CoreClient`` has in flight to the engine core process: the bookkeeping of the server's side.

``RequestTable`` owns, for each request from ``book`` until its end (vLLM's front end keeps the same in
``OutputProcessor.request_states`` and its ``ParentRequest``\\ s):

* ``live``: the core's request id -> its ``Submission`` (the caller's ``deliver``; for a fan-out child, one that
  re-addresses the child's events to its parent's sample);
* ``count``: how many of the callers' requests are live (a fan-out counts once), read without the lock by
  ``num_in_flight`` and ``drain``;
* ``texts``: the core's request id -> (its params, {sample index: ``SampleText``}), the samples' text, read and grown
  by the reader thread (``ServerOutputs.text_of``), created and dropped here with ``live``;
* ``fanouts``: the caller's request id -> its ``FanOut``, and ``child_of``: child id -> (its ``FanOut``, its sample
  index), for a request of ``n > 1`` samples under ``parallel_sampling="fanout"``;
* ``pending``: metrics ticket -> the ``Future`` its caller waits on (until ``MetricsReply``);
* ``lock``, which guards all of these and also every send on the input socket (a ZeroMQ socket is not
  thread-safe), so that booking a request and sending it is one step, and a failed send leaves nothing booked.

Adds are fire-and-forget: ``book`` sends and returns; a ``Rejected`` from the core ends the request (``reject``)
with a ``Rejection`` as its only event. Invariant: a request leaves the table once, under the lock (``reject``,
``finish``, ``fail``, ``fail_all``), and whoever takes it out delivers its final events; so a submitted request ends
exactly once, and no request is live after ``fail_all``. Nothing is sent to a core that has died (``core_dead``).
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import threading
from concurrent.futures import Future

from tinypaged.entrypoints import engine_core as msg
from tinypaged.entrypoints.engine_client import Rejection
from tinypaged.entrypoints.engine_loop import EngineDead, Event, Overloaded, Submission
from tinypaged.sequence import FinishReason


def child_id(index: int, request_id: str) -> str:
    """Fan-out child ``index`` of ``request_id`` in the core (vLLM v1's ``ParentRequest.get_child_info``)."""
    return f"{index}_{request_id}"


class FanOut:
    """A request of ``n > 1`` samples under ``parallel_sampling="fanout"``: ``n`` child requests in the core (vLLM v1's
    ``ParentRequest``), child ``k`` (``child_id(k, request_id)``, ``n=1``, seed ``seed + k``) being sample ``k``.

    Its children's events are the parent's (``deliver``: child k's sample 0 -> sample k); it ends once, when its last
    child has ended, or when one fails or is rejected (the rest are aborted). ``heard``: an event has reached the
    caller (a rejection after that is a failure, not a ``Rejection``). ``choices`` and the latencies are the finished
    children's, for the observer's one ``on_finish``."""

    def __init__(self, request_id: str, sub: Submission, n: int):
        self.request_id, self.sub = request_id, sub
        self.child_ids = [child_id(k, request_id) for k in range(n)]
        self.open = set(self.child_ids)  # children not yet ended
        self.heard = False
        self.choices: dict[int, msg.Choice] = {}
        self.time_to_first_token: float | None = None
        self.e2e_latency: float | None = None

    def deliver(self, index: int, ev: Event) -> None:
        self.heard = True
        self.sub.deliver(dataclasses.replace(ev, request_id=self.request_id, index=index))

    def record(self, index: int, choice: msg.Choice, f: msg.Finished) -> None:
        """Child ``index`` finished with ``choice``: the parent's first token is its children's first, its end their
        last."""
        self.choices[index] = msg.Choice(index, choice.finish_reason, choice.stop_reason)
        if f.time_to_first_token is not None:
            self.time_to_first_token = min(f.time_to_first_token, self.time_to_first_token or f.time_to_first_token)
        if f.e2e_latency is not None:
            self.e2e_latency = max(f.e2e_latency, self.e2e_latency or 0.0)


class RequestTable:
    """The requests in flight to the core and the replies awaited (see the module docstring)."""

    def __init__(self, channel, core_dead):
        self.channel = channel  # CoreChannel: sent on under self.lock only
        self._core_dead = core_dead  # () -> bool: the core process has died
        self.lock = threading.Lock()  # guards live, count, texts, fanouts, child_of, pending and the input socket
        self.live: dict[str, Submission] = {}
        self.count = 0
        self.texts: dict[str, tuple] = {}  # core request id -> (its params, {sample index: SampleText})
        self.fanouts: dict[str, FanOut] = {}
        self.child_of: dict[str, tuple[FanOut, int]] = {}
        self.pending: dict[object, Future] = {}  # metrics ticket -> its reply
        self._tickets = itertools.count()

    def book(self, sub: Submission, adds: list[tuple[str, object, bytes]], max_num_seqs: int,
             max_queued: int) -> None:
        """Book request ``sub`` and send ``adds``, its encoded ``Add``\\ s as (the core's request id, params, bytes):
        one under its own id, or a fan-out's children (each id ``child_id(k, ...)``). Raises Overloaded past the
        queue bound, ValueError for an id in use; nothing stays booked (or running in the core) if it raises."""
        rid = sub.request_id
        fan = None if [a[0] for a in adds] == [rid] else FanOut(rid, sub, len(adds))
        with self.lock:
            if self.count >= max_num_seqs + max_queued:
                raise Overloaded(f"{self.count} requests are in flight; the queue bound is max_num_seqs "
                                 f"({max_num_seqs}) + max_queued ({max_queued})")
            used = sorted(i for i in {rid, *(a[0] for a in adds)} if i in self.live or i in self.fanouts)
            if used:
                raise ValueError(f"Request id {used[0]!r} is already in use")
            self.count += 1
            if fan is not None:
                self.fanouts[rid] = fan
            for k, (cid, params, _) in enumerate(adds):
                self.texts[cid] = (params, {})
                if fan is None:
                    self.live[cid] = sub
                else:
                    self.live[cid] = Submission(cid, functools.partial(fan.deliver, k), sub.num_prompt_tokens, 1)
                    self.child_of[cid] = (fan, k)
            sent = []
            try:
                for cid, _, data in adds:
                    self.channel.send_bytes(data)
                    sent.append(cid)
            except BaseException:  # unbook, so no failure can leak a slot; abort the children already sent
                self._unbook(rid, [a[0] for a in adds])
                if sent:
                    try:
                        self.channel.send(msg.Abort(sent))
                    except Exception:  # noqa: BLE001 - the socket is gone: so is the core's side
                        pass
                raise

    def _unbook(self, request_id: str | None, core_ids) -> None:
        """Under the lock: forget a caller's request (its slot given back if it was booked; None: none) and the
        core's requests ``core_ids``."""
        if request_id is not None and (self.fanouts.pop(request_id, None) is not None or request_id in self.live):
            self.count -= 1
        for cid in core_ids:
            self.live.pop(cid, None)
            self.texts.pop(cid, None)
            self.child_of.pop(cid, None)

    def _end_fanout(self, fan: FanOut) -> None:
        """Under the lock: end a fan-out now (its slot given back) and abort its children still in the core."""
        rest = [cid for cid in fan.child_ids if cid in self.live]
        if self.fanouts.get(fan.request_id) is fan:
            self._unbook(fan.request_id, fan.child_ids)
        if rest and not self._core_dead():
            self.channel.send(msg.Abort(rest))

    def reject(self, m: msg.Rejected) -> None:
        """The core refused an ``Add``: the request ends with a ``Rejection`` (a fan-out: its other children are
        aborted; once it has sent events, the rejection fails it instead)."""
        with self.lock:
            sub = self.live.get(m.request_id)
            if sub is None:
                return
            fan, k = self.child_of.get(m.request_id, (None, 0))
            if fan is None:
                self._unbook(m.request_id, [m.request_id])
            else:
                self._unbook(None, [m.request_id])  # not in the core: the others are aborted
                self._end_fanout(fan)
                sub = fan.sub
        if fan is not None and fan.heard:
            why = f"sample {k} was refused by the engine: {m.kind}: {m.message}"
            sub.deliver(Event(sub.request_id, 0, "", [], True, None, None, why))
        else:
            sub.deliver(Rejection(sub.request_id, 0, "", [], True, None, None, m.message, m.kind))

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

    def abort(self, request_id: str) -> None:
        """Abort a caller's request in the core (a fan-out: its children still running); it ends when the core says
        so. A no-op once it has ended, or once the core has died."""
        with self.lock:
            fan = self.fanouts.get(request_id)
            ids = [request_id] if fan is None else [cid for cid in fan.child_ids if cid in self.live]
            if ids and ids[0] in self.live and not self._core_dead():
                self.channel.send(msg.Abort(ids))

    def stop_sample(self, request_id: str, index: int) -> None:
        """The server's stop string finished sample ``index`` of the core's request ``request_id``: free it there
        (``StopSample``; a fan-out child is aborted, as vLLM's front end aborts it)."""
        if request_id in self.child_of:
            self.send_if_live(msg.Abort([request_id], stopped=True), request_id)
        else:
            self.send_if_live(msg.StopSample(request_id, index), request_id)

    def finish(self, request_id: str, failed: bool = False) -> tuple[Submission | None, dict, FanOut | None]:
        """Unbook a request the core finished: (its submission, or None if it had ended here; its samples; for a
        fan-out child, its ``FanOut``, which has ended once its ``open`` is empty, or at once if the child
        ``failed``: its siblings are aborted)."""
        with self.lock:
            sub = self.live.pop(request_id, None)
            _, samples = self.texts.pop(request_id, (None, {}))
            fan, _ = self.child_of.pop(request_id, (None, 0))
            if fan is not None:
                fan.open.discard(request_id)
                if failed or not fan.open:
                    self._end_fanout(fan)
            elif sub is not None:
                self.count -= 1
        return sub, samples, fan

    def fail(self, request_id: str, why: str) -> None:
        """End one request here with an error event and abort it in the core (its blocks freed); a fan-out child
        fails its parent."""
        with self.lock:
            sub = self.live.get(request_id)
            if sub is None:
                return
            fan, _ = self.child_of.get(request_id, (None, 0))
            if fan is not None:
                self._end_fanout(fan)
                sub = fan.sub
            else:
                self._unbook(request_id, [request_id])
                if not self._core_dead():
                    self.channel.send(msg.Abort([request_id]))
        sub.deliver(Event(sub.request_id, 0, "", [], True, None, None, why))

    def fail_all(self, message: str, reason) -> None:
        """End every request (a final event each; ``reason`` ABORT: no error) and every awaited reply
        (``EngineDead``)."""
        with self.lock:
            live, fanouts, children = self.live, self.fanouts, self.child_of
            self.live, self.fanouts, self.child_of, self.count, self.texts = {}, {}, {}, 0, {}
            pending, self.pending = self.pending, {}
        for fut in pending.values():
            if not fut.done():
                fut.set_result(EngineDead(message))
        subs = [sub for rid, sub in live.items() if rid not in children] + [f.sub for f in fanouts.values()]
        error = None if reason == FinishReason.ABORT else message
        for sub in subs:
            sub.deliver(Event(sub.request_id, 0, "", [], True, reason, None, error))
