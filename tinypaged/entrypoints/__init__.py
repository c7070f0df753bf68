"""Serving: the OpenAI-compatible HTTP server, the loop that steps the engine for it, and its Prometheus metrics
(vLLM's ``entrypoints/openai``)."""
