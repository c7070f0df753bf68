"""Notebook conventions for assignments (nbgrader's cell metadata plus the stage) and submission assembly.

A solution notebook ``solutions/NN_name.ipynb`` carries ``metadata.tinypaged.stage = "NN"`` and, on
every cell that matters, nbgrader's metadata (``metadata.nbgrader``, schema 3):

* solution cell (the learner writes it): ``solution: true``, ``grade: false``, ``locked: false``;
* test cell (autograded): ``grade: true``, ``solution: false``, ``locked: true``, ``points``;
* read-only cell (given code and instructions): ``locked: true``, ``grade: false``, ``solution: false``;
* free-response answer (manually graded, markdown): ``grade: true``, ``solution: true``, ``points``.

Every one of them has a unique ``grade_id``. Before a submission runs, :func:`assemble` puts the
instructor's version of every locked and test cell back (hidden tests included), keeps the learner's
solution cells and any cells the learner added, and marks which cells are the learner's.
"""

from __future__ import annotations

import copy
import json
import os
import re
from pathlib import Path

BEGIN, END = "### BEGIN SOLUTION", "### END SOLUTION"
BEGIN_HIDDEN, END_HIDDEN = "### BEGIN HIDDEN TESTS", "### END HIDDEN TESTS"
STUB = 'raise NotImplementedError("not implemented yet")'
LEARNER = "learner"  # metadata.tinypaged.role of cells whose code the learner controls


def source_of(cell) -> str:
    src = cell.get("source", "")
    return "".join(src) if isinstance(src, list) else src


def nbgrader_meta(cell) -> dict:
    meta = cell.get("metadata", {}).get("nbgrader")
    return meta if isinstance(meta, dict) else {}


def grade_id(cell) -> str | None:
    gid = nbgrader_meta(cell).get("grade_id")
    return gid if isinstance(gid, str) and gid else None


def is_solution(cell) -> bool:
    return bool(nbgrader_meta(cell).get("solution"))


def is_test(cell) -> bool:
    """An autograded test cell: a code cell with ``grade`` and without ``solution``."""
    m = nbgrader_meta(cell)
    return cell.get("cell_type") == "code" and bool(m.get("grade")) and not m.get("solution")


def is_manual(cell) -> bool:
    """A manually graded answer (free response): ``grade`` and ``solution`` together."""
    m = nbgrader_meta(cell)
    return bool(m.get("grade")) and bool(m.get("solution"))


def points(cell) -> float:
    try:
        return float(nbgrader_meta(cell).get("points", 0))
    except (TypeError, ValueError):
        return 0.0


def stage_of(nb: dict, path: Path | None = None) -> str | None:
    """The stage recorded in the notebook (``metadata.tinypaged.stage``); else the file name's NN_ prefix."""
    stage = nb.get("metadata", {}).get("tinypaged", {}).get("stage")
    if isinstance(stage, str) and re.fullmatch(r"\d\d", stage):
        return stage
    if path is not None and re.match(r"\d\d_", Path(path).name):
        return Path(path).name[:2]
    return None


def assignment_of(path: Path, solutions: Path) -> str:
    """The assignment a handed-in notebook is graded as, from its **file name** alone: the solution notebook
    (``solutions/NN_name.ipynb``) whose stem appears in the file's stem (``02_block_table.ipynb``,
    ``02_block_table-alice.ipynb``, ``alice_02_block_table.ipynb`` -> ``02_block_table``; a name inside a longer
    one counts as the longer one). The notebook's ``metadata.tinypaged.stage`` never decides it (a learner writes
    that). Raises ValueError, one line, when the name names no known assignment, or two."""
    stem = Path(path).stem
    known = sorted(p.stem for p in Path(solutions).glob("*.ipynb") if re.match(r"\d\d_", p.stem))
    found = [name for name in known if name in stem]
    found = [name for name in found if not any(name != other and name in other for other in found)]
    if len(found) == 1:
        return found[0]
    if found:
        raise ValueError(f"{Path(path).name} names more than one assignment ({', '.join(found)}): hand it in under "
                         f"its assignment's file name")
    raise ValueError(f"{Path(path).name} names no assignment (known: {', '.join(known) or 'none'}): "
                     f"hand it in under its assignment's file name, e.g. {known[0] if known else 'NN_name'}.ipynb")


def stage_mismatch(nb: dict, stage: str) -> str | None:
    """A consistency note when the notebook's own ``metadata.tinypaged.stage`` names another stage than the one
    it is graded as (None when it agrees or says nothing): reported, never used to pick the stage."""
    claimed = nb.get("metadata", {}).get("tinypaged", {}).get("stage") if isinstance(nb.get("metadata"), dict) else None
    if isinstance(claimed, str) and claimed != stage:
        return f"the notebook's metadata says stage {claimed!r}; it is graded as stage {stage!r} (its file name)"
    return None


def source_for_stage(stage: str, solutions: Path) -> Path:
    found = sorted(Path(solutions).glob(f"{stage}_*.ipynb"))
    if not found:
        raise FileNotFoundError(f"no solution notebook for stage {stage} in {solutions}")
    return found[0]


def strip_solutions(source: str) -> str:
    """Replace every BEGIN/END SOLUTION region with the stub at its indentation (as nbgrader does)."""
    out, inside = [], False
    for line in source.splitlines(keepends=True):
        stripped = line.strip()
        if stripped == BEGIN:
            if inside:
                raise ValueError("nested BEGIN SOLUTION")
            inside = True
            indent = line[: len(line) - len(line.lstrip())]
            out.append(f"{indent}{STUB}\n")
        elif stripped == END:
            if not inside:
                raise ValueError("END SOLUTION without BEGIN SOLUTION")
            inside = False
        elif not inside:
            out.append(line)
    if inside:
        raise ValueError("BEGIN SOLUTION without END SOLUTION")
    return "".join(out)


def _mark(cell, role: str) -> dict:
    cell.setdefault("metadata", {}).setdefault("tinypaged", {})["role"] = role
    return cell


def role(cell) -> str | None:
    return cell.get("metadata", {}).get("tinypaged", {}).get("role")


def strip_hidden(source: str) -> str:
    """A cell's code with every hidden-tests region removed, marker lines included (as nbgrader's
    ``ClearHiddenTests`` releases it, line by line)."""
    out, inside = [], False
    for line in source.split("\n"):
        if BEGIN_HIDDEN in line:
            inside = True
        elif END_HIDDEN in line:
            inside = False
        elif not inside:
            out.append(line)
    return "\n".join(out)


def without_hidden_tests(nb: dict) -> dict:
    """A copy of ``nb`` whose cells hold no hidden-tests region (what a learner's kernel may be given)."""
    out = copy.deepcopy(nb)
    for cell in out.get("cells", []):
        if isinstance(cell, dict) and (BEGIN_HIDDEN in source_of(cell) or END_HIDDEN in source_of(cell)):
            cell["source"] = strip_hidden(source_of(cell))
    return out


def assemble(source_nb: dict, submission_nb: dict) -> dict:
    """The notebook to execute: the submission's order and solution cells, the instructor's everything else.

    * a cell whose ``grade_id`` is a locked or test cell of the source: the source's cell (trusted code,
      hidden tests included, trusted metadata such as points);
    * a solution cell of the source: the learner's code under the source's metadata;
    * any other cell (added by the learner, or carrying a grade_id the source does not know): kept as
      the learner's, without nbgrader metadata;
    * a source cell the submission lost: put back after the cell that precedes it in the source (a lost
      solution cell comes back as the exercise's stub).
    """
    src_cells = [c for c in source_nb["cells"]]
    by_id = {grade_id(c): c for c in src_cells if grade_id(c)}
    out, seen = [], set()
    for cell in submission_nb.get("cells", []):
        if not isinstance(cell, dict) or cell.get("cell_type") not in ("code", "markdown", "raw"):
            continue
        gid = grade_id(cell)
        ref = by_id.get(gid) if gid else None
        if ref is not None and gid not in seen and ref.get("cell_type") == cell.get("cell_type"):
            seen.add(gid)
            if is_solution(ref) and not nbgrader_meta(ref).get("locked"):
                mine = copy.deepcopy(ref)
                mine["source"] = source_of(cell)
                out.append(_mark(mine, LEARNER))
            else:
                out.append(_mark(copy.deepcopy(ref), "given"))
            continue
        mine = {"cell_type": cell["cell_type"], "metadata": {}, "source": source_of(cell)}
        if cell["cell_type"] == "code":
            mine.update(outputs=[], execution_count=None)
        out.append(_mark(mine, LEARNER))
    # Put back what the submission lost, after its predecessor in the source.
    for i, ref in enumerate(src_cells):
        gid = grade_id(ref)
        if not gid or gid in seen:
            continue
        restored = copy.deepcopy(ref)
        if is_solution(ref) and ref.get("cell_type") == "code":
            restored["source"] = strip_solutions(source_of(ref))
            _mark(restored, LEARNER)
        else:
            _mark(restored, "given")
        at = 0
        for prev in reversed(src_cells[:i]):
            pid = grade_id(prev)
            pos = next((k for k, c in enumerate(out) if pid and grade_id(c) == pid), None)
            if pos is not None:
                at = pos + 1
                break
        out.insert(at, restored)
        seen.add(gid)
    for cell in out:
        if cell["cell_type"] == "code":
            cell["outputs"], cell["execution_count"] = [], None
    nb = copy.deepcopy({k: v for k, v in source_nb.items() if k != "cells"})
    nb["cells"] = out
    return nb


MAX_NOTEBOOK_BYTES = 64 << 20  # a submitted notebook larger than this is refused (read back with a cap)
READ_SECONDS = 10.0  # and one that takes longer than this to read


def read_capped(path: Path, max_bytes: int = MAX_NOTEBOOK_BYTES, seconds: float = READ_SECONDS) -> bytes:
    """The bytes of a file a learner (or a sandbox) controls, read safely by a privileged grader.

    Invariants: the last component is opened with ``O_NOFOLLOW`` (a symbolic link is refused, never followed to
    ``/etc/shadow`` or ``/dev/zero``) and ``O_NONBLOCK`` (a FIFO cannot hang the open); the opened file must be a
    regular file (``fstat``, ``S_ISREG``: no FIFO, device or socket); at most ``max_bytes`` are read and a larger
    file is refused; reading stops after ``seconds``. Every refusal is a ValueError naming the file and the
    problem."""
    import stat
    import time

    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as e:
        if Path(path).is_symlink():
            raise ValueError(f"{path} is a symbolic link: refused (hand in the file itself)") from None
        raise ValueError(f"{path} cannot be opened ({e.strerror})") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise ValueError(f"{path} is not a regular file (mode {stat.filemode(st.st_mode)}): refused")
        if st.st_size > max_bytes:
            raise ValueError(f"{path} is {st.st_size} bytes, over the limit of {max_bytes}: refused")
        deadline, chunks, size = time.monotonic() + seconds, [], 0
        while True:
            chunk = os.read(fd, 1 << 20)
            if not chunk:
                return b"".join(chunks)
            size += len(chunk)
            if size > max_bytes:
                raise ValueError(f"{path} grew past the limit of {max_bytes} bytes while being read: refused")
            if time.monotonic() > deadline:
                raise ValueError(f"{path} took longer than {seconds:g} s to read: refused")
            chunks.append(chunk)
    finally:
        os.close(fd)


def read(path: Path, within: Path | None = None) -> dict:
    """A notebook as a dict (read with :func:`read_capped`: no link followed, no FIFO or device, a size cap); a
    file that is not a notebook raises ValueError naming it. So does a symbolic link
    (a submission must be the learner's own file: a link could hand in ``solutions/``) and a path that resolves
    outside ``within`` (default: the folder it is in)."""
    path = Path(path)
    for p in (path, path.absolute().parent):
        if p.is_symlink():
            raise ValueError(f"{p} is a symbolic link (to {os.readlink(p)}): hand in the notebook file itself")
    folder = Path(within) if within is not None else path.parent
    real, home = path.resolve(), folder.resolve()
    if home not in real.parents:
        raise ValueError(f"{path} resolves to {real}, outside its folder {folder}: hand in the notebook file itself")
    try:
        data = read_capped(path)
    except ValueError as e:  # "PATH is a FIFO ..." -> "PATH is not a readable notebook: it is a FIFO ..."
        raise ValueError(f"{path} is not a readable notebook: it {str(e).removeprefix(f'{path} ')}") from None
    try:
        nb = json.loads(data.decode())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{path} is not a readable notebook: {e}") from e
    if not isinstance(nb, dict) or not isinstance(nb.get("cells"), list):
        raise ValueError(f"{path} is not a notebook (no cells)")
    return nb


def _blank_magics(source: str) -> str:
    """IPython magics and shell escapes are not Python: blank them, keeping line numbers."""
    return "\n".join("" if re.match(r"\s*[%!]", line) else line for line in source.splitlines()) + "\n"


def module_cells(source_nb: dict, submission_nb: dict) -> list[dict]:
    """The learner's module, cell by cell, decided by the instructor's source alone.

    In the source's order: every given (locked, not test) code cell with the instructor's code, and
    every solution code cell with the learner's code from the submission's first code cell that carries
    the same ``grade_id`` (the stub when there is none). Test cells are left out (the checks' process
    makes their calls); cells the learner added and the submission's own metadata play no part, so
    re-marking a cell, adding ``plugins = {}`` or editing a given cell changes nothing here.
    """
    mine: dict[str, str] = {}
    for cell in submission_nb.get("cells", []):
        if isinstance(cell, dict) and cell.get("cell_type") == "code":
            gid = grade_id(cell)
            if gid and gid not in mine:
                mine[gid] = source_of(cell)
    out = []
    for i, ref in enumerate(source_nb["cells"]):
        if ref.get("cell_type") != "code" or is_test(ref):
            continue
        gid = grade_id(ref)
        learner = is_solution(ref) and not nbgrader_meta(ref).get("locked")
        src = mine.get(gid, strip_solutions(source_of(ref))) if learner else source_of(ref)
        out.append({"index": i, "grade_id": gid, "source": _blank_magics(src), "learner": learner})
    return out
