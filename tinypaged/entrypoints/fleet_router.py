"""The fleet's router (``fleet.py``): one ``vllm-router`` process in front of the replicas.

``Router`` owns that process (``proc``) and its port: ``start`` runs the pinned ``vllm-router`` with a routing
policy and the replicas' URLs (for ``kv_aware`` also their KV-event sources) and waits for its ``/readiness``;
``stop`` ends it (SIGTERM to its group, SIGKILL after 10 s), so that ``start`` can follow with another policy on the
same replicas. The router checks the replicas' health itself every second (one failure marks one unhealthy) and
stops sending it requests. At most one router process runs per ``Router``; the fleet's final stop ends it with
the replicas (``fleet_replicas.stop_processes``).
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

from tinypaged.entrypoints.fleet_replicas import free_port, http_get, log_tail, signal_group, spawn

POLICIES = ("round_robin", "power_of_two", "consistent_hash", "cache_aware", "kv_aware", "random",
            "sticky_least_loaded")


def router_binary() -> str:
    """The ``vllm-router`` launcher beside this Python (the pinned package), else on PATH."""
    here = Path(sys.executable).parent / "vllm-router"
    found = str(here) if here.exists() else shutil.which("vllm-router")
    if not found:
        raise FileNotFoundError("vllm-router is not installed in this environment: pip install vllm-router==0.1.17 "
                                "(pinned in pyproject.toml)")
    return found


class Router:
    """One ``vllm-router`` (see the module docstring); ``url`` is "" until it has started."""

    def __init__(self, log_dir: Path, model: str, block_size: int, router_args: list[str], cwd=None):
        self.log, self.model, self.block_size, self.router_args = log_dir / "router.log", model, block_size, router_args
        self.cwd = cwd  # vllm serve replicas: run from outside the checkout, as they do
        self.proc: subprocess.Popen | None = None
        self.port = 0
        self.url = ""

    def command(self, policy: str, replicas) -> tuple[list[str], dict]:
        """The router's command line and environment, on a new free port, for ``policy`` and ``replicas``."""
        self.port = free_port()
        cmd = [router_binary(), "--host", "127.0.0.1", "--port", str(self.port),
               "--worker-urls", *[r.url for r in replicas], "--policy", policy,
               "--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port()),
               "--health-check-interval-secs", "1", "--health-failure-threshold", "1",
               "--health-success-threshold", "1", "--worker-startup-check-interval", "1",
               "--log-level", "warning"]
        env = dict(os.environ)
        if policy == "kv_aware":  # (the router refuses event sources with another policy)
            for rep in replicas:
                cmd += ["--kv-event-source", f"{rep.url}={rep.events_endpoint}"]
            # kv_aware gets a request's token ids from a replica's /v1/completions/render (vLLM's render API)
            cmd += ["--kv-event-block-size", str(self.block_size), "--kv-event-model", self.model]
        return cmd + self.router_args, env

    def start(self, policy: str, replicas) -> None:
        """Start the router and wait up to 60 s for its ``/readiness``; RuntimeError if it exits, TimeoutError."""
        cmd, env = self.command(policy, replicas)
        self.proc = spawn(cmd, self.log, env=env, cwd=self.cwd)
        self.url = f"http://127.0.0.1:{self.port}"
        deadline = time.monotonic() + 60
        while http_get(self.url + "/readiness", 1.0)[0] != 200:
            code = self.proc.poll()
            if code is not None:
                raise RuntimeError(f"vllm-router exited with {code} while starting; the last lines of "
                                   f"{self.log}:\n{self.tail()}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"vllm-router was not ready after 60 s; its log:\n{self.tail()}")
            time.sleep(0.2)

    def stop(self) -> None:
        """End the router process (SIGTERM to its group, SIGKILL after 10 s), to start another."""
        if self.proc is not None:
            signal_group(self.proc, signal.SIGTERM)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                signal_group(self.proc, signal.SIGKILL)
                self.proc.wait(5)

    def tail(self, lines: int = 8) -> str:
        return log_tail(self.log, lines)
