"""The serve command's flags, and the engine they describe: shared by the server process and the engine core.

``add_arguments`` declares ``python -m tinypaged serve``'s flags (vLLM's names where vLLM has the knob); each
flag's type checks it at parse time, so a bad value is a one-line error naming the flag before any model loads.
``build_llm`` turns parsed flags into the ``LLM`` (in the server process with ``--no-multiprocessing``, else in
the engine core process, from ``core_args``: the flags as JSON values, plug-ins as their ``MODULE:NAME`` spec).
vLLM keeps the same split: ``vllm/engine/arg_utils.py`` and ``vllm/entrypoints/openai/cli_args.py``.
"""

from __future__ import annotations

import argparse
import json
import re
from typing import Any

from tinypaged.config import ATTENTION_BACKENDS as BACKENDS
from tinypaged.config import KV_MANAGERS, MOVED_POLICIES, SCHEDULERS, SCHEDULING_POLICIES, EngineConfig


def port_number(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a port number") from None
    if not 1 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"a port is a number in 1..65535, got {value}")
    return value


def int_at_least(lowest: int):
    """An argparse type: an integer >= ``lowest``, or a one-line error naming what was given."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
        if value < lowest:
            raise argparse.ArgumentTypeError(f"must be an integer >= {lowest}, got {value}")
        return value

    return parse


class PluginSpec(str):
    """A plug-in flag's ``MODULE:NAME`` text with the object it names (``.obj``): the in-process engine uses the
    object, the engine core process loads the spec again in its own interpreter."""

    obj: Any = None


def plugin(text: str):
    """An argparse type: ``MODULE:NAME`` or ``path/to/file.py:NAME``, loaded at once, so a bad one is a one-line
    error naming its flag before the model is loaded."""
    try:
        spec = PluginSpec(text)
        spec.obj = load_object(text)
        return spec
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def name_or_plugin(names, what: str):
    """An argparse type: one of ``names`` (a built-in: a registry's keys), or ``MODULE:NAME`` of ``what`` (a
    plug-in, loaded at once)."""
    def parse(text: str):
        if text in names:
            return text
        if ":" not in text:
            raise argparse.ArgumentTypeError(f"{text!r}: give {', '.join(names)}, or MODULE:NAME of {what}")
        return plugin(text)

    return parse


def scheduling_policy(text: str) -> str:
    """An argparse type: one of ``SCHEDULING_POLICIES`` (the order of the requests, as vLLM's flag). The course's
    earlier values (``MOVED_POLICIES``) and a plug-in's ``MODULE:NAME`` are refused naming their flag now."""
    if text in SCHEDULING_POLICIES:
        return text
    names = ", ".join(SCHEDULING_POLICIES)
    if text in MOVED_POLICIES:
        knob, new = MOVED_POLICIES[text]
        raise argparse.ArgumentTypeError(f"{text} is now --{knob.replace('_', '-')} {new} (as in vLLM, "
                                         f"--scheduling-policy orders the requests: {names})")
    if ":" in text:
        raise argparse.ArgumentTypeError(f"a scheduler to plug in is --scheduler-cls {text} (as in vLLM, "
                                         f"--scheduling-policy orders the requests: {names})")
    raise argparse.ArgumentTypeError(f"{text!r}: give {names} (a scheduler to plug in is --scheduler-cls)")


def registry_help(registry: dict, plugin: str | None, tail: str = "") -> str:
    """A flag's help made from its seam's registry (``tinypaged.config``): each name, its label, then the plug-in
    (None: the flag takes names only) and ``tail``."""
    names = "; ".join(f"{name}: {label}" for name, label in registry.items())
    text = names + (f"; or MODULE:NAME of {plugin}" if plugin else "") + tail
    return text.replace("%", "%%")  # argparse formats help with %


kv_cache_manager = name_or_plugin(KV_MANAGERS, "a KV-manager factory")
attention_backend = name_or_plugin(BACKENDS, "a decode function")
scheduler_cls = name_or_plugin(SCHEDULERS, "a scheduler")


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--served-model-name", default=None, help="the name clients ask for (default: --model)")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=port_number, default=8000)
    ap.add_argument("--max-queued-requests", type=int_at_least(0), default=256,
                    help="requests that may wait beyond max_num_seqs before the server answers 503 (course)")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--max-num-seqs", type=int, default=256)
    ap.add_argument("--max-num-batched-tokens", type=int, default=None)
    ap.add_argument("--max-model-len", type=int, default=None)
    ap.add_argument("--num-gpu-blocks-override", type=int, default=None)
    ap.add_argument("--kv-cache-memory-bytes", type=int, default=None)
    ap.add_argument("--enable-prefix-caching", action="store_true")
    ap.add_argument("--parallel-sampling", default=None, choices=("fork", "fanout"),
                    help="n > 1: fork (the paper's copy-on-write samples, one request; the default) or fanout (vLLM "
                         "v1: n child requests sharing the prompt through the prefix cache)")
    ap.add_argument("--kv-cache-manager", default=None, type=kv_cache_manager,
                    help=registry_help(KV_MANAGERS, "a KV-manager factory to plug in (e.g. a learner's, from a .py "
                                                    "file: path/to/file.py:Name); default: paged"))
    ap.add_argument("--scheduling-policy", default=None, type=scheduling_policy,
                    help=registry_help(SCHEDULING_POLICIES, None, ". The order of the requests; default: fcfs. "
                                       "With priority, the requests' priority field orders them"))
    ap.add_argument("--scheduler-cls", default=None, type=scheduler_cls,
                    help=registry_help(SCHEDULERS, "a schedule_step-like function or a policy to plug in; default: "
                                                   "the engine's continuous step, in --scheduling-policy's order"))
    ap.add_argument("--attention-backend", default=None, type=attention_backend,
                    help=registry_help(BACKENDS, "a decode function; default: sdpa, the fast path"))
    ap.add_argument("--no-multiprocessing", dest="multiprocessing", action="store_false", default=None,
                    help="step the engine on a thread of the server's process instead of in its own engine-core "
                         "process (default: TINYPAGED_ENABLE_MULTIPROCESSING, on unless set to 0)")
    ap.add_argument("--no-access-log", dest="access_log", action="store_false",
                    help="no line per request (as uvicorn's --no-access-log)")
    ap.add_argument("--timeout-keep-alive", type=int_at_least(1), default=5,
                    help="close an idle kept-alive HTTP connection after this many seconds (vLLM's flag, uvicorn's "
                         "default 5); a request's head must arrive within 10 s and its body within 30 s")
    ap.add_argument("--kv-events-config", default=None, type=kv_events_config, metavar="JSON",
                    help="publish KV cache events as vLLM does (stage 9), e.g. '{\"enable_kv_cache_events\": true, "
                         "\"endpoint\": \"tcp://127.0.0.1:5557\"}' (engine/kv_events.py)")


def kv_events_config(text: str):
    """An argparse type: ``--kv-events-config``'s JSON, checked field by field before the model loads."""
    from tinypaged.engine.kv_events import parse_config

    try:
        return parse_config(text)
    except ValueError as exc:  # argparse names the flag itself
        raise argparse.ArgumentTypeError(re.sub(r"^--kv-events-config:? ", "", str(exc))) from None


def check_kv_events(args) -> None:
    """``--kv-events-config`` with events on needs the prefix cache: refused before the model loads."""
    events = getattr(args, "kv_events_config", None)
    if isinstance(events, str):  # a caller's own namespace (the engine core's)
        from tinypaged.engine.kv_events import parse_config

        events = parse_config(events)
    if events is not None and events.enabled and not args.enable_prefix_caching:
        raise ValueError("--kv-events-config: KV events describe the prefix cache: add --enable-prefix-caching")


def load_object(spec: str):
    """``package.module:name`` or ``path/to/file.py:name`` -> the object. Whatever goes wrong (no such module or
    file, an error while running it, no such name) is a ValueError whose one line says what and where."""
    import importlib
    import importlib.util
    import pathlib
    import traceback

    if ":" not in spec:
        raise ValueError(f"{spec!r}: give MODULE:NAME or path/to/file.py:NAME")
    where, name = spec.rsplit(":", 1)
    if not where or not name:
        raise ValueError(f"{spec!r}: give MODULE:NAME or path/to/file.py:NAME")
    path = pathlib.Path(where)
    if where.endswith(".py") and not path.is_file():
        raise ValueError(f"{where}: no such file")
    try:
        if where.endswith(".py"):
            mod_spec = importlib.util.spec_from_file_location(path.stem, path)
            module = importlib.util.module_from_spec(mod_spec)
            mod_spec.loader.exec_module(module)
        else:
            module = importlib.import_module(where)
    except ModuleNotFoundError as exc:
        if exc.name and (where == exc.name or where.startswith(exc.name + ".")):  # not one that it imports
            raise ValueError(f"no module named {exc.name!r} (give MODULE:NAME of an importable module, "
                             f"or path/to/file.py:NAME)") from None
        raise ValueError(f"importing {where} failed: {type(exc).__name__}: {exc}") from None
    except BaseException as exc:  # noqa: BLE001 - the plug-in's own code failed (SyntaxError, NameError, exit())
        if isinstance(exc, KeyboardInterrupt):
            raise
        frames = traceback.extract_tb(exc.__traceback__)
        at = f" (at {frames[-1].filename}:{frames[-1].lineno})" if frames else ""
        if isinstance(exc, SyntaxError):
            at = f" (at {exc.filename}:{exc.lineno})"
        raise ValueError(f"importing {where} failed: {type(exc).__name__}: {exc}{at}") from None
    if not hasattr(module, name):
        raise ValueError(f"{where} has no {name!r}")
    return getattr(module, name)


def engine_knobs(args) -> tuple[dict, object]:
    """serve's arguments as ``EngineConfig`` fields (plug-ins loaded: a bad spec is a ValueError), and the parsed
    ``--kv-events-config`` (None when not given)."""
    knobs = dict(dtype=args.dtype, device=args.device, block_size=args.block_size, max_num_seqs=args.max_num_seqs,
                 max_num_batched_tokens=args.max_num_batched_tokens, max_model_len=args.max_model_len,
                 num_gpu_blocks_override=args.num_gpu_blocks_override,
                 kv_cache_memory_bytes=args.kv_cache_memory_bytes, enable_prefix_caching=args.enable_prefix_caching,
                 history_size=0)
    if getattr(args, "parallel_sampling", None) is not None:
        knobs["parallel_sampling"] = args.parallel_sampling
    # the plug-in flags hold the loaded objects (``plugin``); a string (a caller's own namespace) is loaded here
    for flag in ("kv_cache_manager", "scheduling_policy", "scheduler_cls", "attention_backend"):
        value = getattr(args, flag, None)
        if value is not None:
            if isinstance(value, PluginSpec) and value.obj is not None:
                value = value.obj
            elif isinstance(value, str) and value not in {**BACKENDS, **KV_MANAGERS, **SCHEDULING_POLICIES,
                                                          **SCHEDULERS}:
                value = load_object(value)
            knobs[flag] = value
    events = getattr(args, "kv_events_config", None)
    if isinstance(events, str):  # a caller's own namespace
        from tinypaged.engine.kv_events import parse_config

        events = parse_config(events)
    check_kv_events(args)
    if events is not None and events.enabled:
        knobs["enable_kv_cache_events"] = True  # the prefix cache records its changes (tinypaged/kv/events.py)
    return knobs, events


def engine_config(args):
    """``(EngineConfig, kv events config or None)`` from serve's arguments: what the engine core process builds
    its ``LLMEngine`` from (a bad knob raises here, as ``LLM(...)`` would)."""
    knobs, events = engine_knobs(args)
    return EngineConfig(model=args.model, **knobs), events


def attach_kv_events(engine, events) -> None:
    """Publish ``engine``'s KV events after each of its steps, where the engine steps (``--kv-events-config``)."""
    if events is not None and events.enabled:
        from tinypaged.engine import kv_events

        kv_events.attach(engine, events)


def build_llm(args):
    """serve's in-process ``LLM`` (``--no-multiprocessing``, ``create_app``), its KV events attached."""
    from tinypaged import LLM

    knobs, events = engine_knobs(args)
    llm = LLM(args.model, **knobs)
    attach_kv_events(llm.llm_engine, events)
    return llm


def multiprocessing_enabled(args) -> bool:
    """``--no-multiprocessing``, else ``TINYPAGED_ENABLE_MULTIPROCESSING`` (as vLLM's ``VLLM_ENABLE_V1_MULTIPROCESSING``:
    on unless "0"), for serve only: the offline ``LLM`` always steps in-process."""
    import os

    if getattr(args, "multiprocessing", None) is not None:
        return bool(args.multiprocessing)
    value = os.environ.get("TINYPAGED_ENABLE_MULTIPROCESSING", "1").strip()
    if value not in ("0", "1"):
        raise ValueError(f"TINYPAGED_ENABLE_MULTIPROCESSING must be 0 or 1, got {value!r}")
    return value == "1"


def core_args(args) -> dict:
    """serve's arguments as the engine core process gets them (JSON): plug-ins as their spec, loaded there."""
    import dataclasses

    out = {}
    for name in ("model", "dtype", "device", "block_size", "max_num_seqs", "max_num_batched_tokens", "max_model_len",
                 "num_gpu_blocks_override", "kv_cache_memory_bytes", "enable_prefix_caching", "kv_cache_manager",
                 "scheduling_policy", "scheduler_cls", "attention_backend", "kv_events_config",
                 "parallel_sampling"):
        value = getattr(args, name, None)
        if dataclasses.is_dataclass(value):  # --kv-events-config, parsed: back to its JSON
            value = json.dumps(dataclasses.asdict(value))
        elif value is not None and not isinstance(value, (str, int, float, bool)):
            raise ValueError(f"--{name.replace('_', '-')}: the engine core process loads plug-ins by their "
                             f"MODULE:NAME spec; got an object ({value!r}): give its spec, or --no-multiprocessing")
        out[name] = str(value) if isinstance(value, str) else value
    return out
