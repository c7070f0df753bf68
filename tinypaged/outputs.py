"""What generate() and step() return (vLLM's RequestOutput / CompletionOutput shapes).

``finish_reason`` here is vLLM's plain string ("stop", "length", "abort", "error"): ``str()`` of
the sequence's ``FinishReason``. ``stop_reason`` is vLLM's: the stop token id, the stop string, or None.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    finish_reason: str | None  # "stop", "length", "abort" or "error"
    stop_reason: int | str | None = None


@dataclass
class RequestMetrics:
    arrival_time: float
    first_scheduled_time: float | None
    first_token_time: float | None
    finished_time: float | None
    num_output_tokens: int
    num_cached_tokens: int
    num_preemptions: int

    @property
    def time_to_first_token(self) -> float | None:
        if self.first_token_time is None:
            return None
        return self.first_token_time - self.arrival_time

    @property
    def time_per_output_token(self) -> float | None:
        if self.finished_time is None or self.first_token_time is None or self.num_output_tokens < 2:
            return None
        return (self.finished_time - self.first_token_time) / (self.num_output_tokens - 1)

    @property
    def e2e_latency(self) -> float | None:
        return None if self.finished_time is None else self.finished_time - self.arrival_time


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics | None = field(default=None, repr=False)
    error: str | None = None  # course: why the engine failed this request (finish_reason "error")


@dataclass
class StreamOutput:
    """One piece of a stream (``LLM.generate_stream``): what one sequence produced in one step.

    Joining the ``text`` of every piece with the same ``(request_id, index)`` gives exactly the
    final ``CompletionOutput.text`` (text that could still turn into a stop string, or an
    incomplete UTF-8 character, is held back until it is settled).
    """

    request_id: str
    index: int
    text: str  # new text since this sequence's previous piece (may be "")
    token_ids: list[int]  # new token ids
    finished: bool
    finish_reason: str | None = None
    stop_reason: int | str | None = None


@dataclass
class StepResult:
    """What one ``LLMEngine.step()`` did: the batch it ran, the tokens it produced, what finished or
    was preempted."""

    step: int
    scheduled: list  # the scheduler's ScheduledSeq items
    new_tokens: dict[int, int]  # seq_id -> token sampled this step
    preempted: list
    finished: list[RequestOutput]
    sampled: list = field(default_factory=list)  # sequences that got a token, as new_tokens
    timings: dict = field(default_factory=dict)  # seconds per phase: schedule, execute, sample, update (the core's)
    stats: dict = field(default_factory=dict)  # the queues and the cache after the step (EngineCore.scheduler_stats)

    def trace(self) -> str:
        """One line per step, stable across machines (ids and counts only)."""
        parts = [f"{s.seq.request_id}:{'p' if s.is_prefill else 'd'}{s.num_tokens}" for s in self.scheduled]
        line = f"step {self.step:3d} | " + " ".join(parts)
        if self.preempted:
            line += " | preempted " + ",".join(s.request_id for s in self.preempted)
        if self.finished:
            line += " | finished " + ",".join(r.request_id for r in self.finished)
        return line
