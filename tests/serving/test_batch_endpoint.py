"""The batch worker's HTTP client (serving_image/batch/endpoint.py) against a real HTTP server on loopback (aiohttp's
own): what it sends, what it hands back, and that no answer at all is EndpointUnreachable (the worker retries such
lines; they never become results)."""

from __future__ import annotations

import json

import pytest
from aiohttp import web

from llm_serving.ports import free_port
from serving_image.batch.endpoint import AiohttpEndpoint, EndpointUnreachable


async def test_posts_json_with_the_workers_headers_and_returns_status_body_and_retry_after():
    seen = []

    async def chat(request: web.Request) -> web.Response:
        seen.append((request.headers.get("x-llm-serving-priority"), request.content_type, await request.json()))
        return web.json_response({"error": {"code": "server_busy"}}, status=429, headers={"Retry-After": "2"})

    async def ready(request: web.Request) -> web.Response:
        return web.json_response({"version": "1.2.0"})

    app = web.Application()
    app.add_routes([web.post("/v1/chat/completions", chat), web.get("/health/ready", ready)])
    runner = web.AppRunner(app)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    endpoint = AiohttpEndpoint(f"http://127.0.0.1:{port}/", {"x-llm-serving-priority": "batch"})
    try:
        answer = await endpoint.post("/v1/chat/completions", {"model": "m", "messages": []})
        assert (answer.status, answer.retry_after, answer.json()) == (429, "2", {"error": {"code": "server_busy"}})
        assert seen == [("batch", "application/json", {"model": "m", "messages": []})]
        ready_answer = await endpoint.get("/health/ready")
        assert (ready_answer.status, ready_answer.retry_after, json.loads(ready_answer.text)) == \
            (200, None, {"version": "1.2.0"})
    finally:
        await endpoint.aclose()
        await runner.cleanup()


async def test_a_refused_connection_is_endpoint_unreachable_naming_the_url():
    port = free_port()  # nothing listens there
    endpoint = AiohttpEndpoint(f"http://127.0.0.1:{port}", {})
    try:
        with pytest.raises(EndpointUnreachable, match=f"POST http://127.0.0.1:{port}/v1/completions"):
            await endpoint.post("/v1/completions", {})
    finally:
        await endpoint.aclose()
