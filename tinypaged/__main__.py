"""Command line: see the engine work without a notebook.

    python -m tinypaged generate "Once upon a time" --max-tokens 32
    python -m tinypaged chat "What is a KV cache?"
    python -m tinypaged prepare          # convert SmolLM2 once, save "tiny" (done by the set-up scripts); again if damaged
    python -m tinypaged serve --model smollm2-135m --port 8000   # an OpenAI-compatible server

``serve`` runs the engine core in its own process, as vLLM v1 (``entrypoints/engine_core.py``);
``TINYPAGED_ENABLE_MULTIPROCESSING=0`` or ``serve --no-multiprocessing`` steps it on a thread of the server's
process instead. ``generate`` and ``chat`` (and the offline ``LLM``) always step in-process.
    python -m tinypaged fleet --replicas 2 --policy cache_aware   # replicas behind vllm-router (stage 9)

A bad argument or knob prints one ``python -m tinypaged generate: error: ...`` line and exits with 2
(argparse's status for its own errors); no traceback.
"""

from __future__ import annotations

import argparse
import math
import sys

PROG = "python -m tinypaged"


class Parser(argparse.ArgumentParser):
    """argparse with a one-line error (its message names the argument) instead of the usage block."""

    def error(self, message):
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def temperature(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not math.isfinite(value) or value < 0:
        raise argparse.ArgumentTypeError(f"must be a finite number >= 0 (0 means greedy), got {text}")
    return value


def prompt(text: str) -> str:
    if not text.strip():
        raise argparse.ArgumentTypeError("a prompt must hold some text, got an empty one")
    return text


def main(argv=None) -> int:
    ap = Parser(prog=PROG)
    sub = ap.add_subparsers(dest="cmd", required=True)
    sub.add_parser("prepare", help="convert the SmolLM2 GGUF to a cached Hugging Face folder; save \"tiny\"'s weights")
    from tinypaged.entrypoints import cli_args

    cli_args.add_arguments(sub.add_parser("serve", help="serve the model over an OpenAI-compatible HTTP API"))
    from tinypaged.entrypoints import fleet

    fleet.add_arguments(sub.add_parser("fleet", help="N serve replicas behind vllm-router (other flags: serve's)"))
    for name in ("generate", "chat"):
        g = sub.add_parser(name)
        g.add_argument("prompts", nargs="+", type=prompt)
        g.add_argument("--model", default="smollm2-135m", help="'smollm2-135m', 'tiny' or a local folder")
        g.add_argument("--max-tokens", type=cli_args.int_at_least(1), default=32)
        g.add_argument("--temperature", type=temperature, default=0.0)
        g.add_argument("--kv-cache-manager", default="paged", choices=["paged", "contiguous"])
        g.add_argument("--enable-prefix-caching", action="store_true")
        g.add_argument("--attention-backend", default=None, choices=["torch", "sdpa", "triton"],
                       help="torch (reference), sdpa (fused; the default) or triton")
        g.add_argument("--trace", action="store_true", help="print one line per engine step")
    args, rest = ap.parse_known_args(argv)
    if rest and args.cmd != "fleet":
        ap.error(f"unrecognized arguments: {' '.join(rest)}")
    if args.cmd == "fleet":  # the fleet's other flags are its replicas' serve flags: checked here, before any start
        serve = Parser(prog=f"{PROG} fleet (replica flags)")
        cli_args.add_arguments(serve)
        serve.parse_args(["--model", args.model, *rest])
        args.serve_args = rest
    try:
        return run(args)
    except (ValueError, TypeError, NotImplementedError, FileNotFoundError) as e:
        # the engine's own checks (knobs, model, prompts, sampling params): their messages say what to change
        print(f"{PROG} {args.cmd}: error: {' '.join(str(e).split())}", file=sys.stderr)
        return 2


def run(args) -> int:
    if args.cmd == "fleet":
        from tinypaged.entrypoints import fleet

        return fleet.run(args, args.serve_args)
    if args.cmd == "serve":
        from tinypaged.entrypoints import server

        return server.serve(args)
    if args.cmd == "prepare":
        from tinypaged.model.loader import smollm2_folder, tiny_folder

        print(f"SmolLM2 ready in {smollm2_folder(repair=True)}")
        tiny = tiny_folder(0)
        print(f"tiny ready in {tiny}" if tiny is not None else "tiny: the cache is not writable; it is built in memory")
        from tinypaged import cpu_native

        ops = cpu_native.build()
        print(f"CPU operators ready in {ops.parent}" if ops is not None
              else f"CPU operators not built ({cpu_native.why()}): the torch code runs instead")
        return 0
    from tinypaged import LLM, SamplingParams

    params = SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens, seed=0)
    llm = LLM(args.model, kv_cache_manager=args.kv_cache_manager, enable_prefix_caching=args.enable_prefix_caching,
              attention_backend=args.attention_backend)
    on_step = (lambda s: print(s.trace(), file=sys.stderr)) if args.trace else None
    if args.cmd == "chat":
        outs = [llm.chat([{"role": "user", "content": p}], params)[0] for p in args.prompts]
    else:
        outs = llm.generate(args.prompts, params, on_step=on_step)
    for out in outs:
        print(f"--- {out.prompt!r}\n{out.outputs[0].text}  [{out.outputs[0].finish_reason}]")
    m = llm.get_metrics()
    print(f"--- {m['num_generated_tokens']} tokens in {m['num_steps']} steps", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
