"""Generation, embeddings and scores over the OpenAI API, through the official `openai` client.

The client's own retries are off (max_retries=0): which calls may be repeated is this library's rule
(llm_serving_client.retry), not the HTTP client's. Each attempt's timeout is what is left of the call's deadline.
Errors become the library's, naming the model, the version and the request field the server named (`param`).
"""

from __future__ import annotations

import threading
from typing import Any

import httpx
import openai
from openai._base_client import make_request_options

from llm_serving_client.discovery import Route
from llm_serving_client.errors import CallError, DeadlineExceeded, InvalidRequest, Overloaded, ServerError, Unavailable
from llm_serving_client.gateway import GatewayTransport

UNAVAILABLE_STATUSES = (502, 503, 504)


def translate_error(route: Route, exc: openai.OpenAIError) -> CallError:
    kwargs = {"model": route.model, "version": route.version}
    if isinstance(exc, openai.APITimeoutError):
        return DeadlineExceeded(f"no answer within the deadline ({exc})", **kwargs)
    if isinstance(exc, openai.APIConnectionError):
        return Unavailable(f"cannot reach {route.address}: {exc}", **kwargs)
    if isinstance(exc, openai.APIStatusError):
        status, message = exc.status_code, getattr(exc, "message", str(exc))
        if status == 429:
            after = exc.response.headers.get("retry-after")
            return Overloaded(f"HTTP 429: {message}", retry_after_s=float(after) if after else None, **kwargs)
        if status in UNAVAILABLE_STATUSES:
            return Unavailable(f"HTTP {status}: {message}", **kwargs)
        if 400 <= status < 500:
            field = getattr(exc, "param", None) or ("Authorization" if status == 401 else None)
            return InvalidRequest(f"HTTP {status}: {message}", field=field, **kwargs)
        return ServerError(f"HTTP {status}: {message}", **kwargs)
    return ServerError(str(exc), **kwargs)


class OpenAITransport:
    """One `openai.OpenAI` per base URL (its HTTP connection pool), all with the same key."""

    def __init__(self, api_key: str | None):
        self._api_key = api_key
        self._clients: dict[str, openai.OpenAI] = {}
        self._lock = threading.Lock()

    def client(self, route: Route) -> openai.OpenAI:
        with self._lock:
            if route.address not in self._clients:
                # The SDK insists on a key; a platform without keys (make up's default) takes any.
                # Through a gateway address: the SDK's own HTTP client, with a transport that dials the gateway.
                http_client = (httpx.Client(transport=GatewayTransport(route.gateway)) if route.gateway is not None
                               else None)
                self._clients[route.address] = openai.OpenAI(base_url=route.address, api_key=self._api_key or "none",
                                                             max_retries=0, http_client=http_client)
            return self._clients[route.address]

    def chat(self, route: Route, body: dict[str, Any], extra_body: dict[str, Any], timeout_s: float,
             headers: dict[str, str]):
        try:
            return self.client(route).chat.completions.create(**body, extra_body=extra_body or None,
                                                              extra_headers=headers, timeout=timeout_s)
        except openai.OpenAIError as exc:
            raise translate_error(route, exc) from None

    def embeddings(self, route: Route, body: dict[str, Any], timeout_s: float, headers: dict[str, str]):
        try:
            return self.client(route).embeddings.create(**body, extra_headers=headers, timeout=timeout_s)
        except openai.OpenAIError as exc:
            raise translate_error(route, exc) from None

    def score(self, route: Route, body: dict[str, Any], timeout_s: float, headers: dict[str, str]) -> dict:
        """The platform's /v1/score, which the SDK has no method for: its generic `post`, the same transport."""
        try:
            return self.client(route).post("/score", cast_to=object, body=body,
                                           options=make_request_options(extra_headers=headers, timeout=timeout_s))
        except openai.OpenAIError as exc:
            raise translate_error(route, exc) from None

    def close(self) -> None:
        with self._lock:
            for client in self._clients.values():
                client.close()
            self._clients.clear()
