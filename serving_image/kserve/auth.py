"""The pod's own check of a caller's key on KServe HTTP (port 8000), the second wall behind the Gateway's
(docs/architecture.md §3.12): `Authorization: Bearer <key>` must be one of the pod's keys, or the request is answered
401 before any of it reaches Triton. The health paths the kubelet's probes call stay open. KServe gRPC (8001) checks
the same keys in C++ (native/triton/kserve_grpc.cpp), the OpenAI port in serving_image/openai_api/admission.py.

A pure ASGI middleware: it reads the request's headers only, so a streamed or binary body passes untouched.
"""

from __future__ import annotations

import json

from llm_serving import pod_contract as pc
from serving_image.api_keys import bearer_token, key_matches

# What the kubelet's probes call on this port (pod_contract.READY_PATH, LIVE_PATH): answered without a key.
OPEN_PATHS = frozenset({pc.READY_PATH, pc.LIVE_PATH})


class BearerKeyMiddleware:
    def __init__(self, app, api_keys: tuple[str, ...]):
        if not api_keys:
            raise ValueError("BearerKeyMiddleware without a key would refuse every caller; give it the pod's keys")
        self.app = app
        self.api_keys = tuple(api_keys)

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope.get("path", "") in OPEN_PATHS:
            await self.app(scope, receive, send)
            return
        authorization = None
        for name, value in scope.get("headers", ()):
            if name.lower() == pc.AUTHORIZATION_HEADER.encode():
                authorization = value.decode("latin-1")
                break
        token = bearer_token(authorization)
        if token is not None and key_matches(self.api_keys, token):
            await self.app(scope, receive, send)
            return
        message = ("missing API key: send 'Authorization: Bearer <key>'" if token is None
                   else "incorrect API key provided")
        body = json.dumps({"error": message}).encode()
        await send({"type": "http.response.start", "status": 401,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                                (b"www-authenticate", b"Bearer")]})
        await send({"type": "http.response.body", "body": body})
