"""Stage 9: a small HTTP routing proxy that runs any routing policy in front of OpenAI-compatible replicas.

Given code (the policy is what the learner writes): ``create_proxy_app(policy, replica_urls)`` is a FastAPI app
that forwards ``POST /v1/completions`` and ``POST /v1/chat/completions`` to the replica ``policy.route(ids)``
picks and calls ``policy.finished(replica)`` once the replica's response has been passed on in full (or the
client went away). ``ids`` is the request's ``prompt`` when it is a list of token ids; otherwise the UTF-8 bytes
of its text (the prompt, or the chat messages' contents joined), a text-level key like SGLang's router uses.
Streams pass through chunk by chunk. ``GET /health`` answers 200 when every replica's ``/health`` does;
``GET /v1/models`` and ``GET /metrics`` are the first replica's; ``GET /router/stats`` says how many requests
went to each replica.

``RouterProxy(policy, urls)`` runs it on 127.0.0.1 and a free port in a background thread (a context manager).
Bounds: a request body over ``max_body_bytes`` is refused with 413 before any routing; a replica that does not
answer within ``timeout`` seconds gives a 502 naming it, and the policy gets its ``finished`` call either way, so
no load is leaked. Like ``vllm-router`` the proxy does not retry on another replica.
"""

import json  # no `from __future__ import annotations`: FastAPI reads the handlers' annotations at run time

MAX_BODY_BYTES = 4 * 2**20


def routing_key(body: dict) -> "list[int]":
    """What the policy matches on: token ids when the prompt is token ids, else the text's UTF-8 bytes."""
    prompt = body.get("prompt")
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        return list(prompt)
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]
    if isinstance(prompt, str):
        text = prompt
    elif isinstance(body.get("messages"), list):
        text = "\n".join(str(m.get("content", "")) for m in body["messages"] if isinstance(m, dict))
    else:
        raise ValueError("the request needs a 'prompt' (one text or token ids) or 'messages' to route on")
    return list(text.encode()) or [0]


def create_proxy_app(policy, replica_urls, timeout: float = 120.0, max_body_bytes: int = MAX_BODY_BYTES):
    import httpx
    from fastapi import FastAPI, Request
    from fastapi.responses import JSONResponse, Response, StreamingResponse

    urls = [u.rstrip("/") for u in replica_urls]
    if not urls:
        raise ValueError("replica_urls must name at least one replica")
    for name in ("route", "finished"):
        if not callable(getattr(policy, name, None)):
            raise TypeError(f"the policy must have a {name}() method (got {type(policy).__name__})")
    app = FastAPI(title="tinypaged routing proxy")
    routed = [0] * len(urls)
    client = httpx.AsyncClient(timeout=httpx.Timeout(timeout), limits=httpx.Limits(max_connections=256))

    def error(status: int, message: str):
        return JSONResponse({"error": {"message": message, "type": "router_error", "code": status}}, status)

    async def forward(request: Request, path: str):
        raw = await request.body()
        if len(raw) > max_body_bytes:
            return error(413, f"request body over max_body_bytes ({max_body_bytes})")
        try:
            body = json.loads(raw)
            if not isinstance(body, dict):
                raise ValueError("the body must be a JSON object")
            key = routing_key(body)
        except ValueError as e:
            return error(400, str(e))
        try:
            replica = int(policy.route(key))
        except Exception as e:  # noqa: BLE001  (the policy is the learner's code: report it, keep serving)
            return error(500, f"the routing policy failed: {type(e).__name__}: {e}")
        if not 0 <= replica < len(urls):
            return error(500, f"the routing policy returned replica {replica}; there are {len(urls)}")
        routed[replica] += 1
        done = [False]

        def finish():
            if not done[0]:
                done[0] = True
                policy.finished(replica)

        try:
            req = client.build_request("POST", urls[replica] + path, content=raw,
                                       headers={"content-type": "application/json"})
            resp = await client.send(req, stream=True)
        except httpx.HTTPError as e:
            finish()
            return error(502, f"replica {replica} ({urls[replica]}) failed: {type(e).__name__}: {e}")

        async def close():
            await resp.aclose()
            finish()

        headers = {"x-routed-to": str(replica)}
        if body.get("stream"):
            async def chunks():
                try:
                    async for chunk in resp.aiter_raw():
                        yield chunk
                finally:  # also when the client hangs up mid-stream: the replica's stream is closed, the load returned
                    await close()

            return StreamingResponse(chunks(), status_code=resp.status_code, headers=headers,
                                     media_type=resp.headers.get("content-type"))
        try:
            content = await resp.aread()
        finally:
            await close()
        return Response(content, resp.status_code, headers=headers, media_type=resp.headers.get("content-type"))

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await forward(request, "/v1/completions")

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        return await forward(request, "/v1/chat/completions")

    async def first(path: str):
        try:
            resp = await client.get(urls[0] + path)
        except httpx.HTTPError as e:
            return error(502, f"replica 0 ({urls[0]}) failed: {type(e).__name__}")
        return Response(resp.content, resp.status_code, media_type=resp.headers.get("content-type"))

    @app.get("/v1/models")
    async def models():
        return await first("/v1/models")

    @app.get("/metrics")
    async def metrics():
        return await first("/metrics")

    @app.get("/health")
    async def health():
        bad = []
        for i, u in enumerate(urls):
            try:
                ok = (await client.get(u + "/health")).status_code == 200
            except httpx.HTTPError:
                ok = False
            if not ok:
                bad.append(f"replica {i} ({u})")
        return error(503, "unhealthy: " + ", ".join(bad)) if bad else Response(status_code=200)

    @app.get("/router/stats")
    async def stats():
        return {"routed": list(routed), "replicas": urls}

    @app.on_event("shutdown")
    async def _close():
        await client.aclose()

    app.state.routed = routed
    return app


class RouterProxy:
    """The proxy on 127.0.0.1 and a free port in a background thread; ``url``, ``routed``; ``close()``."""

    def __init__(self, policy, replica_urls, **kw):
        from tinypaged.entrypoints.server import ServerThread

        self.app = create_proxy_app(policy, replica_urls, **kw)
        self.thread = ServerThread(self.app)
        self.url = self.thread.url

    @property
    def routed(self) -> list[int]:
        return list(self.app.state.routed)

    def close(self) -> None:
        self.thread.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
