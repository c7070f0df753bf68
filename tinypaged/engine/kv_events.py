"""KV cache events in vLLM's format: ``tinypaged serve --kv-events-config '<json>'`` (stage 9).

vLLM's engine can tell the world what its prefix cache holds: after each step it publishes the blocks it
cached (``BlockStored``) and the cached blocks it reused for other data (``BlockRemoved``) on a ZeroMQ PUB
socket (``vllm/distributed/kv_events.py``, ``vllm/config/kv_events.py``). A router that subscribes
(``vllm-router --policy kv_aware --kv-event-source WORKER_URL=tcp://HOST:PORT``) then routes on the replicas'
real caches instead of guessing them from the prompts it routed. tinypaged publishes the same messages:

* the flag and its JSON fields are vLLM's: ``enable_kv_cache_events``, ``publisher`` (``"zmq"`` or ``"null"``;
  default ``"zmq"`` when events are on), ``endpoint`` (``tcp://*:5557``), ``replay_endpoint``,
  ``buffer_steps``, ``hwm``, ``max_queue_size``, ``topic``. A bad field is a one-line error naming
  ``--kv-events-config`` and the field, before the model loads (``parse_config``).
* the wire format is vLLM's: each message is three frames, ``topic`` (UTF-8), the sequence number (8 bytes,
  big-endian, from 0) and the payload, a msgpack ``KVEventBatch``: the array ``[ts, events,
  data_parallel_rank]``; each event a map tagged ``"type": "BlockStored" | "BlockRemoved" |
  "AllBlocksCleared"``. ``BlockStored`` carries the new blocks' hashes, the hash of the block before the first
  of them (``parent_block_hash``, None at the start of a prompt), their token ids and the block size, as vLLM's
  ``BlockPool.cache_full_blocks`` fills them; ``medium`` is ``"GPU"``, vLLM's name for the engine's own KV
  tier (its CPU build says the same). The replay socket (``replay_endpoint``, a ROUTER) answers a request
  ``[8-byte start sequence]`` with the buffered messages from there on and an end marker (sequence -1).
* block hashes are tinypaged's own (SHA-256 chained on the parent, ``kv/block_pool.py``): a consumer uses
  them as opaque keys (vllm-router hashes the token ids itself and uses the engine's hashes to chain a
  block to its parent and to find a removed block).

Where the events come from: the prefix cache's own event list (``tinypaged/kv/events.py``), filled only when the
engine is built with ``enable_kv_cache_events`` (``build_llm`` sets it from this flag): the paged KV manager
records a block whose hash enters the cache when it registers it (``BlockStored``; it knows the block's tokens and
its parent's hash there), and its free queue, a subclass of the lessons' ``PrefixCache`` (graded code, so left as
it is), records a cached block handed out again, its prefix forgotten (``BlockRemoved``). The engine drains the
list after each step and hands it to ``EventSink``, which sends the step's events as one batch, as vLLM v1's
scheduler takes its KV cache manager's events after each step. That is vLLM's granularity: one event per block
whose hash enters or leaves the cache, a prefix-cache hit stores nothing. ``AllBlocksCleared`` goes out when the
publisher closes (the replica's cache is gone; a course addition: vLLM sends it on ``/reset_prefix_cache``,
which tinypaged has not).

Endpoints (one course difference): vLLM binds an endpoint with ``*`` or ``::`` (and ``ipc://``, ``inproc://``)
and connects to any other. tinypaged also *binds* a loopback address (``tcp://127.0.0.1:P``,
``tcp://localhost:P``), so a replica on one machine can publish on 127.0.0.1 only.
"""

from __future__ import annotations

import atexit
import dataclasses
import json
import logging
import queue
import threading
import time
from collections import deque
from typing import Any, Union

import msgspec

from tinypaged.kv import events as records

logger = logging.getLogger("tinypaged")

FLAG = "--kv-events-config"
MEDIUM_GPU = "GPU"  # vLLM's name for the engine's own KV tier
END_SEQ = (-1).to_bytes(8, "big", signed=True)  # the replay's end marker


# -- the schema (vLLM's field names and encoding; decoded by vLLM's own classes in tests/test_kv_events.py) ----
BlockHash = Union[bytes, int]


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    """An event is a map tagged with its class name under ``"type"``."""


class BlockStored(KVCacheEvent):
    block_hashes: list[BlockHash]
    parent_block_hash: BlockHash | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None  # no default: always on the wire, as vLLM's decoder requires
    medium: str | None
    lora_name: str | None
    group_idx: int | None = None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[BlockHash]
    medium: str | None
    group_idx: int | None = None


class AllBlocksCleared(KVCacheEvent):
    pass


class KVEventBatch(EventBatch):
    events: list[Union[BlockStored, BlockRemoved, AllBlocksCleared]]


def decode(payload: bytes) -> KVEventBatch:
    """A payload frame back into a ``KVEventBatch`` (a subscriber's side)."""
    return msgspec.msgpack.decode(payload, type=KVEventBatch)


# -- the config (vLLM's KVEventsConfig) ------------------------------------------------------------------------
COUNT_MAX = 2**31 - 1  # the counts' bound: ZeroMQ takes hwm as a C int (a larger one overflows there)

@dataclasses.dataclass
class KVEventsConfig:
    enable_kv_cache_events: bool = False
    publisher: str | None = None  # "zmq" when events are on, else "null" (vLLM's default)
    endpoint: str = "tcp://*:5557"
    replay_endpoint: str | None = None
    buffer_steps: int = 10_000
    hwm: int = 100_000
    max_queue_size: int = 100_000
    topic: str = ""

    def __post_init__(self):
        if self.publisher is None:
            self.publisher = "zmq" if self.enable_kv_cache_events else "null"

    @property
    def enabled(self) -> bool:
        return self.enable_kv_cache_events and self.publisher == "zmq"


def _check_endpoint(name: str, value) -> None:
    if not isinstance(value, str) or not value.startswith(("tcp://", "ipc://", "inproc://")):
        raise ValueError(f"{FLAG}: {name} must be a ZeroMQ address such as tcp://*:5557 or tcp://127.0.0.1:5557, "
                         f"got {json.dumps(value)}")
    if value.startswith("tcp://"):
        host, _, port = value[len("tcp://"):].rpartition(":")
        if not host or not port.isdigit() or not 0 <= int(port) <= 65535:
            raise ValueError(f"{FLAG}: {name} {value!r} needs tcp://HOST:PORT with a port in 0..65535")


def parse_config(text: str) -> KVEventsConfig:
    """``--kv-events-config``'s JSON -> a ``KVEventsConfig``; anything wrong is a ValueError naming the flag and
    the field (argparse turns it into a one-line error and exit 2, before the model loads)."""
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{FLAG} is not valid JSON: {exc.msg} at column {exc.colno} (give a JSON object such as "
                         f"'{{\"enable_kv_cache_events\": true, \"endpoint\": \"tcp://127.0.0.1:5557\"}}')") from None
    if not isinstance(obj, dict):
        raise ValueError(f"{FLAG} must be a JSON object, got a JSON {type(obj).__name__}")
    fields = {f.name: f for f in dataclasses.fields(KVEventsConfig)}
    for name, value in obj.items():
        if name not in fields:
            raise ValueError(f"{FLAG}: unknown field {name!r}; the fields are {', '.join(fields)}")
        if name == "enable_kv_cache_events" and not isinstance(value, bool):
            raise ValueError(f"{FLAG}: enable_kv_cache_events must be true or false, got {json.dumps(value)}")
        if name == "publisher" and value not in ("zmq", "null"):
            raise ValueError(f"{FLAG}: publisher must be \"zmq\" or \"null\", got {json.dumps(value)}")
        if name in ("buffer_steps", "hwm", "max_queue_size") and (
                isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise ValueError(f"{FLAG}: {name} must be an integer >= 1, got {json.dumps(value)}")
        if name in ("buffer_steps", "hwm", "max_queue_size") and value > COUNT_MAX:  # ZeroMQ's hwm is a C int
            raise ValueError(f"{FLAG}: {name} must be an integer in 1..{COUNT_MAX} (2**31 - 1), got {value}")
        if name == "topic" and not isinstance(value, str):
            raise ValueError(f"{FLAG}: topic must be a string, got {json.dumps(value)}")
        if name == "endpoint" or (name == "replay_endpoint" and value is not None):
            _check_endpoint(name, value)
    return KVEventsConfig(**obj)


def is_bind_endpoint(endpoint: str) -> bool:
    """vLLM's rule (a wildcard host, ``ipc://``, ``inproc://`` binds) plus the course's: a loopback host binds."""
    if "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://")):
        return True
    host = endpoint[len("tcp://"):].rpartition(":")[0]
    return host == "localhost" or host.startswith("127.")


# -- the publisher ---------------------------------------------------------------------------------------------
class ZmqEventPublisher:
    """A PUB socket (and an optional ROUTER for replays) served by one background thread, so the engine's step
    never waits on the network. ``publish(batch)`` queues; past ``max_queue_size`` queued batches it drops the
    batch with a warning (the step goes on). ``close()`` sends ``AllBlocksCleared`` and closes the sockets."""

    def __init__(self, config: KVEventsConfig, data_parallel_rank: int = 0):
        import zmq

        self.config, self.rank = config, data_parallel_rank
        self._queue: queue.Queue = queue.Queue(maxsize=config.max_queue_size)
        self._buffer: deque = deque(maxlen=config.buffer_steps)  # (seq, payload) for replays
        self._topic = config.topic.encode("utf-8")
        self._encoder = msgspec.msgpack.Encoder()
        self._seq = 0
        self._ctx = zmq.Context()
        self._pub = self._ctx.socket(zmq.PUB)
        self._pub.set_hwm(config.hwm)
        self._pub.setsockopt(zmq.LINGER, 0)
        self._replay = None
        try:
            if is_bind_endpoint(config.endpoint):
                self._pub.bind(config.endpoint)
            else:
                self._pub.connect(config.endpoint)
            if config.replay_endpoint is not None:
                self._replay = self._ctx.socket(zmq.ROUTER)
                self._replay.setsockopt(zmq.LINGER, 0)
                self._replay.bind(config.replay_endpoint)
        except zmq.ZMQError as exc:
            self._close_sockets()
            raise ValueError(f"{FLAG}: cannot open {config.endpoint!r} / {config.replay_endpoint!r}: {exc} "
                             f"(another process on that port? pick another endpoint)") from None
        # the addresses bound (a port 0 is the one the system picked)
        self.endpoint = self._pub.getsockopt_string(zmq.LAST_ENDPOINT) or config.endpoint
        self.replay_endpoint = self._replay.getsockopt_string(zmq.LAST_ENDPOINT) if self._replay else None
        self.num_published = 0
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="tinypaged-kv-events", daemon=True)
        self._thread.start()

    def publish(self, batch: EventBatch) -> None:
        if self._closed:
            raise RuntimeError("the KV event publisher is closed")
        if batch.data_parallel_rank is None:
            batch.data_parallel_rank = self.rank
        try:
            self._queue.put_nowait(batch)
        except queue.Full:
            logger.warning("KV events: %d batches queued (max_queue_size); dropping one", self.config.max_queue_size)

    def close(self, timeout: float = 2.0) -> None:
        """Say the cache is gone (``AllBlocksCleared``), send what is queued (up to ``timeout``), close."""
        if self._closed:
            return
        self.publish(KVEventBatch(ts=time.time(), events=[AllBlocksCleared()]))
        self._closed = True
        self._queue.put(None)
        self._thread.join(timeout)
        self._close_sockets()

    def _close_sockets(self) -> None:
        for sock in (self._pub, self._replay):
            if sock is not None:
                sock.close(linger=500)  # time for the last messages (AllBlocksCleared) to leave
        self._ctx.term()

    def _run(self) -> None:
        while True:
            if self._replay is not None and self._replay.poll(0):
                try:
                    self._serve_replay()
                except Exception:  # noqa: BLE001 - a bad replay request must not stop publishing
                    logger.exception("KV events: a replay request failed")
            try:
                batch = self._queue.get(timeout=0.05)
            except queue.Empty:
                continue
            if batch is None:
                return
            payload = self._encoder.encode(batch)
            seq = self._seq.to_bytes(8, "big")
            try:
                self._pub.send_multipart((self._topic, seq, payload))
            except Exception:  # noqa: BLE001 - keep the thread alive; the batch stays replayable
                logger.exception("KV events: publishing failed")
            self._buffer.append((self._seq, payload))
            self._seq += 1
            self.num_published += 1

    def _serve_replay(self) -> None:
        frames = self._replay.recv_multipart()
        if len(frames) != 3:
            logger.warning("KV events: a replay request needs [identity, '', start sequence], got %d frames",
                           len(frames))
            return
        client, _, start = frames
        first = int.from_bytes(start, "big")
        for seq, payload in list(self._buffer):
            if seq >= first:
                self._replay.send_multipart((client, b"", self._topic, seq.to_bytes(8, "big"), payload))
        self._replay.send_multipart((client, b"", b"", END_SEQ, b""))


# -- the engine's records -> vLLM's events ------------------------------------------------------------------
class EventSink:
    """What the engine calls after a step with its KV manager's records (``tinypaged.kv.events``): converts them
    to vLLM's event structs and publishes them as one batch."""

    def __init__(self, publisher, medium: str = MEDIUM_GPU):
        self.publisher, self.medium = publisher, medium

    def __call__(self, recorded: list) -> None:
        out = []
        for r in recorded:
            if isinstance(r, records.BlockStored):
                out.append(BlockStored(block_hashes=list(r.block_hashes), parent_block_hash=r.parent_block_hash,
                                       token_ids=list(r.token_ids), block_size=r.block_size, lora_id=None,
                                       medium=self.medium, lora_name=None))
            elif isinstance(r, records.BlockRemoved):
                out.append(BlockRemoved(block_hashes=list(r.block_hashes), medium=self.medium))
        if out:
            self.publisher.publish(KVEventBatch(ts=time.time(), events=out))


def attach(engine, config: KVEventsConfig, publisher=None):
    """Publish ``engine``'s KV events after each of its steps: the engine must have been built with
    ``enable_kv_cache_events=True`` (its prefix cache then records them). Returns the publisher (``close()`` it to
    stop); ``publisher`` replaces the ZeroMQ one (tests)."""
    if getattr(engine.kv, "events", None) is None:
        raise ValueError(f"{FLAG}: KV events describe the prefix cache: build the engine with "
                         f"--enable-prefix-caching (enable_kv_cache_events=True on the paged KV manager)")
    publisher = publisher or ZmqEventPublisher(config)
    engine.set_kv_event_sink(EventSink(publisher))
    engine.kv_event_publisher = publisher
    atexit.register(publisher.close)  # a process that ends normally says its cache is gone
    return publisher
