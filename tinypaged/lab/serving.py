"""Stage 6: serving under load. Replay a trace in real time and measure every request.

A *system* is a set of engine knobs: how the KV cache is laid out and how the batch is formed.
The vLLM paper (Section 6.2, Figure 12) compares these at equal KV memory on the same model:

* ``static``       static batching, one contiguous region of ``max_model_len`` per request
                   (FasterTransformer-like),
* ``orca-max``     continuous batching, contiguous regions of ``max_model_len`` (Orca (Max)),
* ``orca-pow2``    continuous batching, regions of the next power of two of the final length (Orca (Pow2)),
* ``orca-oracle``  continuous batching, regions of exactly the final length (Orca (Oracle)),
* ``vllm``         continuous batching over paged KV (vLLM).

``replay`` feeds a trace to a real engine at its arrival times (Poisson, from ``tinypaged.lab.workloads``)
and records, per request, the arrival, first-token and finish times, and per step the batch it ran.
``tinypaged.lab.simulator`` produces the same ``ServingRun`` records without a model, on a virtual clock,
so everything below (summaries, tables, sustainable rates) works on both.

Per-request metrics (the names vLLM's benchmarks use):

* TTFT, time to first token: first token - arrival (queueing + prefill),
* TPOT, time per output token: (finish - first token) / (output tokens - 1),
* normalized latency: (finish - arrival) / output tokens, the paper's metric (seconds per token).
"""

from __future__ import annotations

import contextlib
import logging
import math
import time
from dataclasses import dataclass, field

from tinypaged.lab.workloads import MAX_SEQ_LEN, TraceRequest, make_trace, prompt_token_ids

# The paper's KV budget for OPT-13B on one A100-40GB (Table 1): 12 GB of KV cache,
# "15.7K" token slots at 800 KB per token (12 GiB / 800 KiB = 15,728).
PAPER_KV_TOKENS = 12 * 2**30 // (800 * 2**10)


@dataclass(frozen=True)
class System:
    name: str
    label: str  # the name the paper gives it
    engine_kwargs: dict = field(hash=False)


SYSTEMS = (
    System("static", "Static (Max)", dict(scheduler_cls="static", kv_cache_manager="contiguous", reservation_policy="max")),
    System("orca-max", "Orca (Max)", dict(scheduling_policy="fcfs", kv_cache_manager="contiguous", reservation_policy="max")),
    System("orca-pow2", "Orca (Pow2)", dict(scheduling_policy="fcfs", kv_cache_manager="contiguous", reservation_policy="pow2")),
    System("orca-oracle", "Orca (Oracle)",
           dict(scheduling_policy="fcfs", kv_cache_manager="contiguous", reservation_policy="oracle")),
    System("vllm", "vLLM", dict(scheduling_policy="fcfs", kv_cache_manager="paged")),
)
SYSTEM_NAMES = tuple(s.name for s in SYSTEMS)

# The paper's figures for OPT-13B on ShareGPT, quoted beside ours.
PAPER_RATE_RATIOS = {"orca-oracle": (1.7, 2.7), "orca-max": (2.7, 8.0)}  # vLLM's sustainable rate / theirs
PAPER_BATCHED = {"vllm": 30.42, "orca-oracle": 13.62, "orca-pow2": 9.81, "orca-max": 7.00}


def get_system(name: str) -> System:
    for s in SYSTEMS:
        if s.name == name:
            return s
    raise ValueError(f"Unknown system {name!r}; choose one of {list(SYSTEM_NAMES)}")


def system_config(name: str, **common) -> dict:
    """Engine keyword arguments for one system: its own knobs plus the ``common`` ones (KV size,
    ``max_num_seqs``, ...), which must be the same for every system in a comparison."""
    clash = set(get_system(name).engine_kwargs) & set(common)
    if clash:
        raise ValueError(f"{sorted(clash)} define the system ({name!r}); do not pass them as common knobs")
    return {**get_system(name).engine_kwargs, **common}


# -- traces -------------------------------------------------------------------------------------------
def scaled_max_model_len(scale: float) -> int:
    """The paper's 2048-token cap, scaled like the lengths."""
    return max(2, round(MAX_SEQ_LEN * scale))


def serving_trace(shape: str, num_requests: int, rate: float | None, seed: int = 0,
                  scale: float = 1.0) -> list[TraceRequest]:
    """A ShareGPT- or Alpaca-like trace with Poisson arrivals at ``rate`` requests/s.

    Lengths are drawn at the paper's scale (capped at 2048 tokens), then multiplied by ``scale``
    to fit a CPU; a request that rounding pushed past ``scaled_max_model_len(scale)`` loses
    output tokens so that it still fits.
    """
    if not 0 < scale <= 1:
        raise ValueError(f"scale must be in (0, 1], got {scale}")
    cap = scaled_max_model_len(scale)
    out = []
    for r in make_trace(shape, num_requests, seed=seed, rate=rate, scale=scale):
        if r.total_len > cap:
            r = TraceRequest(r.request_id, min(r.prompt_len, cap - 1), max(1, cap - min(r.prompt_len, cap - 1)),
                             r.arrival_time)
        out.append(r)
    return out


def with_rate(trace: list[TraceRequest], rate: float, seed: int = 0) -> list[TraceRequest]:
    """The same requests (lengths) with fresh Poisson arrivals at ``rate`` requests/s."""
    import random

    if rate <= 0:
        raise ValueError(f"rate must be > 0 requests/s, got {rate}")
    rng, t, out = random.Random(seed), 0.0, []
    for r in trace:
        t += rng.expovariate(rate)
        out.append(TraceRequest(r.request_id, r.prompt_len, r.output_len, t))
    return out


# -- records ------------------------------------------------------------------------------------------
@dataclass
class RequestRecord:
    request_id: str
    prompt_len: int
    output_len: int
    arrival: float
    first_token: float
    finished: float
    num_preemptions: int = 0

    @property
    def ttft(self) -> float:
        return self.first_token - self.arrival

    @property
    def tpot(self) -> float:
        """Seconds per output token after the first (0 for a one-token output)."""
        return (self.finished - self.first_token) / (self.output_len - 1) if self.output_len > 1 else 0.0

    @property
    def e2e(self) -> float:
        return self.finished - self.arrival

    @property
    def normalized_latency(self) -> float:
        """End-to-end latency divided by output length: the paper's metric (seconds per token)."""
        return self.e2e / self.output_len


@dataclass
class BatchShape:
    """What one step computes, as a cost model sees it."""

    num_seqs: int = 0
    num_prefill_tokens: int = 0
    num_decode_tokens: int = 0
    context_tokens: int = 0  # keys/values attention reads: sum of each sequence's context after the step
    attention_pairs: int = 0  # (query, key) pairs attention scores (causal within a prefill chunk)

    @property
    def num_tokens(self) -> int:
        return self.num_prefill_tokens + self.num_decode_tokens

    @classmethod
    def of(cls, items) -> "BatchShape":
        """``items``: (tokens computed before this step, tokens this step, is_prefill) per scheduled sequence."""
        b = cls()
        for start, n, is_prefill in items:
            b.num_seqs += 1
            if not is_prefill:
                b.num_decode_tokens += n
            else:
                b.num_prefill_tokens += n
            b.context_tokens += start + n
            b.attention_pairs += n * start + n * (n + 1) // 2
        return b


@dataclass
class StepRecord:
    start: float
    end: float
    shape: BatchShape
    batch_slots: int  # rows the batch holds: the static batch's size, or the sequences scheduled

    @property
    def duration(self) -> float:
        return self.end - self.start

    @property
    def num_seqs(self) -> int:
        return self.shape.num_seqs


@dataclass
class ServingRun:
    """One system serving one trace: every request and every step."""

    system: str
    rate: float | None
    requests: list[RequestRecord]
    steps: list[StepRecord]
    max_num_seqs: int
    num_preemptions: int = 0
    simulated: bool = False

    def summary(self) -> dict:
        reqs, steps = self.requests, self.steps
        n = len(reqs)
        mean = lambda xs: sum(xs) / len(xs) if xs else float("nan")  # noqa: E731
        busy = sum(s.duration for s in steps)
        # A finite trace ends with a drain (no new requests, the batch empties): average the batch over
        # the steps up to the last request's first token, as a long trace would be dominated by them.
        last_start = max((r.first_token for r in reqs), default=0.0)
        loaded = [s for s in steps if s.end <= last_start] or steps
        makespan = max(r.finished for r in reqs) - min(r.arrival for r in reqs) if reqs else 0.0
        slots = sum(s.batch_slots for s in steps)
        return {
            "system": self.system, "rate": self.rate, "requests": n,
            "normalized_latency": mean([r.normalized_latency for r in reqs]),
            "ttft": mean([r.ttft for r in reqs]), "tpot": mean([r.tpot for r in reqs if r.output_len > 1]),
            "e2e": mean([r.e2e for r in reqs]),
            "batched": mean([s.num_seqs for s in loaded]),  # requests in a step's batch, per step, while loaded
            "useful_slot_share": sum(s.num_seqs for s in steps) / slots if slots else 0.0,
            "occupancy": mean([s.num_seqs for s in loaded]) / self.max_num_seqs if steps else 0.0,
            "step_time": busy / len(steps) if steps else float("nan"),
            "steps": len(steps), "preemptions": self.num_preemptions,
            "throughput": sum(r.output_len for r in reqs) / makespan if makespan else float("nan"),
        }


# -- real-time replay ------------------------------------------------------------------------------
@contextlib.contextmanager
def quiet(level=logging.ERROR):
    """Silence the engine's per-preemption warnings while a long run or simulation goes on."""
    log = logging.getLogger("tinypaged")
    old = log.level
    log.setLevel(level)
    try:
        yield
    finally:
        log.setLevel(old)


@contextlib.contextmanager
def shared_weights():
    """Engines built inside share the weights of the same (model, dtype, device, seed): weights are
    read-only at inference, so a sweep over knobs need not reload the model for every setting.
    The two most recently used models stay loaded for the next sweep (the loader's own cache:
    ``tinypaged.model.loader.shared_weights``)."""
    from tinypaged.model import loader

    with loader.shared_weights():
        yield


def replay(llm, trace: list[TraceRequest], system: str = "", rate: float | None = None,
           seed: int = 0) -> ServingRun:
    """Feed ``trace`` to ``llm``'s engine at its arrival times (wall clock) and run it to the end.

    Output lengths are forced (``max_tokens`` = the trace's length, EOS ignored), so every system
    does the same work and the reservation policies see the true final length as ``oracle`` needs.
    """
    from tinypaged.sampling_params import SamplingParams

    engine = llm.llm_engine
    vocab = engine.vocab_size
    tag = f"{system or 'run'}@{rate}:{time.perf_counter_ns()}"
    base = engine.clock()
    pending = sorted(trace, key=lambda r: r.arrival_time)
    info = {}
    for r in pending:
        rid = f"{tag}:{r.request_id}"
        params = SamplingParams(temperature=0.0, max_tokens=r.output_len, ignore_eos=True)
        engine.add_request(rid, {"prompt_token_ids": prompt_token_ids(r, vocab, seed)}, params,
                           arrival_time=base + r.arrival_time)
        info[rid] = r
    requests: list[RequestRecord] = []
    steps: list[StepRecord] = []
    preemptions = 0
    run = engine.run_until_done(list(info), spin_wait=SPIN)  # the engine's one loop; the last 2 ms of a wait spun
    while True:
        idle = engine.counters["num_idle_slot_steps"]  # static batching: finished members' rows
        t0 = engine.clock()
        st = next(run, None)  # one step (a step that ran nothing has waited for the next arrival)
        if st is None:
            break
        t1 = engine.clock()
        preemptions += len(st.preempted)
        if st.scheduled:
            shape = BatchShape.of((s.seq.num_computed_tokens - s.num_tokens, s.num_tokens, s.is_prefill)
                                  for s in st.scheduled)
            slots = shape.num_seqs + engine.counters["num_idle_slot_steps"] - idle
            steps.append(StepRecord(t0 - base, t1 - base, shape, slots))
        for out in st.finished:
            r = info.get(out.request_id)
            if r is None:
                continue
            m = out.metrics
            requests.append(RequestRecord(out.request_id, r.prompt_len, r.output_len, m.arrival_time - base,
                                          m.first_token_time - base, m.finished_time - base, m.num_preemptions))
    requests.sort(key=lambda r: r.arrival)
    return ServingRun(system, rate, requests, steps, engine.config.max_num_seqs, preemptions)


SPIN = 0.002  # seconds of a wait for an arrival spun rather than slept


def _wait_until(clock, t: float, spin: float = SPIN) -> None:
    """Sleep until ``t`` on ``clock``, waking early and spinning the last ``spin`` seconds: a sleep
    can overshoot by a millisecond or more, which a server woken by its socket would not add."""
    delay = t - clock()
    if delay > spin:
        time.sleep(delay - spin)
    while clock() < t:
        pass


@dataclass
class Experiment:
    """Every system serving one trace: all requests at once (``rate`` None: the closed loop, whose
    schedule involves no timing), then Poisson arrivals at each rate. ``runs[(system, rate)]``."""

    trace: list[TraceRequest]
    common: dict
    runs: dict = field(default_factory=dict)

    def capacity(self, system: str = "vllm") -> float:
        """Requests per second the system completed with every request queued at t=0."""
        run = self.runs[(system, None)]
        return len(run.requests) / max(r.finished for r in run.requests)

    def rates(self) -> list[float]:
        return sorted({k[1] for k in self.runs if k[1] is not None})

    def latency(self, system: str) -> list[float]:
        return [self.runs[(system, r)].summary()["normalized_latency"] for r in self.rates()]


def serve_systems(model: str, trace: list[TraceRequest], common: dict, rates=(), systems=SYSTEM_NAMES,
                  device: str = "cpu", dtype: str = "float32", seed: int = 0, log=None,
                  seconds: float | None = None, min_requests: int = 100) -> Experiment:
    """Run the closed loop for every system, then a real-time replay at each of ``rates`` (requests/s),
    the systems taking turns at each rate (so a drift in the machine's speed hits them alike).

    Every system gets the same model, trace and ``common`` knobs (KV size, ``max_num_seqs``, ...).
    With ``seconds``, each rate replays ``rate x seconds`` requests (at least ``min_requests``) from the
    start of ``trace``, and the closed loop the first ``min_requests``: every rate is then the same span
    of traffic, long enough at a high rate for queues to build up as they would in a real deployment.
    """
    from tinypaged import LLM

    counts = {rate: len(trace) if seconds is None else max(min_requests, math.ceil(rate * seconds)) for rate in rates}
    for rate, n in counts.items():
        if n > len(trace):
            raise ValueError(f"{rate} req/s for {seconds} s needs {n} requests; the trace has {len(trace)}")
    exp = Experiment(trace, dict(common))
    closed = trace if seconds is None else trace[:min_requests]
    llms = {}
    with quiet(), shared_weights():
        for name in systems:
            llms[name] = LLM(model, device=device, dtype=dtype, seed=seed, **system_config(name, **common))
            replay(llms[name], with_rate(trace[:4], 1000.0, seed), name)  # warm-up
            exp.runs[(name, None)] = replay(llms[name], closed, name, None, seed)
        for rate in rates:
            moved = with_rate(trace[:counts[rate]], rate, seed)
            for name in systems:
                t0 = time.perf_counter()
                exp.runs[(name, rate)] = replay(llms[name], moved, name, rate, seed)
                if log:
                    log(f"  {get_system(name).label:14s} {rate:7g} req/s: {time.perf_counter() - t0:5.1f} s wall")
    return exp


# -- the same replay on vLLM ---------------------------------------------------------------------------
def vllm_available() -> bool:
    import importlib.util

    return importlib.util.find_spec("vllm") is not None


def replay_vllm(engine, trace: list[TraceRequest], sampling_params_cls, rate: float | None = None,
                vocab_size: int = 30000, max_num_seqs: int = 0, seed: int = 0) -> ServingRun:
    """Replay ``trace`` through a vLLM ``LLMEngine`` (``add_request`` / ``step`` /
    ``has_unfinished_requests``), timing every request from our side of the API.

    vLLM's scheduler does not wait for ``arrival_time``, so each request is added when its arrival
    time comes. Per step we only see the requests that got a token, so ``num_seqs`` counts those
    (a prefill chunk that samples nothing is invisible from here).
    """
    t0 = time.perf_counter()
    now = lambda: time.perf_counter() - t0  # noqa: E731
    pending = sorted(trace, key=lambda r: r.arrival_time)
    info, first, seen = {}, {}, {}
    requests: list[RequestRecord] = []
    steps: list[StepRecord] = []
    i = 0
    while i < len(pending) or engine.has_unfinished_requests():
        while i < len(pending) and pending[i].arrival_time <= now():
            r = pending[i]
            rid = f"vllm-{rate}-{r.request_id}"
            params = sampling_params_cls(temperature=0.0, max_tokens=r.output_len, ignore_eos=True)
            engine.add_request(rid, {"prompt_token_ids": prompt_token_ids(r, vocab_size, seed)}, params)
            info[rid] = r
            i += 1
        if not engine.has_unfinished_requests():
            _wait_until(now, pending[i].arrival_time)
            continue
        start = now()
        outs = engine.step()
        end = now()
        got = 0
        for out in outs:
            n = len(out.outputs[0].token_ids) if out.outputs else 0
            if n > seen.get(out.request_id, 0):
                got += 1
                seen[out.request_id] = n
                first.setdefault(out.request_id, end)
            if out.finished and out.request_id in info:
                r = info[out.request_id]
                requests.append(RequestRecord(out.request_id, r.prompt_len, r.output_len, r.arrival_time,
                                              first.get(out.request_id, end), end))
        if got:
            steps.append(StepRecord(start, end, BatchShape(num_seqs=got, num_decode_tokens=got), got))
    requests.sort(key=lambda r: r.arrival)
    return ServingRun("vllm-real", rate, requests, steps, max_num_seqs)


# -- analysis ------------------------------------------------------------------------------------------
def sustainable_rate(rates, latencies, threshold: float) -> float:
    """The highest request rate whose mean normalized latency stays at or below ``threshold``.

    Rates are sorted; the crossing is interpolated linearly between the last rate under the
    threshold and the first one over it. 0.0 if even the lowest rate is over; the highest rate
    measured if none is (the true limit is then above the sweep).
    """
    pts = sorted(zip(rates, latencies))
    if not pts:
        raise ValueError("no measurements")
    if pts[0][1] > threshold:
        return 0.0
    for (r0, l0), (r1, l1) in zip(pts, pts[1:]):
        if l1 > threshold >= l0:
            return r0 + (r1 - r0) * (threshold - l0) / (l1 - l0)
    return pts[-1][0]


def rate_ratios(sustained: dict[str, float], reference: str = "vllm") -> dict[str, float]:
    """``reference``'s sustainable rate divided by each other system's (inf when theirs is 0)."""
    ref = sustained[reference]
    return {k: (ref / v if v > 0 else math.inf) for k, v in sustained.items() if k != reference}


def format_table(header: list[str], rows: list[list]) -> str:
    cells = [[str(x) for x in r] for r in [header, *rows]]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    lines = ["  ".join(c.rjust(w) for c, w in zip(r, widths)) for r in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def _label(name: str) -> str:
    return get_system(name).label if name in SYSTEM_NAMES else name


def serving_table(runs: dict[tuple[str, float], ServingRun], systems=None) -> str:
    """Every system side by side at every rate: mean normalized latency (s/token), TTFT, TPOT, batch."""
    names = list(dict.fromkeys([*(systems or SYSTEM_NAMES), *(k[0] for k in runs)]))
    systems = [s for s in names if any(k[0] == s for k in runs)]
    rates = sorted({k[1] for k in runs})
    rows = []
    for rate in rates:
        for s in systems:
            if (s, rate) not in runs:
                continue
            m = runs[(s, rate)].summary()
            rows.append([f"{rate:g}", _label(s), f"{m['normalized_latency']:.3f}", f"{m['ttft']:.3f}",
                         f"{m['tpot']:.4f}", f"{m['batched']:.2f}", f"{m['useful_slot_share']:.0%}",
                         m["preemptions"], f"{m['throughput']:.1f}"])
    return format_table(["rate req/s", "system", "norm. latency s/tok", "TTFT s", "TPOT s", "batched",
                         "useful slots", "preempt", "out tok/s"], rows)
