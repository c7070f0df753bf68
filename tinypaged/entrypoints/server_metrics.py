"""The server's Prometheus metrics, under vLLM's names where vLLM has them (``vllm:...``).

Built on ``prometheus_client`` with a registry per server (tests start several). Counters and
histograms move at the event, on the engine's loop thread. The gauges and the prefix-cache and preemption
counters are the engine's scheduler stats: with the engine core in its own process, the latest that came with
its outputs (``CoreClient.stats``: every output batch carries them, as vLLM's front end records its
``SchedulerStats``), so a scrape sends nothing to the core; in-process (``EngineLoop``), read from the engine at
scrape time, between two steps. Either way a step never pays for them.

| name | kind | meaning |
|---|---|---|
| ``vllm:num_requests_running`` / ``vllm:num_requests_waiting`` | gauge | sequences running / queued |
| ``vllm:kv_cache_usage_perc`` | gauge | 1 - free / total blocks (vLLM v1's formula), 0..1 |
| ``vllm:prefix_cache_queries_total`` / ``vllm:prefix_cache_hits_total`` | counter | prompt tokens looked up / found |
| ``vllm:num_preemptions_total`` | counter | preemptions |
| ``vllm:prompt_tokens_total`` / ``vllm:generation_tokens_total`` | counter | tokens in and out |
| ``vllm:request_success_total{finished_reason}`` | counter | ended samples: stop, length, abort (a hang-up), error |
| ``vllm:time_to_first_token_seconds`` | histogram | arrival to first token |
| ``vllm:inter_token_latency_seconds`` | histogram | time between a request's tokens |
| ``vllm:e2e_request_latency_seconds`` | histogram | arrival to finish |
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                   20.0, 40.0, 80.0)


class _EngineState:
    """Collects the scrape-time figures: the client's latest scheduler stats (``loop.stats``, where it keeps them),
    else the engine's, read between two steps (``loop.engine_metrics()``)."""

    def __init__(self, loop, model_name: str):
        self.loop, self.labels = loop, {"model_name": model_name}

    def collect(self):
        m = getattr(self.loop, "stats", None)  # CoreClient: from the core's latest outputs
        if m is None:  # EngineLoop (on its thread), or a core that has sent no output yet (a message to it)
            m = self.loop.engine_metrics()
        else:  # get_metrics counts swapped-out sequences as waiting; the stats keep them apart
            m = {**m, "num_waiting": m["num_waiting"] + m.get("num_swapped", 0)}
        names = ["model_name"]
        for name, doc, value in (("vllm:num_requests_running", "Sequences running.", m["num_running"]),
                                 ("vllm:num_requests_waiting", "Sequences waiting.", m["num_waiting"]),
                                 ("vllm:kv_cache_usage_perc", "KV-cache usage (1 = full).", m["kv_cache_usage"])):
            g = GaugeMetricFamily(name, doc, labels=names)
            g.add_metric([self.labels["model_name"]], float(value))
            yield g
        for name, doc, key in (("vllm:prefix_cache_queries", "Prompt tokens looked up in the prefix cache.",
                                "prefix_cache_queries"),
                               ("vllm:prefix_cache_hits", "Prompt tokens found in the prefix cache.",
                                "prefix_cache_hits"),
                               ("vllm:num_preemptions", "Preemptions.", "num_preemptions")):
            c = CounterMetricFamily(name, doc, labels=names)
            c.add_metric([self.labels["model_name"]], float(m.get(key, 0)))
            yield c


class ServerMetrics:
    def __init__(self, model_name: str):
        self.model_name = model_name
        self.registry = CollectorRegistry()
        lab = ["model_name"]
        self.prompt_tokens = Counter("vllm:prompt_tokens", "Prompt tokens of finished requests.", lab,
                                     registry=self.registry)
        self.generation_tokens = Counter("vllm:generation_tokens", "Generated tokens.", lab, registry=self.registry)
        self.request_success = Counter("vllm:request_success", "Finished requests.", lab + ["finished_reason"],
                                       registry=self.registry)
        self.ttft = Histogram("vllm:time_to_first_token_seconds", "Time to first token.", lab,
                              buckets=LATENCY_BUCKETS, registry=self.registry)
        self.itl = Histogram("vllm:inter_token_latency_seconds", "Time between two tokens of a request.", lab,
                             buckets=LATENCY_BUCKETS, registry=self.registry)
        self.e2e = Histogram("vllm:e2e_request_latency_seconds", "Arrival to finish.", lab,
                             buckets=LATENCY_BUCKETS, registry=self.registry)

    def watch(self, loop) -> None:
        """Read the engine's own counters at scrape time."""
        self.registry.register(_EngineState(loop, self.model_name))

    # on the loop thread --------------------------------------------------------------------------
    def on_step(self, result) -> None:
        if result.sampled:
            self.generation_tokens.labels(self.model_name).inc(len(result.sampled))

    def on_token_gap(self, seconds: float) -> None:
        self.itl.labels(self.model_name).observe(seconds)

    def on_finish(self, sub, out) -> None:
        name = self.model_name
        self.prompt_tokens.labels(name).inc(sub.num_prompt_tokens)
        failed = getattr(out, "error", None) is not None
        for c in out.outputs:
            self.request_success.labels(name, c.finish_reason or ("error" if failed else "abort")).inc()
        m = out.metrics
        if m is not None and m.time_to_first_token is not None:
            self.ttft.labels(name).observe(m.time_to_first_token)
        if m is not None and m.e2e_latency is not None:
            self.e2e.labels(name).observe(m.e2e_latency)

    def on_abort(self, sub) -> None:
        """A request aborted before it finished (a client that hung up): each of its samples counts under
        ``finished_reason="abort"``, as vLLM counts aborted requests (``EngineLoop``; the process server's
        aborts come back from the core as a finish with reason abort)."""
        name = self.model_name
        self.prompt_tokens.labels(name).inc(sub.num_prompt_tokens)
        self.request_success.labels(name, "abort").inc(sub.num_samples)

    def render(self) -> bytes:
        return generate_latest(self.registry)
