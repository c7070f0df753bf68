"""Lesson 5 on a machine without Triton (macOS, Windows): its Triton cells print one line instead of failing.

A cell that cannot run without Triton starts with a comment naming what it shows::

    # Needs Triton: the one-page kernel matches the reference on sequence 0

Where Triton is installed (Linux; ``tinypaged.triton_mode.AVAILABLE``) nothing changes: the comment is a comment.
Without it, :func:`skip_triton_cells` (called by the lesson's first cell) registers an IPython input transformer
that replaces each such cell by one printed line, :func:`would_show`'s, so "Run All" goes through the lesson: the
PyTorch references and walk-throughs run, and the Triton cells say what they would have shown. Cells that mix
both test ``tinypaged.triton_mode.AVAILABLE`` themselves and call :func:`would_show` for their Triton half.
"""

MARKER = "# Needs Triton:"


def would_show(what: str) -> None:
    """The one line a Triton cell prints where Triton is absent."""
    print(f"[no Triton here] this would show: {what}")


def _marked(lines: list[str]) -> str | None:
    """The marker's text if the cell's leading comment lines carry it."""
    for line in lines:
        stripped = line.strip()
        if not stripped.startswith("#"):
            return None
        if stripped.startswith(MARKER):
            return stripped[len(MARKER):].strip()
    return None


def _skip_marked_cell(lines: list[str]) -> list[str]:
    what = _marked(lines)
    if what is None:
        return lines
    return ["from tinypaged.course.triton_cells import would_show\n", f"would_show({what!r})\n"]


def skip_triton_cells(ipython=None) -> bool:
    """Where Triton is absent, make this IPython session replace marked cells by one line. Returns whether it
    did (False where Triton is installed, or outside IPython, where cells are not a thing)."""
    from tinypaged import triton_mode

    if triton_mode.AVAILABLE:
        return False
    if ipython is None:
        try:
            from IPython import get_ipython
        except ImportError:
            return False
        ipython = get_ipython()
    if ipython is None:
        return False
    if _skip_marked_cell not in ipython.input_transformers_cleanup:
        ipython.input_transformers_cleanup.append(_skip_marked_cell)
    return True
