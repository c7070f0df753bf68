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

Its parts: ``Fleet`` (here) checks the knobs and composes the two process owners, ``ReplicaGroup``
(``fleet_replicas.py``: the replicas' processes, their health and ``/metrics``; the process-group plumbing that
leaves no process behind) and ``Router`` (``fleet_router.py``: the ``vllm-router`` process and its policy).

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
import signal
import sys
import tempfile
import time
from pathlib import Path

from tinypaged.entrypoints.fleet_replicas import Replica, ReplicaGroup, core_sets, stop_processes
from tinypaged.entrypoints.fleet_replicas import http_get as _get  # noqa: F401 - tests probe URLs with it
from tinypaged.entrypoints.fleet_router import POLICIES, Router


class Fleet:
    """N ``tinypaged serve`` replicas and ``vllm-router`` in front (see the module docstring).

    It validates the knobs and composes two owners, calling each only through its methods: the replicas'
    processes are its ``ReplicaGroup``'s (``fleet_replicas.py``: start, health, kill, metrics), the router's process
    its ``Router``'s (``fleet_router.py``: start with a policy, stop, restart). After ``stop`` (which ``with``, a
    failed ``start`` and a failed ``restart_router`` call) no process of the fleet is left, nor its temporary log
    folder."""

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
        self._group = ReplicaGroup(model, self.serve_args, self.cores, self.log_dir, self.kv_events, self.block_size,
                                   engine, vllm_python)
        # vLLM runs outside the checkout: the repository's kernels/ folder would shadow a package it imports
        self._router = Router(self.log_dir, model, self.block_size, self.router_args,
                              cwd=str(self.log_dir) if engine == "vllm" else None)

    def _flag_value(self, flag: str, default: int) -> int:
        if flag in self.serve_args:
            i = self.serve_args.index(flag)
            if i + 1 < len(self.serve_args) and self.serve_args[i + 1].isdigit():
                return int(self.serve_args[i + 1])
        return default

    # -- the context manager and what it holds --------------------------------------------------------
    def __enter__(self) -> "Fleet":
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    @property
    def replicas(self) -> list[Replica]:
        return self._group.members

    @property
    def replica_urls(self) -> list[str]:
        return [r.url for r in self.replicas]

    @property
    def router(self):
        """The router's process (a ``subprocess.Popen``), None before ``start``."""
        return self._router.proc

    @property
    def router_port(self) -> int:
        return self._router.port

    @property
    def url(self) -> str:
        """The router's URL ("" before ``start``)."""
        return self._router.url

    # -- start ----------------------------------------------------------------------------------------
    def start(self) -> "Fleet":
        if self.replicas:  # started already (start() then ``with``): one fleet, not two
            return self
        try:
            self._group.start()
            self._group.wait_healthy(self.startup_timeout)
            self._router.start(self.policy, self.replicas)
        except BaseException:
            self.stop()
            raise
        return self

    def router_command(self) -> tuple[list[str], dict]:
        return self._router.command(self.policy, self.replicas)

    def restart_router(self, policy: str) -> str:
        """Replace the router by one with another ``policy`` in front of the same replicas (their caches stay
        warm: compare policies on prompts that share nothing with earlier ones). Returns the new URL."""
        if policy not in POLICIES:
            raise ValueError(f"policy must be one of {', '.join(POLICIES)}, got {policy!r}")
        if policy == "kv_aware" and not self.kv_events:
            raise ValueError("kv_aware needs the replicas' KV events: start the Fleet with kv_events=True")
        self._router.stop()
        self.policy = policy
        try:
            self._router.start(policy, self.replicas)
        except BaseException:
            self.stop()
            raise
        return self.url

    # -- while it runs --------------------------------------------------------------------------------
    def alive(self) -> list[bool]:
        return self._group.alive()

    def kill(self, index: int) -> None:
        """End replica ``index`` at once (SIGKILL to its process group): what a crash looks like to the router."""
        self._group.kill(index)

    def check(self) -> list[str]:
        """New problems since the last call, one line each (a replica that exited, the router that exited)."""
        lines = []
        for rep, code in self._group.newly_exited():
            left = sum(self.alive())
            lines.append(f"replica {rep.index} ({rep.url}) exited with {code}; {left} of {len(self.replicas)} "
                         f"still serving behind {self.url}. The last lines of {rep.log}:\n{rep.tail()}")
        if self.router is not None and self.router.poll() is not None:
            lines.append(f"vllm-router exited with {self.router.returncode}; its log:\n{self._router.tail()}")
        return lines

    def metrics(self) -> list[dict]:
        """Each replica's prefix-cache counters and requests, from its ``/metrics`` (None where it is down)."""
        return self._group.metrics()

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
        stop_processes(([self.router] if self.router is not None else []) + [r.proc for r in self.replicas if r.proc],
                       grace)
        if self._tmp is not None:
            self._tmp.cleanup()
            self._tmp = None


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
