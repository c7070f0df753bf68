"""The lab: tools that measure the engine (stages 1 and 6). They import the engine; the engine never
imports them.

* :mod:`~tinypaged.lab.workloads` - ShareGPT-like and Alpaca-like request lengths, traces;
* :mod:`~tinypaged.lab.memory_sim` - a trace replayed on the engine's KV managers and scheduler,
  counting every slot (stage 1's memory shares);
* :mod:`~tinypaged.lab.serving` - serving under load: TTFT, TPOT, normalized latency, sustainable rate;
* :mod:`~tinypaged.lab.simulator` - the same scheduler and managers without a model, with a fitted
  step-cost model (the paper's scale by simulation).
"""
