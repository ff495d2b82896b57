"""The batch worker's connection to the model's real-time endpoint: POST a line's body, GET readiness.

One small interface (`Endpoint`) so the worker's logic does not depend on the HTTP library. The worker uses
`AiohttpEndpoint`: measured against a fixed-latency server on this machine, aiohttp's client spends 0.18 ms of CPU a
request where httpx's spends 0.78 ms, and the worker shares its cores with the engine it feeds (docs/batch.md,
"Measured"). The tests drive the worker against the app in-process through an ASGI adapter of the same interface
(tests/serving/test_batch_api_app.py).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Protocol

import aiohttp


class EndpointUnreachable(Exception):
    """No answer: the connection was refused, dropped or timed out (a restarting server). The line waits and is sent
    again; it never becomes a result."""


@dataclass(frozen=True)
class Answer:
    status: int
    body: bytes
    retry_after: str | None = None  # the Retry-After header, as sent

    def json(self) -> Any:
        return json.loads(self.body)

    @property
    def text(self) -> str:
        return self.body.decode("utf-8", errors="replace")


class Endpoint(Protocol):
    async def post(self, path: str, body: dict[str, Any]) -> Answer: ...

    async def get(self, path: str) -> Answer: ...

    async def aclose(self) -> None: ...


class AiohttpEndpoint:
    """The model's OpenAI endpoint over HTTP/1.1 keep-alive connections (aiohttp). The session is made on first use,
    inside the running event loop, as aiohttp requires."""

    def __init__(self, base_url: str, headers: Mapping[str, str], *, timeout_s: float = 600,
                 connect_timeout_s: float = 10):
        self.base_url = base_url.rstrip("/")
        self.headers = dict(headers)
        self.timeout = aiohttp.ClientTimeout(total=timeout_s, connect=connect_timeout_s)
        self._session: aiohttp.ClientSession | None = None

    def _open(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            self._session = aiohttp.ClientSession(headers=self.headers, timeout=self.timeout,
                                                  connector=aiohttp.TCPConnector(limit=0))
        return self._session

    async def post(self, path: str, body: dict[str, Any]) -> Answer:
        return await self._request("POST", path, json.dumps(body).encode())

    async def get(self, path: str) -> Answer:
        return await self._request("GET", path, None)

    async def _request(self, method: str, path: str, data: bytes | None) -> Answer:
        headers = {"Content-Type": "application/json"} if data is not None else None
        try:
            async with self._open().request(method, self.base_url + path, data=data, headers=headers) as response:
                return Answer(response.status, await response.read(), response.headers.get("Retry-After"))
        except (aiohttp.ClientError, TimeoutError) as exc:
            raise EndpointUnreachable(f"{method} {self.base_url}{path}: {type(exc).__name__}: {exc}") from exc

    async def aclose(self) -> None:
        if self._session is not None:
            await self._session.close()
