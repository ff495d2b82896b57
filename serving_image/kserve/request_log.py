"""The KServe front-ends' request record: one JSON line per ModelInfer and per request of a ModelStreamInfer (gRPC),
and per infer / generate / generate_stream request (HTTP, `HttpRecordMiddleware`), on the logger
`llm_serving.kserve_requests`, the counterpart of the OpenAI front-end's `llm_serving.requests` record.

It carries the caller's trace id (from the `traceparent` gRPC metadata) and experiment arm, so a caller's trace
joins this record as it joins the OpenAI one (docs/clients.md, "Traces and per-stage records"), and its own
stages: when the first and the last response left Triton. It never holds tensors. The gRPC front-end (C++,
native/triton/kserve_grpc.cpp) measures a request's times itself and hands its fields over when it ends.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import re
import time
from collections.abc import Iterable
from types import SimpleNamespace

from serving_image.request_context import (
    EXPERIMENT_HEADER,
    count_experiment,
    experiment_from,
    log_record,
    trace_id_from,
)

request_log = logging.getLogger("llm_serving.kserve_requests")


def metadata_dict(metadata: Iterable[tuple[str, str | bytes]] | None) -> dict[str, str]:
    return {k.lower(): v.decode() if isinstance(v, bytes) else v for k, v in (metadata or ())}


@dataclasses.dataclass
class KServeRecord:
    rpc: str
    request_id: str
    model: str
    model_version: str  # as the request names it ("" = Triton's policy picks)
    trace_id: str | None
    experiment: str | None
    status: str = "OK"  # gRPC: the status code's name (a request of a stream: OK or ERROR); HTTP: the status
    duration_s: float = 0.0
    first_response_s: float | None = None
    last_response_s: float | None = None
    _started: float = dataclasses.field(default_factory=time.perf_counter, repr=False)

    @classmethod
    def open(cls, rpc: str, request, metadata: dict[str, str]) -> KServeRecord:
        """Raises ValueError naming the header for a malformed experiment arm (the front-end answers
        INVALID_ARGUMENT)."""
        return cls(rpc, request.id, request.model_name, request.model_version,
                   trace_id_from(metadata.get("traceparent")), experiment_from(metadata.get(EXPERIMENT_HEADER)))

    def response_left(self) -> None:
        now = round(time.perf_counter() - self._started, 4)
        if self.first_response_s is None:
            self.first_response_s = now
        self.last_response_s = now

    def close(self) -> None:
        self.duration_s = round(time.perf_counter() - self._started, 4)
        self.write()

    def write(self) -> None:
        """The record's line and its experiment count, as the fields stand (the C++ gRPC front-end measures its own
        times: kserve/triton_grpc.py `write_records`)."""
        # the fields as they are (plain values): asdict's deep copy cost more than the rest of a record
        record = {k: v for k, v in vars(self).items() if not k.startswith("_")}
        log_record(request_log, json.dumps(record))
        count_experiment(self.experiment, "kserve_grpc", self.status)


# The KServe HTTP front-end's inference routes: /v2/models/<m>[/versions/<v>]/<kind>.
_HTTP_ROUTE = re.compile(r"^/v2/models/([^/]+)(?:/versions/([^/]+))?/(infer|generate|generate_stream)$")


class HttpRecordMiddleware:
    """The same record for KServe HTTP's inference routes (an ASGI middleware around the front-end's app): opened
    from the path and headers, `first_response_s` when the response starts, `last_response_s` and the status when
    its last body part leaves (a stream's last event). A malformed experiment arm is answered 400 naming the header,
    before the request reaches Triton."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        match = _HTTP_ROUTE.match(scope.get("path", "")) if scope["type"] == "http" else None
        if match is None or scope.get("method") != "POST":
            return await self.app(scope, receive, send)
        model, version, kind = match.groups()
        headers = metadata_dict((k.decode("latin-1"), v.decode("latin-1")) for k, v in scope.get("headers", ()))
        request = SimpleNamespace(id="", model_name=model, model_version=version or "")
        try:
            record = KServeRecord.open(f"POST {kind}", request, headers)
        except ValueError as exc:
            body = json.dumps({"error": str(exc)}).encode()
            await send({"type": "http.response.start", "status": 400,
                        "headers": [(b"content-type", b"application/json"),
                                    (b"content-length", str(len(body)).encode())]})
            return await send({"type": "http.response.body", "body": body})
        async def recording_send(message):
            if message["type"] == "http.response.start":
                record.status = str(message["status"])
                record.response_left()
            elif message["type"] == "http.response.body" and not message.get("more_body", False):
                record.response_left()
            await send(message)

        try:
            await self.app(scope, receive, recording_send)
        except BaseException:
            if record.first_response_s is None:  # nothing was answered: the app failed (500) or was cancelled
                record.status = "500"
            raise
        finally:
            record.close()
