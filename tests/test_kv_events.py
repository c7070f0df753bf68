"""KV events in vLLM's format (``--kv-events-config``, tinypaged/engine/kv_events.py): the flag's checks, the
events a shared-prefix batch and an eviction produce, the ZeroMQ framing and replay, and the payloads decoded by
vLLM's own event classes in .venv-vllm."""

import json
import os
import subprocess
import time

import pytest
import zmq

from tinypaged import SamplingParams
from tinypaged.__main__ import Parser, main
from tinypaged.engine import kv_events
from tinypaged.entrypoints import cli_args
from tinypaged.kv.block_pool import hash_chain
from tinypaged.lab import vllm_side

pytestmark = pytest.mark.usefixtures("one_thread")
BS = 4
BASE = list(range(1, 14))  # 13 tokens: 3 full blocks of 4
SHARED = BASE[:8] + [50, 51, 52, 53, 54]  # shares 2 blocks with BASE
LONG = list(range(100, 140))  # 10 blocks: the 12-block cache must evict
GREEDY = SamplingParams(max_tokens=2, temperature=0)


def _args(config: str, *more):
    ap = Parser(prog="serve")
    cli_args.add_arguments(ap)
    return ap.parse_args(["--model", "tiny", "--block-size", str(BS), "--num-gpu-blocks-override", "12",
                          "--enable-prefix-caching", "--kv-events-config", config, *more])


def count_until_sent(pub):
    """Count the batches handed to ``pub``; the returned ``settled()`` waits (30 s at most) until the publisher's
    thread has sent them all (it counts a batch only once sent) and returns ``num_published``."""
    handed, publish = [0], pub.publish

    def counted(batch):
        handed[0] += 1
        publish(batch)

    def settled() -> int:
        deadline = time.monotonic() + 30
        while pub.num_published < handed[0] and time.monotonic() < deadline:
            time.sleep(0.01)
        return pub.num_published

    pub.publish = counted
    return settled


@pytest.fixture(scope="module")
def run():
    """``serve``'s engine built from its flags (build_llm), three generate calls, every message received."""
    config = json.dumps({"enable_kv_cache_events": True, "endpoint": "tcp://127.0.0.1:0", "topic": "kv",
                         "replay_endpoint": "tcp://127.0.0.1:0"})
    llm = cli_args.build_llm(_args(config))
    pub = llm.llm_engine.kv_event_publisher
    settled = count_until_sent(pub)
    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"kv")
    sub.connect(pub.endpoint)
    # a PUB drops what it sends before a subscriber has joined: wait until one probe batch arrives
    for _ in range(100):
        pub.publish(kv_events.KVEventBatch(ts=0.0, events=[]))
        if sub.poll(50):
            break
    else:
        pytest.fail("the subscriber never joined the publisher")
    while sub.poll(200):
        sub.recv_multipart()
    first_seq = settled()
    steps = []
    for prompt in (BASE, SHARED, LONG):
        llm.generate([{"prompt_token_ids": prompt}], GREEDY)
        steps.append(settled())
    cache = llm.llm_engine.kv.allocator
    replay = pub.replay_endpoint
    messages = []  # by sequence number: a late probe batch (the publisher sends from its own thread) is skipped
    while (not messages or int.from_bytes(messages[-1][1], "big") < steps[-1] - 1) and sub.poll(5000):
        m = sub.recv_multipart()
        if int.from_bytes(m[1], "big") >= first_seq:
            messages.append(m)
    yield dict(llm=llm, pub=pub, messages=messages, first_seq=first_seq, steps=steps, cache=cache, replay=replay,
               ctx=ctx)
    pub.close()
    sub.close(linger=0)
    ctx.term()


def _events(run, upto=None):
    msgs = run["messages"] if upto is None else run["messages"][:upto - run["first_seq"]]
    return [e for m in msgs for e in kv_events.decode(m[2]).events]


def test_frames_are_topic_sequence_payload(run):
    msgs = run["messages"]
    assert msgs and all(len(m) == 3 and m[0] == b"kv" for m in msgs)
    seqs = [int.from_bytes(m[1], "big") for m in msgs]
    assert seqs == list(range(run["first_seq"], run["first_seq"] + len(msgs)))
    assert all(len(m[1]) == 8 for m in msgs)
    batch = kv_events.decode(msgs[0][2])
    assert batch.data_parallel_rank == 0 and batch.ts > 0


def test_block_stored_as_vllm_fills_it(run):
    first = _events(run, run["steps"][0])
    stored = [e for e in first if isinstance(e, kv_events.BlockStored)]
    want = hash_chain(BASE, BS)  # 3 full blocks (the 13th token has no full block)
    assert [h for e in stored for h in e.block_hashes] == want
    assert stored[0].parent_block_hash is None and stored[0].token_ids == BASE[:12]
    assert stored[0].block_size == BS and stored[0].medium == "GPU" and stored[0].lora_id is None
    # the second prompt shares two blocks: they are hits, only its third block is stored, chained to the second
    second = _events(run, run["steps"][1])[len(first):]
    assert [type(e).__name__ for e in second] == ["BlockStored"]
    assert second[0].block_hashes == [hash_chain(SHARED, BS)[2]]
    assert second[0].parent_block_hash == want[1] and second[0].token_ids == SHARED[8:12]


def test_eviction_gives_block_removed(run):
    before = _events(run, run["steps"][1])
    stored = {h for e in before if isinstance(e, kv_events.BlockStored) for h in e.block_hashes}
    third = _events(run)[len(before):]
    removed = [h for e in third if isinstance(e, kv_events.BlockRemoved) for h in e.block_hashes]
    assert removed, "a 10-block prompt in a 12-block cache holding 4 cached blocks must evict"
    assert set(removed) <= stored
    assert not set(removed) & set(run["cache"].index)  # what was reported removed is no longer findable
    long_hashes = hash_chain(LONG, BS)
    assert [h for e in third if isinstance(e, kv_events.BlockStored) for h in e.block_hashes][:10] == long_hashes


def test_replay_sends_buffered_batches_then_end(run):
    ctx = run["ctx"]
    req = ctx.socket(zmq.DEALER)
    req.connect(run["replay"])
    start = run["steps"][0]
    req.send_multipart([b"", start.to_bytes(8, "big")])
    got = []
    for _ in range(100):
        assert req.poll(5000), "no replay answer"
        _, topic, seq, payload = req.recv_multipart()
        if seq == kv_events.END_SEQ:
            break
        got.append((int.from_bytes(seq, "big"), payload))
    req.close(linger=0)
    live = {int.from_bytes(m[1], "big"): m[2] for m in run["messages"]}
    assert got and got[0][0] == start
    assert all(live[s] == p for s, p in got if s in live)


def test_vllm_decodes_the_payloads(run, tmp_path):
    py = vllm_side.python()
    if py is None:
        pytest.skip(vllm_side.MISSING)
    payloads = [m[2].hex() for m in run["messages"]]
    (tmp_path / "in.json").write_text(json.dumps(payloads))
    proc = subprocess.run([str(py), "-c", VLLM_DECODE, str(tmp_path / "in.json")], cwd=tmp_path, text=True,
                          capture_output=True, timeout=240, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-2000:]
    theirs = json.loads(proc.stdout.strip().splitlines()[-1])
    ours = [_plain(kv_events.decode(bytes.fromhex(p))) for p in payloads]
    assert theirs["batches"] == ours
    assert {"BlockStored", "BlockRemoved"} <= {e["type"] for b in ours for e in b["events"]}


def test_close_sends_all_blocks_cleared():
    llm = cli_args.build_llm(_args(json.dumps({"enable_kv_cache_events": True, "endpoint": "tcp://127.0.0.1:0"})))
    pub = llm.llm_engine.kv_event_publisher
    settled = count_until_sent(pub)
    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(pub.endpoint)
    for _ in range(100):
        pub.publish(kv_events.KVEventBatch(ts=0.0, events=[]))
        if sub.poll(50):
            break
    while sub.poll(200):
        sub.recv_multipart()
    pub.close()
    assert sub.poll(5000)
    assert [type(e).__name__ for e in kv_events.decode(sub.recv_multipart()[2]).events] == ["AllBlocksCleared"]
    sub.close(linger=0)
    ctx.term()


@pytest.mark.parametrize("config, field", [
    ('{"enable_kv_cache_events": true, "endpont": "tcp://*:5557"}', "endpont"),
    ('{"enable_kv_cache_events": "yes"}', "enable_kv_cache_events"),
    ('{"enable_kv_cache_events": true, "publisher": "kafka"}', "publisher"),
    ('{"enable_kv_cache_events": true, "endpoint": "localhost:5557"}', "endpoint"),
    ('{"enable_kv_cache_events": true, "buffer_steps": 0}', "buffer_steps"),
    ('{"enable_kv_cache_events": true,', "not valid JSON"),
    ('[true]', "JSON object"),
])
def test_bad_config_is_one_line_exit_2_before_the_model(config, field, capsys, monkeypatch):
    import tinypaged

    monkeypatch.setattr(tinypaged, "LLM", lambda *a, **k: pytest.fail("the model was loaded"))
    with pytest.raises(SystemExit) as exc:
        main(["serve", "--model", "tiny", "--port", "1", "--enable-prefix-caching", "--kv-events-config", config])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "--kv-events-config" in err and field in err and len(err.strip().splitlines()) == 1


def test_events_need_prefix_caching(capsys, monkeypatch):
    import tinypaged

    monkeypatch.setattr(tinypaged, "LLM", lambda *a, **k: pytest.fail("the model was loaded"))
    assert main(["serve", "--model", "tiny", "--port", str(_free_port()), "--kv-events-config",
                 '{"enable_kv_cache_events": true}']) == 2
    err = capsys.readouterr().err
    assert "--kv-events-config" in err and "--enable-prefix-caching" in err


def _free_port():
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _plain(batch) -> dict:
    """A batch as plain JSON (hashes in hex), the same function of either side's classes."""
    def ev(e):
        d = {"type": type(e).__name__}
        for f in ("block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium", "lora_name"):
            if hasattr(e, f):
                v = getattr(e, f)
                d[f] = [h.hex() for h in v] if f == "block_hashes" else (v.hex() if isinstance(v, bytes) else v)
        return d
    return {"ts": batch.ts, "rank": batch.data_parallel_rank, "events": [ev(e) for e in batch.events]}


# Runs in .venv-vllm: vLLM's own kv_events.py, its classes as vLLM defines them. The module's other imports (config,
# logger, network helpers) pull in all of vLLM (25 s on a loaded 2-core machine); the classes need none of them, so
# they are stubbed, and the full import is the fallback if the file changes shape.
VLLM_DECODE = r"""
import json, logging, sys, sysconfig, types, importlib.util, pathlib
import msgspec
src = pathlib.Path(sysconfig.get_paths()["purelib"]) / "vllm" / "distributed" / "kv_events.py"
stubs = {"vllm": {}, "vllm.config": {}, "vllm.config.kv_events": {"KVEventsConfig": object},
         "vllm.logger": {"init_logger": logging.getLogger}, "vllm.utils": {},
         "vllm.utils.network_utils": {n: None for n in ("get_ip", "get_tcp_uri", "is_valid_ipv6_address",
                                                         "split_zmq_path")},
         "vllm.v1": {}, "vllm.v1.core": {}, "vllm.v1.core.kv_cache_utils": {"ExternalBlockHash": bytes | int}}
try:
    saved = {k: sys.modules.get(k) for k in stubs}
    for name, attrs in stubs.items():
        m = types.ModuleType(name); m.__dict__.update(attrs); m.__path__ = []; sys.modules[name] = m
    spec = importlib.util.spec_from_file_location("vllm_kv_events", src)
    mod = importlib.util.module_from_spec(spec); spec.loader.exec_module(mod)
    how = "vllm/distributed/kv_events.py (its imports stubbed)"
except Exception:
    for name in stubs:
        sys.modules.pop(name, None)
    import vllm.distributed.kv_events as mod
    how = "vllm.distributed.kv_events"
dec = msgspec.msgpack.Decoder(type=mod.KVEventBatch)
out = []
for h in json.load(open(sys.argv[1])):
    b = dec.decode(bytes.fromhex(h))
    evs = []
    for e in b.events:
        d = {"type": type(e).__name__}
        for f in ("block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium", "lora_name"):
            if hasattr(e, f):
                v = getattr(e, f)
                d[f] = [x.hex() for x in v] if f == "block_hashes" else (v.hex() if isinstance(v, bytes) else v)
        evs.append(d)
    out.append({"ts": b.ts, "rank": b.data_parallel_rank, "events": evs})
print(json.dumps({"how": how, "batches": out}))
"""


def test_the_prefix_cache_records_only_when_asked():
    from tinypaged import LLM
    from tinypaged.config import EngineConfig
    from tinypaged.kv import events as records
    from tinypaged.kv.block_pool import PrefixCache

    with pytest.raises(ValueError, match="enable_kv_cache_events.*enable_prefix_caching"):
        EngineConfig(model="tiny", enable_kv_cache_events=True)
    quiet = LLM("tiny", device="cpu", block_size=BS, num_gpu_blocks_override=12, enable_prefix_caching=True)
    assert quiet.llm_engine.kv.events is None and type(quiet.llm_engine.kv.allocator) is PrefixCache
    assert quiet.llm_engine.kv.take_events() == []
    llm = LLM("tiny", device="cpu", block_size=BS, num_gpu_blocks_override=12, enable_prefix_caching=True,
              enable_kv_cache_events=True)
    got = []
    llm.llm_engine.set_kv_event_sink(got.append)  # each step's records, as the server's publisher gets them
    llm.generate([{"prompt_token_ids": BASE}], GREEDY)
    stored = [r for batch in got for r in batch]
    assert [type(r) for r in stored] == [records.BlockStored]
    assert stored[0].block_hashes == hash_chain(BASE[:12], BS) and stored[0].token_ids == BASE[:12]
    assert stored[0].parent_block_hash is None and stored[0].block_size == BS
    llm.generate([{"prompt_token_ids": LONG}], GREEDY)  # 10 more blocks in a 12-block cache: evictions
    assert any(isinstance(r, records.BlockRemoved) for batch in got for r in batch)
