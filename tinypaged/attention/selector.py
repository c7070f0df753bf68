"""Which attention backend runs: the one place where a name, a decode function or an object becomes an
``AttentionBackend`` (the engine asks here once, at construction)."""

from __future__ import annotations

from tinypaged.attention.backends import DecodeFunctionBackend, TorchBackend, TritonBackend
from tinypaged.attention.sdpa import SDPABackend
from tinypaged.interfaces import BACKEND_REQUIRED, require


def make_backend(choice, block_size: int):
    """"torch" (the reference), "sdpa" (torch's fused attention), "triton" (stage 5's kernels), a paged decode
    function, or a backend object (checked against the protocol)."""
    if choice == "sdpa":
        return SDPABackend()
    if choice == "torch":
        return TorchBackend()
    if choice == "triton":
        return TritonBackend(block_size)
    if isinstance(choice, type):
        choice = choice()
    if hasattr(choice, "decode") or hasattr(choice, "write"):
        require(choice, BACKEND_REQUIRED, "attention_backend")
        return choice
    if callable(choice):
        return DecodeFunctionBackend(choice)
    raise TypeError(f"attention_backend={choice!r}: use 'torch', 'sdpa', 'triton', a paged decode function or an "
                    f"AttentionBackend object")
