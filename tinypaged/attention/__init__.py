"""Attention backends: the reference ``TorchBackend`` (lessons 2-3), ``SDPABackend`` (torch's fused kernel, the
fast path), ``TritonBackend`` (stage 5's kernels), and ``selector.make_backend``, which picks one."""
