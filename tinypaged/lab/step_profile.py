"""Where an engine step's time goes on a CPU: projections, attention, norms/RoPE, sampling, host.

Explicit wall-clock timers (``time.perf_counter``), no profiler: on a CPU a torch call returns when its
work is done, so a timer around a call measures that call. :class:`StepTimers` wraps

* ``torch.nn.functional.linear``, ``FusedLinear`` calls and the model's ``Linear`` layers: every projection (fused
  or not) and the vocabulary projection;
* ``ForwardContext.attend``: each layer's KV cache write plus its decode and prefill attention;
* the model's ``forward``; what of it is neither a projection nor attention is embeddings, RMSNorm,
  RoPE, SiLU, residual adds and the Python between them ("norms/RoPE/act");
* the engine's ``sample`` and ``LLMEngine.step``; what of a step is neither the forward nor sampling is
  "host": scheduling, building the step's input tensors, output processing.

A wrapper costs about a microsecond a call (a few hundred calls a step, against steps of tens of ms).
Invariant: the wrappers are in place only inside :meth:`StepTimers.around`, for one engine.
"""

from __future__ import annotations

import contextlib
import time
from collections import defaultdict

import torch.nn.functional as F

import tinypaged.engine.llm_engine as llm_engine
from tinypaged.attention.backends import ForwardContext
from tinypaged.model.fused import FusedLinear
from tinypaged.model.llama import Linear

CATEGORIES = ("projections", "attention", "norms/RoPE/act", "sampling", "host")


class StepTimers:
    """Seconds spent per timed call while active (projections and attention lie inside the forward)."""

    def __init__(self):
        self.seconds = defaultdict(float)
        self.running = set()

    def timed(self, key, fn):
        def wrapper(*args, **kwargs):
            if key in self.running:  # a FusedLinear falling back on F.linear counts once
                return fn(*args, **kwargs)
            self.running.add(key)
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds[key] += time.perf_counter() - t0
                self.running.discard(key)
        return wrapper

    @contextlib.contextmanager
    def around(self, engine):
        saved = F.linear, FusedLinear.__call__, Linear.forward, ForwardContext.attend, llm_engine.sample
        F.linear = self.timed("linear", F.linear)
        FusedLinear.__call__ = self.timed("linear", FusedLinear.__call__)
        Linear.forward = self.timed("linear", Linear.forward)
        ForwardContext.attend = self.timed("attend", ForwardContext.attend)
        llm_engine.sample = self.timed("sample", llm_engine.sample)
        engine.model.forward = self.timed("forward", engine.model.forward)
        engine.step = self.timed("step", engine.step)
        try:
            yield self
        finally:
            F.linear, FusedLinear.__call__, Linear.forward, ForwardContext.attend, llm_engine.sample = saved
            del engine.model.forward, engine.step  # back to the class's methods

    def split(self) -> dict:
        """Seconds per category (``CATEGORIES``) and in all (``"total"``)."""
        s = self.seconds
        return {"projections": s["linear"], "attention": s["attend"],
                "norms/RoPE/act": s["forward"] - s["linear"] - s["attend"], "sampling": s["sample"],
                "host": s["step"] - s["forward"] - s["sample"], "total": s["step"]}


def profile_generate(llm, prompts, params) -> dict:
    """Run ``llm.generate(prompts, params)`` under the timers: seconds per category, steps, outputs."""
    engine = llm.llm_engine
    before = llm.get_metrics()["num_steps"]
    with StepTimers().around(engine) as timers:
        outputs = llm.generate(prompts, params)
    steps = llm.get_metrics()["num_steps"] - before
    decode_only = sum(1 for h in list(engine.history)[-steps:] if h["num_prefill_tokens"] == 0)
    return dict(timers.split(), steps=steps, decode_only=decode_only, outputs=outputs)
