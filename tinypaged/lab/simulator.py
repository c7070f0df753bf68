"""Stage 6: the paper's scale without its GPU. A discrete-event simulator over the REAL scheduler.

The simulator builds tinypaged's own ``Scheduler`` and KV manager (paged ``BlockManager`` or
contiguous ``ContiguousKVManager``) from an ``EngineConfig`` and replays a trace on a virtual
clock. Each step it asks the scheduler for a batch, advances the clock by ``cost_model(batch)``,
and then does what the engine does after a forward: the scheduled tokens are now computed, a
sequence whose prompt is done gets one (dummy) token, a sequence that reached its trace's output
length finishes and frees its memory. No model runs, so admission, preemption and reservation
behave exactly as in the engine while a thousand requests take seconds, not hours.

All coupling to engine internals lives in ``ModelFreeEngine`` (one small class): the engine is
being refactored, and only that class should need to follow it.

Cost models map a ``BatchShape`` (tokens, sequences, context read) to seconds:

* ``LinearCostModel``: fitted (non-negative least squares) to step times measured on this machine;
* ``StepCostModel``: that line plus a correction by batch size (a CPU's matrix multiplies, or a GPU's
  CUDA-graph sizes, make a step's cost a staircase in its batch size); the calibrated model of choice;
* ``RooflineCostModel``: the slower of compute and memory traffic on a GPU; ``OPT13B_A100`` is
  OPT-13B in fp16 on one A100-40GB, the paper's main setting.

Invariants: a simulation is deterministic given its trace and cost model; every request in the
trace finishes (a request that can never fit raises ``ValueError`` up front, like the engine).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from tinypaged.lab.serving import (BatchShape, RequestRecord, ServingRun, StepRecord, get_system, quiet,
                               scaled_max_model_len, system_config)
from tinypaged.lab.workloads import TraceRequest


# -- the adapter: the only code that knows the engine's internals -------------------------------------
class ModelFreeEngine:
    """The engine core without a model (the simulator's only coupling): ``EngineCore(config, model=False)``, the same
    scheduler, KV manager and step as ``LLM``'s, the forward left out.

    ``schedule(now)`` is the core's ``schedule`` at ``now``, returned as ``(seq, start, num_tokens, is_prefill)``
    tuples and the batch's slots; ``complete(now)`` is the core's ``execute`` and ``update`` at ``now`` (the
    step's end on the virtual clock): the scheduled tokens are computed, every sequence whose prompt is done gets
    token 0, the token rules finish those at their output length; it returns the sequences that finished.
    """

    def __init__(self, config):
        from tinypaged.engine.core import EngineCore

        if config.preemption_mode != "recompute":
            raise ValueError("the simulator models recompute preemption only (vLLM v1); "
                             "use preemption_mode='recompute'")
        self.config = config
        self.core = EngineCore(config, model=False)
        self.kv, self.scheduler = self.core.kv, self.core.scheduler
        self.now = 0.0
        self._out = None

    def add(self, request_id: str, prompt_ids: list[int], output_len: int, arrival: float):
        from tinypaged.engine.input_processor import Request
        from tinypaged.kv.managers import check_fits
        from tinypaged.sampling_params import SamplingParams
        from tinypaged.sequence import Sequence

        params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
        seq = Sequence(request_id, prompt_ids, params, 0, arrival)
        if len(prompt_ids) + output_len > self.config.max_model_len:
            raise ValueError(f"Request {request_id} (prompt {len(prompt_ids)} + output {output_len} tokens) can "
                             f"never run: max_model_len is {self.config.max_model_len}")
        check_fits(self.kv, seq)
        self.core.add_requests([Request(request_id, None, list(prompt_ids), params, [seq])])
        return seq

    def has_unfinished(self) -> bool:
        return self.core.has_unfinished_requests()

    def schedule(self, now: float) -> tuple[list[tuple], int]:
        """(batch, batch slots: the scheduled sequences plus a static batch's idle members)."""
        self.now = now
        self._out = out = self.core.schedule(now)
        batch = [(s.seq, s.seq.num_computed_tokens, s.num_tokens, s.is_prefill) for s in out.scheduled]
        return batch, len(batch) + out.num_idle_slots

    def complete(self, now: float) -> list:
        self.now = now
        out, self._out = self._out, None
        step = self.core.update(out, self.core.execute(out), now=now)
        return [seq for seq in step.sampled if seq.is_finished]

    @property
    def num_preemptions(self) -> int:
        return self.scheduler.num_preemptions


# -- cost models ----------------------------------------------------------------------------------------
FEATURES = ("step", "token", "sequence", "context token")


def features(shape: BatchShape) -> tuple[float, ...]:
    return (1.0, shape.num_tokens, shape.num_seqs, shape.context_tokens)


@dataclass(frozen=True)
class LinearCostModel:
    """seconds = per_step + per_token x tokens + per_seq x sequences + per_context x context tokens read."""

    per_step: float
    per_token: float
    per_seq: float
    per_context: float

    def __call__(self, shape: BatchShape) -> float:
        return sum(c * x for c, x in zip(self.coefficients, features(shape)))

    @property
    def coefficients(self) -> tuple[float, ...]:
        return (self.per_step, self.per_token, self.per_seq, self.per_context)

    @classmethod
    def fit(cls, steps: list[StepRecord], min_steps: int = 8) -> "LinearCostModel":
        """Non-negative least squares over measured steps (each step's duration vs its batch shape)."""
        import numpy as np

        if len(steps) < min_steps:
            raise ValueError(f"calibration needs at least {min_steps} measured steps, got {len(steps)}")
        X = np.array([features(s.shape) for s in steps], dtype=float)
        y = np.array([s.duration for s in steps], dtype=float)
        scale = X.max(axis=0)
        scale[scale == 0] = 1.0
        active = list(range(X.shape[1]))
        while True:  # drop a negative coefficient and refit until none is left
            coef, *_ = np.linalg.lstsq(X[:, active] / scale[active], y, rcond=None)
            if (coef >= 0).all() or len(active) == 1:
                break
            active.pop(int(np.argmin(coef)))
        full = [0.0] * X.shape[1]
        for i, c in zip(active, coef):
            full[i] = max(float(c), 0.0) / float(scale[i])
        return cls(*full)

    def describe(self) -> str:
        return (f"{self.per_step * 1e3:.2f} ms per step + {self.per_token * 1e3:.3f} ms per token + "
                f"{self.per_seq * 1e3:.3f} ms per sequence + {self.per_context * 1e6:.3f} us per context token")


BATCH_KNOTS = (1, 2, 3, 4, 5, 6, 7, 8, 12, 16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512)


@dataclass(frozen=True)
class StepCostModel:
    """A ``LinearCostModel`` plus a correction by batch size: seconds = linear(shape) + correction(sequences).

    A step's cost is not a straight line in its batch size. On a CPU the matrix-multiply library picks
    another kernel as the batch grows (tinypaged's ``tiny`` model: 1.6 ms for one sequence, 2.9 ms for
    three, 4.0 ms for four); on a GPU vLLM pads each decode batch up to the next CUDA-graph size. The
    correction is piecewise linear between ``BATCH_KNOTS`` and is fitted to what the line leaves (ridge
    least squares, ``ridge`` in units of steps): a batch size seen in many calibration steps gets its own
    cost, one seen rarely or never falls back to the line.
    """

    linear: LinearCostModel
    knots: tuple[int, ...] = BATCH_KNOTS
    corrections: tuple[float, ...] = (0.0,) * len(BATCH_KNOTS)

    def correction(self, num_seqs: int) -> float:
        import numpy as np

        return float(np.interp(num_seqs, self.knots, self.corrections))

    def __call__(self, shape: BatchShape) -> float:
        return max(0.0, self.linear(shape) + self.correction(shape.num_seqs))

    @classmethod
    def fit(cls, steps: list[StepRecord], ridge: float = 5.0, knots=BATCH_KNOTS) -> "StepCostModel":
        import numpy as np

        line = LinearCostModel.fit(steps)
        residual = np.array([s.duration - line(s.shape) for s in steps])
        hat = np.zeros((len(steps), len(knots)))  # each step's weight on each knot (linear interpolation)
        for i, s in enumerate(steps):
            n = min(max(s.num_seqs, knots[0]), knots[-1])
            j = int(np.searchsorted(knots, n))
            if knots[j] == n:
                hat[i, j] = 1.0
            else:
                w = (n - knots[j - 1]) / (knots[j] - knots[j - 1])
                hat[i, j - 1], hat[i, j] = 1 - w, w
        corr = np.linalg.solve(hat.T @ hat + ridge * np.eye(len(knots)), hat.T @ residual)
        return cls(line, tuple(knots), tuple(float(c) for c in corr))

    def describe(self) -> str:
        shown = [k for k in (1, 2, 4, 8, 16, 32) if k in self.knots]
        return (self.linear.describe() + "; by batch size: " + ", ".join(
            f"{k} seq {1e3 * self.correction(k):+.2f} ms" for k in shown))


@dataclass(frozen=True)
class RooflineCostModel:
    """A step takes the longer of its arithmetic at peak FLOP/s and its memory traffic at peak bandwidth.

    FLOPs: 2 x parameters per token (every weight is multiplied once per token) plus 4 x layers x
    hidden per (query, key) pair (scores and the weighted sum of values). Bytes: all weights once per
    step, the keys and values attention reads, and the new tokens' keys and values written. Nothing
    else (no kernel launch or scheduling overhead unless ``per_step`` says so).
    """

    name: str
    params: float
    weight_bytes: float
    num_layers: int
    hidden: int
    kv_bytes_per_token: float
    peak_flops: float
    hbm_bandwidth: float
    per_step: float = 0.0

    def flops(self, shape: BatchShape) -> float:
        return 2 * self.params * shape.num_tokens + 4 * self.num_layers * self.hidden * shape.attention_pairs

    def bytes(self, shape: BatchShape) -> float:
        return self.weight_bytes + self.kv_bytes_per_token * (shape.context_tokens + shape.num_tokens)

    def __call__(self, shape: BatchShape) -> float:
        return max(self.flops(shape) / self.peak_flops, self.bytes(shape) / self.hbm_bandwidth) + self.per_step


# OPT-13B (40 layers, hidden 5120) in fp16 on one A100-40GB. The paper: 26 GB of parameters,
# 800 KB of KV per token (2 x 5120 x 40 x 2 bytes), 12 GB left for the KV cache (Table 1).
# A100-40GB: 1,555 GB/s of HBM2 bandwidth, 312 TFLOP/s dense fp16 on tensor cores (NVIDIA's data sheet).
OPT13B_A100 = RooflineCostModel(
    name="OPT-13B fp16 on A100-40GB (roofline)", params=13e9, weight_bytes=26e9, num_layers=40, hidden=5120,
    kv_bytes_per_token=2 * 5120 * 40 * 2, peak_flops=312e12, hbm_bandwidth=1555e9,
)


# -- the event loop -----------------------------------------------------------------------------------------
def _prompt(r: TraceRequest, distinct: bool) -> list[int]:
    if not distinct:
        return [1] * r.prompt_len  # contents only matter to prefix caching
    from tinypaged.lab.workloads import prompt_token_ids

    return prompt_token_ids(r, 32000)


def simulate(trace: list[TraceRequest], cost_model, system: str = "vllm", rate: float | None = None,
             max_steps: int | None = None, **common) -> ServingRun:
    """Serve ``trace`` with one system on a virtual clock; ``common`` are engine knobs shared by all
    systems (``kv_cache_tokens`` or ``num_gpu_blocks_override`` is required, as ``tinypaged.kv.sizing`` reads
    them; ``max_num_seqs``, ``max_model_len``, ``block_size``, ...).
    """
    from tinypaged.config import EngineConfig

    config = EngineConfig(model="(simulated)", device="cpu", **system_config(system, **common))
    eng = ModelFreeEngine(config)
    arrivals = sorted(trace, key=lambda r: r.arrival_time)
    seqs = {}
    for r in arrivals:
        seq = eng.add(str(r.request_id), _prompt(r, config.enable_prefix_caching), r.output_len, r.arrival_time)
        seqs[seq.seq_id] = r
    requests, steps = [], []
    now, i_next = 0.0, 0
    with quiet(logging.ERROR):
        while eng.has_unfinished():
            batch, slots = eng.schedule(now)
            if not batch:
                while i_next < len(arrivals) and arrivals[i_next].arrival_time <= now:
                    i_next += 1
                if i_next == len(arrivals):
                    raise RuntimeError("the scheduler made no progress with every request arrived")
                now = arrivals[i_next].arrival_time  # idle until the next request arrives
                continue
            shape = BatchShape.of((start, n, is_prefill) for _, start, n, is_prefill in batch)
            end = now + cost_model(shape)
            for seq in eng.complete(end):
                r = seqs[seq.seq_id]
                requests.append(RequestRecord(seq.request_id, r.prompt_len, r.output_len, seq.times.arrival,
                                              seq.times.first_token, seq.times.finished, seq.num_preemptions))
            steps.append(StepRecord(now, end, shape, slots))
            now = end
            if max_steps is not None and len(steps) >= max_steps:
                raise RuntimeError(f"simulation exceeded max_steps={max_steps}")
    requests.sort(key=lambda r: r.arrival)
    return ServingRun(system, rate, requests, steps, config.max_num_seqs, eng.num_preemptions, simulated=True)


# -- sweeps ---------------------------------------------------------------------------------------------------
@dataclass
class Sweep:
    """Mean normalized latency and requests batched per system, at that system's rates."""

    rates: dict[str, list[float]] = field(default_factory=dict)
    latency: dict[str, list[float]] = field(default_factory=dict)
    batched: dict[str, list[float]] = field(default_factory=dict)
    runs: dict[tuple[str, float], ServingRun] = field(default_factory=dict)

    def sustainable(self, threshold: float) -> dict[str, float]:
        from tinypaged.lab.serving import sustainable_rate

        return {s: sustainable_rate(self.rates[s], lat, threshold) for s, lat in self.latency.items()}

    def at(self, system: str, rate: float, what: str = "batched") -> float:
        """``what`` ("batched" or "latency") of ``system`` at its simulated rate nearest ``rate``."""
        rates = self.rates[system]
        i = min(range(len(rates)), key=lambda k: abs(rates[k] - rate))
        return getattr(self, what)[system][i]


def sweep(trace: list[TraceRequest], cost_model, rates, systems, seed: int = 0, keep_runs: bool = False,
          duration: float | None = None, min_requests: int = 50, **common) -> Sweep:
    """Simulate every system at every rate: the same request lengths, fresh Poisson arrivals per rate.

    ``rates`` is one list for all systems, or ``{system: rates}`` (a slow system needs low rates only).
    With ``duration``, each rate replays ``rate x duration`` requests (at least ``min_requests``) from
    the start of ``trace``, so every run is the same span of traffic: overload lasts as long at every
    rate, and a high rate costs little more to simulate than a low one.
    """
    from tinypaged.lab.serving import with_rate

    out = Sweep()
    for s in systems:
        get_system(s)
        out.rates[s] = sorted(rates[s] if isinstance(rates, dict) else rates)
        out.latency[s], out.batched[s] = [], []
        for rate in out.rates[s]:
            n = len(trace) if duration is None else max(min_requests, round(rate * duration))
            if n > len(trace):
                raise ValueError(f"{rate} req/s for {duration} s needs {n} requests; the trace has {len(trace)}")
            run = simulate(with_rate(trace[:n], rate, seed), cost_model, s, rate, **common)
            m = run.summary()
            out.latency[s].append(m["normalized_latency"])
            out.batched[s].append(m["batched"])
            if keep_runs:
                out.runs[(s, rate)] = run
    return out


@dataclass
class Validation:
    rate: float
    measured: float  # mean normalized latency, real engine (s/token)
    predicted: float  # the simulator's with the calibrated cost model, same requests and arrivals
    step_model_error: float  # the calibrated model on the measured run's own batches: predicted busy time / measured - 1
    own_steps_predicted: float = float("nan")  # the simulator's with a model fitted to this run's own steps
    attempt: int = 1
    model: object = field(default=None, repr=False)  # the cost model the prediction used

    @property
    def error(self) -> float:
        return self.predicted / self.measured - 1

    @property
    def own_steps_error(self) -> float:
        """The error left when the step costs are right: what the simulator's scheduling adds."""
        return self.own_steps_predicted / self.measured - 1


def calibration_steps(llm, calibration_trace: list[TraceRequest], system: str = "vllm", seed: int = 0) -> list:
    """The measured steps of a closed-loop run (every request queued at once, so every batch size from
    full down to one) of ``calibration_trace`` on ``llm``, now."""
    from tinypaged.lab.serving import replay

    with quiet(logging.ERROR):
        return replay(llm, calibration_trace, system, None, seed).steps


def calibrate(llm, calibration_trace: list[TraceRequest], system: str = "vllm", seed: int = 0) -> StepCostModel:
    """A ``StepCostModel`` fitted to ``calibration_steps``."""
    return StepCostModel.fit(calibration_steps(llm, calibration_trace, system, seed))


def check_against(model, measured: dict, system: str = "vllm", **common) -> list[Validation]:
    """Simulate each measured real-time run (``{rate: ServingRun}``, same requests and arrivals) with
    ``model``, and with a model fitted to the run's own steps, and compare mean normalized latencies."""
    out = []
    for rate, real in sorted(measured.items()):
        trace = [TraceRequest(int(r.request_id.rsplit(":", 1)[-1]), r.prompt_len, r.output_len, r.arrival)
                 for r in real.requests]
        sim = simulate(trace, model, system, rate, **common)
        own = simulate(trace, StepCostModel.fit(real.steps), system, rate, **common)
        busy = sum(s.duration for s in real.steps)
        out.append(Validation(rate, real.summary()["normalized_latency"], sim.summary()["normalized_latency"],
                              sum(model(s.shape) for s in real.steps) / busy - 1, own.summary()["normalized_latency"]))
    return out


def validate(llm, calibration_trace: list[TraceRequest], trace: list[TraceRequest], rates, system: str = "vllm",
             seed: int = 0, attempts: int = 3, max_step_error: float = 0.10, bracket: bool = True,
             **common) -> list[Validation]:
    """At each rate, calibrate on a real-time run of ``calibration_trace`` (other requests) at that
    rate, replay ``trace`` at once, and (``bracket``) calibrate again after it; fit the cost model on
    the calibration runs and simulate the replay with it. Calibrating under the same kind of load
    matters: steps measured with every request queued at once came out faster than the same batches
    served under Poisson arrivals. On a shared machine the CPU's speed can also change from one run
    to the next; when the fitted model misjudges the measured run's own batches by more than
    ``max_step_error`` (the simulator's input, not the simulator, is then wrong), the rate is
    measured again, up to ``attempts`` times. Every attempt is returned (``attempt`` numbers them)."""
    from tinypaged.lab.serving import replay, with_rate

    out = []
    with quiet(logging.ERROR):
        for k, rate in enumerate(rates):
            cal = lambda i: replay(llm, with_rate(calibration_trace, rate, seed + 101 + 7 * k + i), system, rate,  # noqa: E731
                                   seed).steps
            before = cal(0)
            for attempt in range(1, attempts + 1):
                real = replay(llm, with_rate(trace, rate, seed), system, rate, seed)
                after = cal(attempt) if bracket else []
                model = StepCostModel.fit(before + after)
                v = check_against(model, {rate: real}, system, **common)[0]
                v.attempt, v.model = attempt, model
                out.append(v)
                if abs(v.step_model_error) <= max_step_error:
                    break
                before = after or cal(attempt)
    return out


def knee_rates(cost_model, trace: list[TraceRequest], slow: str = "orca-max", fast: str = "vllm", num: int = 3,
               factor: float = 5.0, duration: float | None = None, min_requests: int = 50,
               **common) -> list[float]:
    """``num`` request rates from ``slow``'s predicted knee to ``fast``'s (geometrically spaced), where a
    knee is the highest rate whose simulated mean normalized latency stays under ``factor`` x ``fast``'s
    at a light load. Used to pick real-time rates where the systems differ, on any machine's speed.
    Pass the real runs' ``duration`` (and ``min_requests``) so that the knees are those of the same span
    of traffic: a short burst of requests never builds the queue a long one does, so it overstates them."""
    from tinypaged.lab.serving import sustainable_rate

    mean_out = sum(r.output_len for r in trace) / len(trace)
    n = common.get("max_num_seqs", 256)
    full = BatchShape.of([(32, 1, False)] * n)
    top = n / cost_model(full) / mean_out  # if every step were full: an upper bound on the rate
    grid = [top * 2 ** (-k / 2) for k in range(12, -1, -1)]
    if duration is not None:  # rates the trace is too short for cannot be simulated for that long
        grid = [r for r in grid if max(min_requests, round(r * duration)) <= len(trace)] or grid[:1]
    sw = sweep(trace, cost_model, grid, [slow, fast], duration=duration, min_requests=min_requests, **common)
    th = factor * sw.latency[fast][0]
    lo, hi = (sustainable_rate(grid, sw.latency[s], th) or grid[0] for s in (slow, fast))
    if hi <= lo:
        hi = 2 * lo
    return [round(float(lo * (hi / lo) ** (i / (num - 1))), 1) for i in range(num)] if num > 1 else [round(float(hi), 1)]


def paper_setup(scale: float = 1.0, kv_tokens: int | None = None, **kw) -> dict:
    """Common knobs for a paper-like comparison at ``scale``: max_model_len 2048 x scale, the paper's
    KV budget (15.7K token slots) x scale, block 16, max_num_seqs 256 (vLLM's default)."""
    from tinypaged.lab.serving import PAPER_KV_TOKENS

    return {"max_model_len": scaled_max_model_len(scale),
            "kv_cache_tokens": kv_tokens or int(PAPER_KV_TOKENS * scale), "block_size": 16,
            "max_num_seqs": 256, **kw}
