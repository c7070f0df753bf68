"""What crosses from the judge into the sandbox: a case of a check as data, never as code or a pickle.

The judge (:mod:`~tinypaged.course.grading.verify`, the grader's own process) draws every case of a check
itself, hidden seeds included, and sends the sandbox one *call* per case::

    {"part": "slot_mapping", "label": "one block",
     "driver": ["tinypaged.course.checks.stage02", "cases_slot_mapping.<locals>.one.<locals>.<lambda>", 80, "9f2c.."],
     "inputs": [...]}

``driver`` names a function of the checks' own code (module, qualified name, first line, a digest of its
bytecode): the code that calls the learner's part and records what it returned. The sandbox's copy of the
checks (the student edition ships them unchanged) holds the same function, found by that name; the digest
proves it is the same code. ``inputs`` are the values that function closes over (the case's inputs), encoded as
tagged JSON: numbers, strings, lists, tuples, dicts, ranges, tensors (dtype, shape, bytes), the package's own
functions and classes by name, the package's dataclasses field by field, and other check functions in the
same form as the driver. Nothing else can be encoded: :func:`encode` raises :class:`NotData` naming the value.

The sandbox only *decodes* this (:func:`case_function`); it sends back plain JSON (each case's steps) that the
judge validates as data and never executes or unpickles (:mod:`~tinypaged.course.grading.evidence`). The hidden
seed a notebook names never enters a call: the judge draws hidden cases from a keyed digest of it
(:func:`~tinypaged.course.grading.verify.effective_seed`), so even the values derived from it reveal nothing.
"""

from __future__ import annotations

import base64
import dataclasses
import hashlib
import importlib
import math
import sys
import types

MAX_DEPTH = 40


class NotData(TypeError):
    """A case closes over something the wire cannot carry (a bug in the check, found by the tests)."""


def _digest(code: types.CodeType) -> str:
    h = hashlib.sha256(code.co_code)
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            h.update(_digest(const).encode())
        elif isinstance(const, (str, int, float, bytes, bool, type(None))):
            h.update(repr(const).encode())
    h.update(repr(code.co_names).encode())
    return h.hexdigest()[:16]


def _by_name(obj) -> list | None:
    """``["ref", module, qualname]`` for a module-level function or class reachable by its name, else None."""
    module, qualname = getattr(obj, "__module__", None), getattr(obj, "__qualname__", None)
    if not (isinstance(module, str) and isinstance(qualname, str)) or "<locals>" in qualname:
        return None
    target = sys.modules.get(module)
    for part in qualname.split("."):
        target = getattr(target, part, None)
    return ["ref", module, qualname] if target is obj else None


def encode(value, depth: int = 0):
    """``value`` as tagged JSON (see the module docstring); :class:`NotData` for anything else."""
    if depth > MAX_DEPTH:
        raise NotData("a case's inputs nest too deeply")
    if value is None or isinstance(value, (bool, str)):
        return value
    if isinstance(value, int):
        return int(value)
    if isinstance(value, float):
        return value if math.isfinite(value) else ["float", repr(value)]
    if isinstance(value, list):
        return ["list", [encode(v, depth + 1) for v in value]]
    if isinstance(value, tuple) and not hasattr(value, "_fields"):
        return ["tuple", [encode(v, depth + 1) for v in value]]
    if isinstance(value, dict):
        return ["dict", [[encode(k, depth + 1), encode(v, depth + 1)] for k, v in value.items()]]
    if isinstance(value, (set, frozenset)):
        return ["set", [encode(v, depth + 1) for v in sorted(value, key=repr)]]
    if isinstance(value, range):
        return ["range", value.start, value.stop, value.step]
    if isinstance(value, bytes):
        return ["bytes", value.hex()]
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(value, torch.Tensor):
        t = value.detach().cpu().contiguous()
        raw = t.view(torch.int16) if t.dtype == torch.bfloat16 else t
        return ["tensor", str(t.dtype).removeprefix("torch."), list(t.shape), value.device.type,
                base64.b64encode(raw.numpy().tobytes()).decode()]
    if isinstance(value, types.FunctionType):
        ref = _by_name(value)
        if ref is not None:
            return ref
        return encode_function(value, depth)
    if isinstance(value, type) or isinstance(value, types.BuiltinFunctionType):
        ref = _by_name(value)
        if ref is not None:
            return ref
    if isinstance(value, types.ModuleType):
        return ["module", value.__name__]
    if dataclasses.is_dataclass(value) and not isinstance(value, type) \
            and str(type(value).__module__).startswith("tinypaged."):
        ref = _by_name(type(value))
        if ref is not None:
            fields = [[f.name, encode(getattr(value, f.name), depth + 1)] for f in dataclasses.fields(value)]
            return ["dataclass", ref, fields]
    raise NotData(f"a case's inputs hold a {type(value).__module__}.{type(value).__qualname__}, which is not data")


def encode_function(fn: types.FunctionType, depth: int = 0) -> list:
    """A function of the checks' code that closes over data: its name, its code's digest, and what it closes
    over (the driver of a call, or a helper a driver was given)."""
    code = fn.__code__
    module = fn.__module__
    if not str(module).startswith("tinypaged."):
        raise NotData(f"{module}.{fn.__qualname__} is not the checks' own code")
    cells = []
    for name, cell in zip(code.co_freevars, fn.__closure__ or ()):
        try:
            cells.append(encode(cell.cell_contents, depth + 1))
        except ValueError:  # an empty cell (a name bound later)
            cells.append(["empty"])
        except NotData as e:
            raise NotData(f"{fn.__qualname__} closes over {name!r}: {e}") from None
    defaults = [encode(v, depth + 1) for v in fn.__defaults__ or ()]
    kwdefaults = [[k, encode(v, depth + 1)] for k, v in (fn.__kwdefaults__ or {}).items()]
    return ["fn", [module, fn.__qualname__, code.co_firstlineno, _digest(code)], cells, defaults, kwdefaults]


# ---------------------------------------------------------------- the sandbox's side

_CODES: dict[str, dict] = {}


def _codes_of_module(module: types.ModuleType) -> dict:
    """(qualname, first line) -> code object, for every function compiled from the module's source."""
    name = module.__name__
    if name not in _CODES:
        import inspect

        source = inspect.getsource(module)
        top = compile(source, module.__file__, "exec", dont_inherit=True)
        found, todo = {}, [top]
        while todo:
            code = todo.pop()
            for const in code.co_consts:
                if isinstance(const, types.CodeType):
                    found[(const.co_qualname, const.co_firstlineno)] = const
                    todo.append(const)
        _CODES[name] = found
    return _CODES[name]


def _ref(module: str, qualname: str):
    if not (module == "builtins" or module.startswith(("tinypaged", "torch", "math", "random", "functools"))):
        raise NotData(f"{module} is not a module a case may name")
    obj = importlib.import_module(module)
    for part in qualname.split("."):
        obj = getattr(obj, part)
    return obj


def decode(data):
    """The value :func:`encode` made (in the sandbox; the judge never decodes what comes back this way)."""
    if data is None or isinstance(data, (bool, int, float, str)):
        return data
    if not (isinstance(data, list) and data and isinstance(data[0], str)):
        raise NotData(f"not an encoded value: {str(data)[:80]}")
    tag, rest = data[0], data[1:]
    if tag == "list":
        return [decode(v) for v in rest[0]]
    if tag == "tuple":
        return tuple(decode(v) for v in rest[0])
    if tag == "dict":
        return {decode(k): decode(v) for k, v in rest[0]}
    if tag == "set":
        return {decode(v) for v in rest[0]}
    if tag == "range":
        return range(*rest)
    if tag == "float":
        return float(rest[0])
    if tag == "bytes":
        return bytes.fromhex(rest[0])
    if tag == "tensor":
        import numpy as np
        import torch

        dtype, shape, device, raw = rest
        want = getattr(torch, dtype)
        held = torch.int16 if want == torch.bfloat16 else want
        np_dtype = torch.empty((), dtype=held).numpy().dtype
        t = torch.from_numpy(np.frombuffer(base64.b64decode(raw), dtype=np_dtype).copy()).reshape(shape)
        t = t.view(want) if want == torch.bfloat16 else t
        return t.to(device) if device != "cpu" and torch.cuda.is_available() else t
    if tag == "ref":
        return _ref(*rest)
    if tag == "module":
        _ref(rest[0], "__name__")  # only the modules a case may name
        return importlib.import_module(rest[0])
    if tag == "dataclass":
        cls = _ref(*rest[0][1:])
        obj = cls.__new__(cls)
        for name, value in rest[1]:
            object.__setattr__(obj, name, decode(value))
        return obj
    if tag == "fn":
        return _function(rest)
    raise NotData(f"unknown tag {tag!r}")


def _function(rest: list) -> types.FunctionType:
    (module_name, qualname, line, digest), cells, defaults, kwdefaults = rest
    module = importlib.import_module(module_name)
    code = _codes_of_module(module).get((qualname, line))
    if code is None or _digest(code) != digest:
        raise NotData(f"the sandbox's {module_name} has no function {qualname} at line {line} with the grader's "
                      "code (the student edition is out of date: rebuild it)")
    closure = tuple(types.CellType() if c == ["empty"] else types.CellType(decode(c)) for c in cells)
    fn = types.FunctionType(code, module.__dict__, code.co_name, tuple(decode(d) for d in defaults) or None,
                            closure or None)
    if kwdefaults:
        fn.__kwdefaults__ = {k: decode(v) for k, v in kwdefaults}
    fn.__qualname__ = qualname
    return fn


def encode_case(part: str, case) -> dict:
    """One call for the sandbox: the learner's part, the case's label and its driver with its inputs."""
    fn = case.run
    if isinstance(fn, types.FunctionType) and _by_name(fn) is None:
        driver = encode_function(fn)
    elif isinstance(fn, types.FunctionType):
        driver = ["fn", [fn.__module__, fn.__qualname__, fn.__code__.co_firstlineno, _digest(fn.__code__)],
                  [], [encode(d) for d in fn.__defaults__ or ()], []]
    else:
        raise NotData(f"case {case.label!r}: its run is a {type(fn).__name__}, not a function of the checks")
    return {"part": part, "label": case.label, "driver": driver[1], "inputs": driver[2:]}


def case_function(call: dict):
    """The driver of a call, rebuilt in the sandbox around its inputs: ``fn(impl, t)``."""
    cells, defaults, kwdefaults = call["inputs"]
    return _function([call["driver"], cells, defaults, kwdefaults])
