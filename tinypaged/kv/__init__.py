"""KV cache managers: stage 1's contiguous baseline, stage 2-3's block pool and block tables (copy-on-write,
prefix caching, swap), stage 7's radix cache, and ``managers.build_kv_manager``, which builds the chosen one
(vLLM v1's ``v1/core``)."""
