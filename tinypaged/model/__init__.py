"""The model: a Llama written for the paged cache (``llama``), its loader (GGUF, the tiny seeded test model), and
the fused projections of the fast path (``fused``)."""
