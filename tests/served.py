"""Helpers for tests that start ``python -m tinypaged serve`` as a subprocess on 127.0.0.1."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx


def start_server(flags: list[str], log: Path, **popen) -> tuple[subprocess.Popen, str]:
    """``python -m tinypaged serve --model tiny FLAGS`` on a free 127.0.0.1 port (offline, one torch thread; the
    engine core in its own process unless a flag says otherwise), its stderr in ``log``: (the process, its url)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    env = dict(os.environ, HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1")
    env.pop("TINYPAGED_ENABLE_MULTIPROCESSING", None)
    with open(log, "w") as err:
        proc = subprocess.Popen([sys.executable, "-m", "tinypaged", "serve", "--model", "tiny", *flags,
                                 "--no-access-log", "--port", str(port)],
                                stdout=subprocess.DEVNULL, stderr=err, env=env, **popen)
    return proc, f"http://127.0.0.1:{port}"


def wait_for_health(proc: subprocess.Popen, url: str, log: Path, seconds: float = 300) -> None:
    """Until ``url``/health answers 200; fails with the server's log if it exits first or never answers."""
    deadline = time.monotonic() + seconds
    while True:
        assert proc.poll() is None, log.read_text()
        assert time.monotonic() < deadline, "the server never answered"
        try:
            if httpx.get(url + "/health", timeout=5).status_code == 200:
                return
        except httpx.TransportError:
            time.sleep(0.1)


def metrics(url: str) -> dict:
    """``/metrics``'s vLLM gauges and counters by name (no histogram buckets, labels dropped)."""
    out = {}
    for line in httpx.get(url + "/metrics", timeout=30).text.splitlines():
        if line.startswith("vllm:") and "_bucket" not in line:
            out[line.split("{")[0].split(" ")[0]] = float(line.rsplit(" ", 1)[1])
    return out
