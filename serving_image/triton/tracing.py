"""Triton's own OpenTelemetry tracing in the `standalone` mode (docs/clients.md, "Traces and per-stage records").

There tritonserver owns the KServe ports and writes no request record of ours; its OpenTelemetry mode is what joins a
caller's trace to the server's stages instead. Triton reads the W3C `traceparent` of a request (HTTP header or gRPC
metadata) and exports, under the caller's trace id, a span per request (`InferRequest`: received, response sent), a
span per model (named after it, with `triton.model_name`: request start, queue start, request end) and a compute span
(compute start, input end, output start, compute end). It exports over OTLP/HTTP as JSON.

Configured from the pod's environment (llm_serving/pod_contract.py): off unless ENV_TRACE_OTLP_URL is set. A request
that carries a trace context is traced (Triton: "regardless of rate and count"); ENV_TRACE_RATE adds every N-th
request without one, 0 (the default) adds none, so the callers' sampling decides what is traced. Except that Triton
2.51's gRPC endpoint ignores a call's context about once in 20 (docs/clients.md, "Known gap: Triton's gRPC endpoint
loses a call's trace context about once in 20").

Measured on the wheel's tritonserver 2.51 (tests/serving/test_triton_tracing.py); the image's release has the same
`--trace-config` settings.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from urllib.parse import urlsplit

from llm_serving import pod_contract as pc

# The OTLP/HTTP traces path: a URL that names only the collector (http://collector:4318) gets it, as OpenTelemetry's
# OTEL_EXPORTER_OTLP_ENDPOINT does; Triton's exporter posts to its `url` as given, and a collector answers 404 on "/".
TRACES_PATH = "/v1/traces"
SERVICE_NAME = "llm-serving-triton"  # the resource's service.name: the spans' source in a collector


class TracingConfigError(ValueError):
    """A tracing variable of the pod's environment is wrong; the message names it."""


@dataclass(frozen=True)
class TritonTracing:
    otlp_url: str  # the OTLP/HTTP traces endpoint, http(s)://host[:port]/path
    rate: int = 0  # trace every rate-th request without a caller's context too; 0: none of those

    @classmethod
    def from_env(cls, env: Mapping[str, str]) -> TritonTracing | None:
        """The tracing the environment asks for, or None (off) without ENV_TRACE_OTLP_URL. Raises TracingConfigError
        naming the variable whose value is wrong."""
        url, rate = env.get(pc.ENV_TRACE_OTLP_URL, "").strip(), env.get(pc.ENV_TRACE_RATE, "").strip()
        if not url:
            if rate:  # a rate with nowhere to send the traces: say so rather than trace nothing silently
                raise TracingConfigError(f"{pc.ENV_TRACE_RATE}={rate!r} is set but {pc.ENV_TRACE_OTLP_URL} is not: "
                                         "Triton's tracing needs the OTLP/HTTP endpoint to export to")
            return None
        return cls(otlp_url=_traces_url(url), rate=_rate(rate) if rate else 0)

    def arguments(self) -> list[str]:
        """tritonserver's `--trace-config` arguments for this tracing."""
        return [
            "--trace-config=mode=opentelemetry",
            "--trace-config=level=TIMESTAMPS",  # the only level the opentelemetry mode has (no TENSORS)
            f"--trace-config=rate={self.rate}",
            "--trace-config=count=-1",  # never stop tracing
            f"--trace-config=opentelemetry,url={self.otlp_url}",
            f"--trace-config=opentelemetry,resource=service.name={SERVICE_NAME}",
        ]


def _traces_url(value: str) -> str:
    # Triton splits each --trace-config at its first ',' and '=': a URL with a comma or blank would be cut.
    parts = urlsplit(value)
    try:
        port_ok = parts.port is None or 0 < parts.port < 65536
    except ValueError:
        port_ok = False
    if parts.scheme not in ("http", "https") or not parts.hostname or not port_ok or parts.query or \
            parts.fragment or any(c in value for c in ", \t"):
        raise TracingConfigError(f"{pc.ENV_TRACE_OTLP_URL}={value!r}: expected an OTLP/HTTP endpoint "
                                 f"http(s)://host[:port][/path] (e.g. http://otel-collector:4318{TRACES_PATH}), "
                                 "without a query, commas or blanks")
    return value if parts.path not in ("", "/") else f"{value.rstrip('/')}{TRACES_PATH}"


def _rate(value: str) -> int:
    if not value.isdigit():
        raise TracingConfigError(f"{pc.ENV_TRACE_RATE}={value!r}: expected a whole number >= 0 (trace every N-th "
                                 "request without a caller's trace context; 0: only requests that carry one)")
    return int(value)
