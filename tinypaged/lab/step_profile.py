"""Where an engine step's time goes on a CPU: projections, attention, norms/RoPE, sampling, host.

Explicit wall-clock timers (``time.perf_counter``), no profiler: on a CPU a torch call returns when its
work is done, so a timer around a call measures that call. :class:`StepTimers` times, through forward hooks
(``register_forward_pre_hook`` / ``register_forward_hook``) on the model's own modules,

* every ``nn.Linear`` and ``FusedLinear``: each projection (fused or not) and the vocabulary projection;
* every ``Attend`` (a layer's ``ctx.attend``): its KV cache write plus its decode and prefill attention;
* the model itself; what of its forward is neither a projection nor attention is embeddings, RMSNorm,
  RoPE, SiLU, residual adds and the Python between them ("norms/RoPE/act");

and reads the rest from each step's ``StepResult.timings`` (the engine's phases: schedule, execute, sample,
update): "sampling" is the sample phase; what of a step is neither the forward nor sampling is "host":
scheduling, building the step's input tensors, output processing.

A pair of hooks costs a few microseconds a call (about 150 calls a SmolLM2 step, against steps of tens of ms);
what it costs outside the timed call counts as norms/RoPE/act.
Invariant: the hooks are on the model only inside :meth:`StepTimers.around`.
"""

from __future__ import annotations

import contextlib
import time
from collections import defaultdict

from torch import nn

from tinypaged.model.fused import FusedLinear
from tinypaged.model.llama import Attend

CATEGORIES = ("projections", "attention", "norms/RoPE/act", "sampling", "host")


class StepTimers:
    """Seconds per timed module kind while the hooks are on, and per step phase of the steps seen."""

    def __init__(self):
        self.seconds = defaultdict(float)
        self.started = {}

    def _start(self, key):
        def pre_hook(module, args):
            self.started[key] = time.perf_counter()
        return pre_hook

    def _stop(self, key):
        def hook(module, args, output):
            self.seconds[key] += time.perf_counter() - self.started.pop(key)
        return hook

    @contextlib.contextmanager
    def around(self, model):
        """Hooks on ``model`` (the engine's ``CausalLM``) and its projections and attention calls, removed after."""
        kinds = [(model, "forward")]
        for module in model.modules():
            if isinstance(module, (nn.Linear, FusedLinear)):
                kinds.append((module, "linear"))
            elif isinstance(module, Attend):
                kinds.append((module, "attend"))
        handles = []
        try:
            for module, key in kinds:
                handles += [module.register_forward_pre_hook(self._start(key)),
                            module.register_forward_hook(self._stop(key))]
            yield self
        finally:
            for handle in handles:
                handle.remove()

    def on_step(self, result) -> None:
        """Add one ``StepResult``'s phase times."""
        self.seconds["step"] += sum(result.timings.values())
        self.seconds["sample"] += result.timings["sample"]

    def split(self) -> dict:
        """Seconds per category (``CATEGORIES``) and in all (``"total"``)."""
        s = self.seconds
        return {"projections": s["linear"], "attention": s["attend"],
                "norms/RoPE/act": s["forward"] - s["linear"] - s["attend"], "sampling": s["sample"],
                "host": s["step"] - s["forward"] - s["sample"], "total": s["step"]}


def profile_generate(llm, prompts, params) -> dict:
    """Run ``llm.generate(prompts, params)`` under the timers: seconds per category, steps, outputs."""
    timers, ran = StepTimers(), []

    def on_step(result):
        timers.on_step(result)
        if result.scheduled:
            ran.append(all(not s.is_prefill for s in result.scheduled))

    with timers.around(llm.llm_engine.model):
        outputs = llm.generate(prompts, params, on_step=on_step)
    return dict(timers.split(), steps=len(ran), decode_only=sum(ran), outputs=outputs)
