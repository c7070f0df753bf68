"""``python -m tinypaged serve`` with the engine core in its own process (the default, as vLLM v1).

The whole command runs as a subprocess on 127.0.0.1 (the ``tiny`` model): the server process does HTTP and
streams, a child process steps the engine; between them ZeroMQ and msgspec messages. Checked across that
boundary: greedy streams equal the offline engine, a disconnect frees the request's blocks at once (read from
the core through /metrics), bad input is a 400 before any work, plug-ins load in the core, and the processes end
together: the core dying gives 503s, error events and a non-zero exit; Ctrl-C drains; no orphan either way.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import time

import httpx
import pytest
from served import metrics, wait_for_health

from tinypaged import LLM, SamplingParams

pytestmark = pytest.mark.skipif(sys.platform == "win32", reason="signals and /proc")

KNOBS = ["--model", "tiny", "--dtype", "float32", "--device", "cpu", "--block-size", "16",
         "--num-gpu-blocks-override", "160", "--max-num-seqs", "16"]

PLUGIN = """
import os
from tinypaged.kv.block_manager import BlockManager

def Manager(spec):  # called where the engine is built: it notes that process's id
    with open(os.environ["TINYPAGED_TEST_PLUGIN_PIDS"], "a") as f:
        f.write(f"{os.getpid()}\\n")
    return BlockManager.from_spec(spec)
"""


def children(pid: int) -> list[int]:
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    stat = f.read()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                out.append(int(entry))
    return out


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


class Served:
    """``python -m tinypaged serve`` on a free port; stderr goes to a file the tests read."""

    def __init__(self, tmp, *flags, env=None, wait=True):
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            self.port = probe.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = tmp / f"serve-{self.port}.log"
        env = dict(os.environ, HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1", **(env or {}))
        env.pop("TINYPAGED_ENABLE_MULTIPROCESSING", None)  # the default: the engine core in its own process
        with open(self.log, "w") as err:
            self.proc = subprocess.Popen([sys.executable, "-m", "tinypaged", "serve", *KNOBS, "--port", str(self.port),
                                          *flags], stdout=subprocess.DEVNULL, stderr=err, env=env)
        if wait:
            self.ready()

    def ready(self) -> "Served":
        wait_for_health(self.proc, self.url, self.log)
        (self.core,) = children(self.proc.pid)
        return self

    def stderr(self) -> str:
        return self.log.read_text()

    def metrics(self) -> dict:
        return metrics(self.url)

    def wait_idle(self) -> dict:
        deadline = time.monotonic() + 60
        while True:
            m = self.metrics()
            if m["vllm:num_requests_running"] == 0 and m["vllm:kv_cache_usage_perc"] == 0:
                return m
            assert time.monotonic() < deadline, m
            time.sleep(0.05)

    def close(self) -> None:
        cores = [self.core] if hasattr(self, "core") else children(self.proc.pid)
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(30)
        for pid in cores:
            if alive(pid):
                os.kill(pid, signal.SIGKILL)


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("process_server")
    (tmp / "my_manager.py").write_text(PLUGIN)
    pids = tmp / "pids.txt"
    srv = Served(tmp, "--kv-cache-manager", f"{tmp / 'my_manager.py'}:Manager",
                 env={"TINYPAGED_TEST_PLUGIN_PIDS": str(pids)})
    srv.plugin_pids = pids
    yield srv
    srv.close()


def post(srv, body, timeout=120):
    return httpx.post(srv.url + "/v1/completions", json=body, timeout=timeout)


def test_two_processes_start_up_line_access_log_and_plugin_in_the_core(served):
    assert served.core != served.proc.pid and alive(served.core)
    # the plug-in was built in the engine core process only (the server only checked that it loads)
    assert served.plugin_pids.read_text().split() == [str(served.core)]
    err = served.stderr()
    assert f"serving model 'tiny' at {served.url} (engine core in its own process (pid {served.core}))" in err, err
    r = post(served, {"prompt": [1, 2, 3], "max_tokens": 2})
    assert r.status_code == 200, r.text
    deadline = time.monotonic() + 30
    while '"POST /v1/completions" 200' not in served.stderr():  # one line once the response has ended
        assert time.monotonic() < deadline, served.stderr()
        time.sleep(0.05)


def test_48_concurrent_streams_equal_offline_greedy(served):
    prompts = [[(7 * i + k) % 200 + 1 for k in range(1 + i % 5)] for i in range(48)]
    offline = LLM("tiny", dtype="float32", device="cpu", block_size=16, num_gpu_blocks_override=160)
    ref = [o.outputs[0].token_ids for o in offline.generate([{"prompt_token_ids": p} for p in prompts],
                                                            SamplingParams(temperature=0, max_tokens=8))]

    async def one(client, i):
        body = {"prompt": prompts[i], "max_tokens": 8, "temperature": 0, "stream": True, "return_token_ids": True}
        ids = []
        async with client.stream("POST", "/v1/completions", json=body) as r:
            assert r.status_code == 200
            async for line in r.aiter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    ids += [t for c in json.loads(line[6:])["choices"] for t in c.get("token_ids", [])]
        return ids

    async def main():
        async with httpx.AsyncClient(base_url=served.url, timeout=300) as client:
            return await asyncio.gather(*(one(client, i) for i in range(48)))

    assert asyncio.run(main()) == ref
    served.wait_idle()


def test_disconnect_aborts_and_frees_blocks_in_the_core(served):
    body = {"prompt": [5, 6, 7], "max_tokens": 1000, "ignore_eos": True, "stream": True, "return_token_ids": True}
    with httpx.stream("POST", served.url + "/v1/completions", json=body, timeout=120) as r:
        lines = r.iter_lines()  # kept: a dropped iterator would close the stream (a hang-up) at once
        next(line for line in lines if line.startswith("data: "))
        during = served.metrics()  # read while the stream is open: the request runs and holds blocks
    assert during["vllm:num_requests_running"] == 1 and during["vllm:kv_cache_usage_perc"] > 0, during
    after = served.wait_idle()  # the hang-up aborted it in the core: nothing running, no block held
    assert after["vllm:num_requests_waiting"] == 0


def test_bad_input_is_a_400_before_any_work_and_the_rest_carries_on(served):
    body = {"prompt": [5, 6, 7], "max_tokens": 40, "ignore_eos": True, "temperature": 0, "stream": True,
            "return_token_ids": True}
    with httpx.stream("POST", served.url + "/v1/completions", json=body, timeout=120) as r:
        lines = r.iter_lines()
        next(line for line in lines if line.startswith("data: "))
        # the engine core's own check comes back as a typed error: nothing was queued
        bad = post(served, {"prompt": [1, 10**8], "max_tokens": 2})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "prompt"
        assert "outside the vocabulary" in bad.json()["error"]["message"]
        too_long = post(served, {"prompt": [1, 2, 3], "max_tokens": 100000})
        err = too_long.json()["error"]
        assert too_long.status_code == 400 and err["param"] == "max_tokens", err
        assert "100000" in err["message"] and "maximum context length is 2048" in err["message"], err
        rest = [json.loads(x[6:]) for x in lines if x.startswith("data: ") and x != "data: [DONE]"]
    assert rest[-1]["choices"][0]["finish_reason"] == "length"
    served.wait_idle()


def test_engine_core_death_gives_503s_error_events_and_a_nonzero_exit(tmp_path):
    srv = Served(tmp_path)
    try:
        body = {"prompt": [5, 6, 7], "max_tokens": 1000, "ignore_eos": True, "stream": True, "return_token_ids": True}
        with httpx.stream("POST", srv.url + "/v1/completions", json=body, timeout=120) as r:
            lines = r.iter_lines()
            next(line for line in lines if line.startswith("data: "))
            os.kill(srv.core, signal.SIGKILL)
            rest = [json.loads(x[6:]) for x in lines if x.startswith("data: ") and x != "data: [DONE]"]  # no hang
        assert "engine core process died" in rest[-1]["error"]["message"], rest[-3:]
        # new requests: 503 while the server winds down (it exits a moment later)
        health = httpx.get(srv.url + "/health", timeout=30)
        refused = post(srv, {"prompt": [1, 2], "max_tokens": 2})
        assert health.status_code == 503 and refused.status_code == 503, (health.text, refused.text)
        assert "engine core process has died" in refused.json()["error"]["message"]
        assert srv.proc.wait(60) != 0
        assert "engine core process (pid" in srv.stderr() and "died" in srv.stderr()
        assert not alive(srv.core)
    finally:
        srv.close()


def test_ctrl_c_drains_and_killing_the_server_leaves_no_engine_core(tmp_path):
    gentle, killed = Served(tmp_path, wait=False), Served(tmp_path, wait=False)  # their start-ups overlap
    try:
        gentle.ready(), killed.ready()
        killed.proc.kill()  # SIGKILL: no clean-up in the server; the core notices its parent is gone
        body = {"prompt": [5, 6, 7], "max_tokens": 24, "ignore_eos": True, "stream": True, "return_token_ids": True}
        with httpx.stream("POST", gentle.url + "/v1/completions", json=body, timeout=120) as r:
            lines = r.iter_lines()
            next(line for line in lines if line.startswith("data: "))
            gentle.proc.send_signal(signal.SIGINT)  # as a terminal's Ctrl-C: the open stream still completes
            rest = [json.loads(x[6:]) for x in lines if x.startswith("data: ") and x != "data: [DONE]"]
        assert rest[-1]["choices"][0]["finish_reason"] == "length"
        assert gentle.proc.wait(120) == 0, gentle.stderr()
        deadline = time.monotonic() + 30
        while alive(gentle.core) or alive(killed.core):
            assert time.monotonic() < deadline, "an engine core outlived its server"
            time.sleep(0.05)
    finally:
        gentle.close()
        killed.close()


# -- choosing the mode, and what crosses to the core (no server) -------------------------------------------------
@pytest.mark.parametrize("flags, env, expected", [
    ([], None, True), ([], "0", False), ([], "1", True), (["--no-multiprocessing"], "1", False),
])
def test_the_mode_follows_the_flag_then_the_environment(monkeypatch, flags, env, expected):
    from tinypaged.__main__ import Parser
    from tinypaged.entrypoints import cli_args

    if env is None:
        monkeypatch.delenv("TINYPAGED_ENABLE_MULTIPROCESSING", raising=False)
    else:
        monkeypatch.setenv("TINYPAGED_ENABLE_MULTIPROCESSING", env)
    ap = Parser()
    cli_args.add_arguments(ap)
    assert cli_args.multiprocessing_enabled(ap.parse_args(flags)) is expected


def test_a_bad_multiprocessing_setting_is_refused_before_the_model_loads(monkeypatch, capsys):
    from tinypaged.__main__ import main
    from tinypaged.entrypoints import core_client, server

    def loaded(*args, **kwargs):
        raise AssertionError("the model was loaded: the setting was not checked first")

    monkeypatch.setattr(server, "build_llm", loaded)
    monkeypatch.setattr(core_client.CoreClient, "start", loaded)
    monkeypatch.setenv("TINYPAGED_ENABLE_MULTIPROCESSING", "yes")
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    assert main(["serve", "--model", "tiny", "--port", str(port)]) == 2
    assert "TINYPAGED_ENABLE_MULTIPROCESSING must be 0 or 1, got 'yes'" in capsys.readouterr().err


def test_plugins_cross_to_the_core_as_their_spec(tmp_path):
    from tinypaged.__main__ import Parser
    from tinypaged.entrypoints import cli_args

    (tmp_path / "my_manager.py").write_text(PLUGIN)
    ap = Parser()
    cli_args.add_arguments(ap)
    args = ap.parse_args(["--kv-cache-manager", f"{tmp_path / 'my_manager.py'}:Manager", "--attention-backend", "sdpa"])
    assert callable(args.kv_cache_manager.obj)  # loaded here once, so a bad one is refused before anything starts
    sent = json.loads(json.dumps(cli_args.core_args(args)))
    assert sent["kv_cache_manager"] == f"{tmp_path / 'my_manager.py'}:Manager" and sent["attention_backend"] == "sdpa"
    args.scheduler_cls = object()  # a caller's own object cannot cross: refused naming the flag
    with pytest.raises(ValueError, match="--scheduler-cls: the engine core process loads plug-ins by their"):
        cli_args.core_args(args)


def test_a_bad_knob_found_in_the_engine_core_is_one_line_and_exit_2():
    """The engine's own knob check runs in the core process: its message comes back to the command line."""
    env = dict(os.environ, HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1")
    env.pop("TINYPAGED_ENABLE_MULTIPROCESSING", None)
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    bad = subprocess.run([sys.executable, "-m", "tinypaged", "serve", "--model", "tiny", "--port", str(port),
                          "--max-num-seqs", "0"], capture_output=True, text=True, timeout=300, env=env)
    assert bad.returncode == 2 and "Traceback" not in bad.stderr, bad.stderr
    assert "python -m tinypaged serve: error: " in bad.stderr and "max_num_seqs" in bad.stderr, bad.stderr
