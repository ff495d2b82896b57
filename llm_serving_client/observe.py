"""Per-stage records of every call (docs/clients.md, "Traces and per-stage records"): an OpenTelemetry span per
call with a child span per stage, the W3C trace context for the server, and one JSON log line per call with its
stages' durations.

The line never carries prompt text, messages, tensors or generated text: only what identifies the call (model,
version, experiment, arm, trace id) and how it went (outcome, attempts, stages). Lines are sampled by a deterministic
function of the trace id (a sampled call's line is whole, and the same id is sampled in every process); a call that
failed is always logged.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

from opentelemetry import propagate, trace
from opentelemetry.sdk.trace import TracerProvider

call_log = logging.getLogger("llm_serving_client.calls")

STAGES = ("assignment", "cache", "preprocess", "serialise", "network", "inference", "postprocess")


def tracer_provider(given: trace.TracerProvider | None) -> trace.TracerProvider:
    """The application's provider when it configured OpenTelemetry's SDK, else a private one: without an SDK the API
    hands out non-recording spans whose trace id is 0, and the server's record could not be joined to anything."""
    if given is not None:
        return given
    current = trace.get_tracer_provider()
    return current if isinstance(current, TracerProvider) else TracerProvider()


@dataclass
class CallRecord:
    call: str
    model: str
    version: str | None
    experiment: str | None = None
    arm: str | None = None
    outcome: str = "ok"
    attempts: int = 0
    trace_id: str | None = None
    stages: dict[str, float] = field(default_factory=dict)
    duration_s: float = 0.0
    cache: str | None = None  # a call that asked the result cache: "hit" or "miss (<why>)"

    def to_json(self) -> str:
        return json.dumps({"event": "call", **self.__dict__})


class Call:
    """One call in progress: time its stages with `stage(name)`, take the headers for the request with `headers()`.

    Spans are started with an explicit parent, never made the thread's current span: a streamed call lives across
    the caller's own code between chunks, which must not find this call's span current (nor detach it elsewhere)."""

    def __init__(self, tracer: trace.Tracer, span: trace.Span, record: CallRecord):
        self._tracer, self._span, self.record = tracer, span, record
        self._current: trace.Span = span

    @contextmanager
    def stage(self, name: str) -> Iterator[None]:
        if name not in STAGES:
            raise ValueError(f"stage {name!r} is not one of {STAGES}")
        start = time.perf_counter()
        span = self._tracer.start_span(name, context=trace.set_span_in_context(self._span),
                                       attributes={"llm_serving.stage": name})
        outer, self._current = self._current, span
        try:
            yield
        finally:
            self._current = outer
            span.end()
            self.record.stages[name] = self.record.stages.get(name, 0.0) + time.perf_counter() - start

    def add_stage(self, name: str, seconds: float) -> None:
        """A stage measured elsewhere (a stream's first-to-last chunk) recorded without a span of its own."""
        self.record.stages[name] = self.record.stages.get(name, 0.0) + seconds

    def headers(self, extra: dict[str, str] | None = None) -> dict[str, str]:
        """`traceparent` naming the span of the stage that sends the request (the server's parent), and `extra`."""
        carrier: dict[str, str] = {}
        propagate.inject(carrier, context=trace.set_span_in_context(self._current))
        return {**carrier, **(extra or {})}


class Observer:
    def __init__(self, provider: trace.TracerProvider | None = None, log_sample_rate: float = 1.0):
        if not 0 <= log_sample_rate <= 1:
            raise ValueError(f"log_sample_rate is between 0 and 1, got {log_sample_rate!r}")
        self.provider = tracer_provider(provider)
        self.tracer = self.provider.get_tracer("llm_serving_client")
        self.log_sample_rate = log_sample_rate

    @contextmanager
    def call(self, call: str, model: str, version: str | None, experiment: str | None = None,
             arm: str | None = None) -> Iterator[Call]:
        record = CallRecord(call, model, version, experiment, arm)
        start = time.perf_counter()
        attributes = {"llm_serving.model": model, "llm_serving.call": call}
        attributes.update({k: v for k, v in (("llm_serving.version", version), ("llm_serving.experiment", experiment),
                                             ("llm_serving.arm", arm)) if v})
        span = self.tracer.start_span(f"llm_serving.{call} {model}", attributes=attributes)
        record.trace_id = format(span.get_span_context().trace_id, "032x")
        try:
            yield Call(self.tracer, span, record)
        except BaseException as exc:
            record.outcome = type(exc).__name__
            span.set_status(trace.Status(trace.StatusCode.ERROR, str(exc)))
            raise
        finally:
            record.duration_s = time.perf_counter() - start
            span.set_attribute("llm_serving.outcome", record.outcome)
            span.end()
            if record.outcome != "ok" or self._sampled(record.trace_id):
                call_log.info(record.to_json())

    def _sampled(self, trace_id: str) -> bool:
        return int(trace_id[:8], 16) / 2**32 < self.log_sample_rate
