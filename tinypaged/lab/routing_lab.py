"""Stage 9 on one machine: real tiny-model replicas behind a router, for the lesson and the checks.

``serve_routed(prompts, router=...)`` starts ``num_replicas`` in-process replicas (``tinypaged.entrypoints.server``
apps on 127.0.0.1, each its own ``LLM`` with prefix caching), puts a router in front, sends ``prompts`` one after the
other through it, and returns where each went (when the router says), each replica's prefix-cache hit tokens and
requests, the outputs' token ids and the router's ``/health``. The router is either a policy object run by the
course's proxy (``tinypaged.entrypoints.router_proxy``) or, with ``vllm_router_policy="cache_aware"`` (or any of its
policies), the real ``vllm-router`` binary from the pinned ``vllm-router`` package, started as a subprocess and
stopped (terminate, then kill) before the call returns. Everything is bounded: ``timeout`` seconds per request, 60 s
for the router to come up.
"""

from __future__ import annotations

import logging
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

REPLICA_KW = dict(dtype="float32", device="cpu", num_gpu_blocks_override=64, block_size=4, max_num_seqs=4,
                  enable_prefix_caching=True, seed=0)


def vllm_router_binary() -> str | None:
    """The ``vllm-router`` executable next to this Python (the course's environment), or on ``PATH``."""
    here = Path(sys.executable).parent / "vllm-router"
    return str(here) if here.exists() else shutil.which("vllm-router")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class _VllmRouter:
    def __init__(self, policy: str, urls: list[str], up_within: float = 60.0, extra=()):
        import httpx

        binary = vllm_router_binary()
        if binary is None:
            raise RuntimeError("vllm-router is not installed: pip install vllm-router==0.1.17 (pinned in pyproject)")
        port = _free_port()
        self.url = f"http://127.0.0.1:{port}"
        self.proc = subprocess.Popen([binary, "--host", "127.0.0.1", "--port", str(port), "--worker-urls", *urls,
                                      "--policy", policy, *extra],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + up_within
        while True:
            try:
                if httpx.get(self.url + "/health", timeout=1).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.close()
                raise RuntimeError(f"vllm-router --policy {policy} did not come up on {self.url}")
            time.sleep(0.1)

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def serve_routed(*args, **kw) -> dict:
    """``prompts`` (token-id lists or texts) one after the other through a router in front of fresh tiny replicas
    (module docstring): ``serve_routed(prompts, router=policy)`` or ``serve_routed(prompts,
    vllm_router_policy="cache_aware")``; the engines' INFO lines are kept quiet."""
    from tinypaged.engine.llm_engine import configure_logging
    from tinypaged.lab.serving import quiet

    configure_logging()  # the engine's handler first, or the first engine would set INFO again
    with quiet(logging.WARNING):
        return _serve_routed(*args, **kw)


def _serve_routed(prompts, router=None, vllm_router_policy: str | None = None, max_tokens: int = 4,
                 num_replicas: int = 2, timeout: float = 120.0, vllm_router_args=(), **replica_kw) -> dict:
    import httpx

    from tinypaged import LLM
    from tinypaged.entrypoints.router_proxy import RouterProxy
    from tinypaged.entrypoints.server import ServerThread, create_app

    if (router is None) == (vllm_router_policy is None):
        raise ValueError("give exactly one of router (a policy object) and vllm_router_policy (a name)")
    llms = [LLM("tiny", **{**REPLICA_KW, **replica_kw}) for _ in range(num_replicas)]
    servers = []
    try:
        servers = [ServerThread(create_app(llm, "tiny")) for llm in llms]
        urls = [s.url for s in servers]
        front = RouterProxy(router, urls) if router is not None else _VllmRouter(vllm_router_policy, urls,
                                                                                 extra=vllm_router_args)
        with front, httpx.Client(timeout=timeout) as client:
            went, outputs = [], []
            for p in prompts:
                resp = client.post(front.url + "/v1/completions",
                                   json={"model": "tiny", "prompt": p if isinstance(p, str) else list(p),
                                         "max_tokens": max_tokens, "temperature": 0.0, "return_token_ids": True})
                resp.raise_for_status()
                to = resp.headers.get("x-routed-to")
                went.append(int(to) if to is not None else None)
                outputs.append(list(resp.json()["choices"][0].get("token_ids") or []))
            health = client.get(front.url + "/health").status_code
        metrics = [llm.get_metrics() for llm in llms]
        return {"went": went, "hits": [int(m["prefix_cache_hits"]) for m in metrics],
                "requests": [int(m["num_requests_finished"]) for m in metrics], "outputs": outputs, "health": health}
    finally:
        for s in servers:
            s.close()


def offline_greedy(prompts, max_tokens: int = 4, **replica_kw) -> list[list[int]]:
    """The offline engine's greedy token ids for ``prompts`` (token-id lists), one replica's settings."""
    from tinypaged import LLM, SamplingParams
    from tinypaged.engine.llm_engine import configure_logging
    from tinypaged.lab.serving import quiet

    configure_logging()
    with quiet(logging.WARNING):
        llm = LLM("tiny", **{**REPLICA_KW, **replica_kw})
    outs = llm.generate([{"prompt_token_ids": list(p)} for p in prompts],
                        SamplingParams(temperature=0.0, max_tokens=max_tokens))
    return [list(o.outputs[0].token_ids) for o in outs]
