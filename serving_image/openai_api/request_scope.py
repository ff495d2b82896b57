"""One request's bookkeeping, from its first byte received to its last byte sent.

A `RequestScope` owns what a POST request holds and what reports on it: its admission (a request and tokens in
flight, admission.py), its `Outcome`, and the request log record written from that outcome. It is released exactly
once whatever ends the request: an answer, an error in OpenAI's shape, a client that left (499), a cancelled task
(the server stopping), an engine that died. Keeping all of it in one object is the point: spread over several
functions, each exit path had to remember each release.

The request metrics are not kept here: Triton, embedded in this process, counts every request the engine sends it
(nv_inference_request_success, nv_inference_count, nv_inference_pending_request_count, ...; served to the metrics
proxy by serving_image/metrics/frontend.py's `serve_exposition`).

A streaming response outlives its handler: the handler calls `hand_over()` and the response closes the scope after
its last event (streaming.EventStreamResponse).

`close` is synchronous on purpose: it runs in `finally` blocks of tasks that may be cancelled, where an await
would be cancelled too and the release lost.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import json
import logging
import time
import uuid
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any

from pydantic import BaseModel

from serving_image.openai_api.admission import Admission
from serving_image.openai_api.errors import APIError
from serving_image.openai_api.protocol import Endpoint
from serving_image.request_context import count_experiment, log_record, trace_id_from
from serving_image.served_model import ModelInfo

__all__ = ["RequestRecord", "RequestScope", "trace_id_from"]  # trace_id_from: the handlers import it from here

request_log = logging.getLogger("llm_serving.requests")

# nginx's status for a client that closed its connection before the answer was complete (no standard code says it).
CLIENT_CLOSED_REQUEST = 499

# The metadata fields of a request body (fields.py): no effect on the output, recorded in the request log as given.
METADATA_FIELDS = ("user", "metadata", "safety_identifier", "prompt_cache_key")


@functools.cache
def _metadata_fields_of(body_type: type) -> tuple[str, ...]:
    """Those of METADATA_FIELDS that a request body's model declares (none without a parsed body). Asking a pydantic
    model for a field it lacks raises inside its __getattr__, which cost every request's record tens of µs."""
    declared = getattr(body_type, "model_fields", {})
    return tuple(name for name in METADATA_FIELDS if name in declared)

@dataclass
class Outcome:
    """What the request log records about one request."""

    status: int = 200
    completion_tokens: int = 0
    prompt_tokens: int = 0
    first_output_at: float | None = None  # time.perf_counter() when the engine's first output arrived
    last_output_at: float | None = None  # ... and its last

    def output_arrived(self) -> None:
        """The engine delivered output for this request (one or several tokens, or a whole answer)."""
        now = time.perf_counter()
        if self.first_output_at is None:
            self.first_output_at = now
        self.last_output_at = now

    def refused(self, error: APIError) -> None:
        """Answered with an error: the client's (4xx, the request was rejected) or the engine's (5xx)."""
        self.status = error.status

    def canceled(self) -> None:
        """The client left before its answer was complete, or the server stopped the request."""
        self.status = CLIENT_CLOSED_REQUEST


@dataclass(frozen=True)
class RequestRecord:
    """One line of the request log: a JSON object, these fields in this order, then the metadata fields given."""

    request_id: str
    endpoint: str
    model: str
    version: str
    status: int
    prompt_tokens: int
    completion_tokens: int
    duration_s: float
    first_output_s: float | None  # seconds from the first byte received to the engine's first output (None: none)
    last_output_s: float | None  # ... to its last output
    trace_id: str | None  # from the request's W3C `traceparent` header (None: none, or not in W3C's form)
    experiment: str | None  # `<experiment>=<arm>` from the x-llm-serving-experiment header (None: none)
    metadata_fields: dict[str, Any] = field(default_factory=dict)  # those of METADATA_FIELDS the request gave

    def to_json(self) -> str:
        # The fields read directly: dataclasses.asdict deep-copies each value on its way, a quarter of a record's
        # cost, on the event loop, for every request (the values are strings, numbers and None)
        record = {name: getattr(self, name) for name in _RECORD_FIELDS}
        record.update(self.metadata_fields)
        return json.dumps(record)


_RECORD_FIELDS = tuple(f.name for f in dataclasses.fields(RequestRecord) if f.name != "metadata_fields")


class RequestScope:
    """Admission, the outcome and the log record of one request (see the module's docstring).

    Use it as a context manager: leaving closes the scope, recording the exception that ended the block if any,
    unless `hand_over()` passed the closing on."""

    def __init__(self, endpoint: Endpoint, model: ModelInfo, admission: Admission):
        self.endpoint = endpoint
        self.model = model
        self.request_id = f"{endpoint.id_prefix}-{uuid.uuid4().hex}"
        self.outcome = Outcome()
        self.body: BaseModel | None = None  # the parsed request body, once parsed: the log takes its metadata
        self.trace_id: str | None = None  # the caller's trace (trace_id_from), set by the handler
        self.experiment: str | None = None  # the caller's experiment arm (request_context.experiment_from)
        self.batch = False  # batch work (admission.PRIORITY_HEADER): admitted within the batch share only
        self.started = time.perf_counter()
        self._admission = admission
        self._held = contextlib.ExitStack()  # what close() releases, last acquired first
        self._entered = False
        self._admitted = False
        self._handed_over = False
        self._closed = False

    def __enter__(self) -> RequestScope:
        if self._entered:
            raise RuntimeError(f"request scope {self.request_id} was already entered")
        self._entered = True
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        if not self._handed_over or exc is not None:
            self.close(exc)

    @property
    def closed(self) -> bool:
        return self._closed

    def elapsed_s(self) -> float:
        return time.perf_counter() - self.started

    def admit(self, tokens: int) -> None:
        """Count the request and its token budget in flight until the scope closes, or raise 429 (the server is
        busy) or 400 (more tokens than the server ever admits)."""
        if self._admitted:
            raise RuntimeError(f"request {self.request_id} was already admitted")
        self._held.callback(self._admission.release, self._admission.admit(tokens, self.batch), self.batch)
        self._admitted = True

    def preemptible(self) -> asyncio.Event | None:
        """For batch work, once admitted: an event set when a real-time request is admitted and this request must
        make room (admission.py, `batch_preempted_by_realtime`); None for real-time requests, or when batch work
        is not preempted. The watch ends when the scope closes."""
        if not (self.batch and self._admitted and self._admission.config.batch_preempted_by_realtime):
            return None
        event = asyncio.Event()
        self._admission.watch_preemption(self.request_id, event.set)
        self._held.callback(self._admission.unwatch_preemption, self.request_id)
        return event

    def preempted(self) -> APIError:
        """The error that answers this request once it was preempted (503, Retry-After), recorded as its outcome."""
        error = self._admission.preempted_error()
        self.outcome.refused(error)
        return error

    def hand_over(self) -> RequestScope:
        """Keep the scope open when the `with` block ends normally: whoever this returns to (a streaming response)
        now closes it. An exception leaving the block still closes it, as nobody else will."""
        self._handed_over = True
        return self

    def close(self, exc: BaseException | None = None) -> None:
        """Release what the request holds and report its outcome; `exc` is what ended the request, if anything.
        Only the first call does anything."""
        if self._closed:
            return
        self._closed = True
        if exc is not None:
            self._record_exit(exc)
        try:
            self._held.close()
        finally:
            self._report()

    def _record_exit(self, exc: BaseException) -> None:
        if isinstance(exc, APIError):
            self.outcome.refused(exc)
        elif isinstance(exc, Exception):  # a bug of ours: the app answers 500 (app.py's last exception handler)
            self.outcome.status = 500
        else:  # asyncio.CancelledError and the like: the request was cut off before its answer
            self.outcome.canceled()

    def _report(self) -> None:
        duration = self.elapsed_s()
        outcome = self.outcome
        metadata_fields = {}
        for name in _metadata_fields_of(type(self.body)):
            value = getattr(self.body, name)
            if value is not None:
                metadata_fields[name] = value
        def since_start(at: float | None) -> float | None:
            return None if at is None else round(at - self.started, 4)

        record = RequestRecord(request_id=self.request_id, endpoint=self.endpoint.name, model=self.model.name,
                               version=self.model.version, status=outcome.status, prompt_tokens=outcome.prompt_tokens,
                               completion_tokens=outcome.completion_tokens, duration_s=round(duration, 4),
                               first_output_s=since_start(outcome.first_output_at),
                               last_output_s=since_start(outcome.last_output_at), trace_id=self.trace_id,
                               experiment=self.experiment, metadata_fields=metadata_fields)
        log_record(request_log, record.to_json())
        count_experiment(self.experiment, "openai", str(outcome.status))
