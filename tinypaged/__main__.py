"""Command line: see the engine work without a notebook.

    python -m tinypaged generate "Once upon a time" --max-tokens 32
    python -m tinypaged chat "What is a KV cache?"
    python -m tinypaged prepare          # convert SmolLM2 once (done by the set-up scripts)
    python -m tinypaged serve --model smollm2-135m --port 8000   # an OpenAI-compatible server
"""

from __future__ import annotations

import argparse
import sys


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tinypaged")
    sub = ap.add_subparsers(dest="cmd", required=True)
    sub.add_parser("prepare", help="convert the SmolLM2 GGUF to a cached Hugging Face folder")
    from tinypaged import server

    server.add_arguments(sub.add_parser("serve", help="serve the model over an OpenAI-compatible HTTP API"))
    for name in ("generate", "chat"):
        g = sub.add_parser(name)
        g.add_argument("prompts", nargs="+")
        g.add_argument("--model", default="smollm2-135m")
        g.add_argument("--max-tokens", type=int, default=32)
        g.add_argument("--temperature", type=float, default=0.0)
        g.add_argument("--kv-cache", default="paged", choices=["paged", "contiguous"])
        g.add_argument("--enable-prefix-caching", action="store_true")
        g.add_argument("--attention-backend", default="torch", choices=["torch", "triton"])
        g.add_argument("--trace", action="store_true", help="print one line per engine step")
    args = ap.parse_args(argv)
    if args.cmd == "serve":
        return server.serve(args)
    if args.cmd == "prepare":
        from tinypaged.model_loader import smollm2_folder

        print(f"SmolLM2 ready in {smollm2_folder()}")
        return 0
    from tinypaged import LLM, SamplingParams

    llm = LLM(args.model, kv_cache=args.kv_cache, enable_prefix_caching=args.enable_prefix_caching,
              attention_backend=args.attention_backend)
    params = SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens, seed=0)
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
