"""Small helpers shared by the stage checks."""

from __future__ import annotations

import random


def raised(fn) -> str:
    """The name of the exception ``fn()`` raises ("no exception" if none). NotImplementedError propagates."""
    try:
        fn()
    except NotImplementedError:
        raise
    except Exception as e:
        return type(e).__name__
    return "no exception"


def raises(fn) -> bool:
    """Whether ``fn()`` raises an exception (any kind). NotImplementedError propagates."""
    return raised(fn) != "no exception"


def rng(seed: int | None, salt: int) -> random.Random:
    """A generator for hidden cases: the hidden seed mixed with a per-check salt."""
    return random.Random((seed or 0) * 1_000_003 + salt)
