"""The local front-ends' request metrics, under Triton's names (docs/architecture.md §3.8).

In production Triton counts every request itself and serves the counts on its metrics port. Locally there is no
Triton, so the KServe and OpenAI front-ends record each request here and `serve_frontend_metrics` serves the same
families on an internal port that the metrics proxy fetches over HTTP, exactly as it fetches Triton's. Dashboards
and alerts then read the same names in both places.

Names, types and labels follow Triton's metrics documentation (docs/user_guide/metrics.md):
- counters WITHOUT a `_total` suffix (Triton's exposition writes `nv_inference_request_success{...} 3` under
  `# TYPE nv_inference_request_success counter`), labels `model` and `version`;
- `nv_inference_request_failure` also carries `reason` (REJECTED, CANCELED, BACKEND, OTHER);
- latency counters are cumulative microseconds, and are counted for successful requests only, as Triton does;
- `nv_inference_pending_request_count` is a gauge of requests received and not yet answered;
- `nv_inference_first_response_histogram_ms` (Triton reports it for decoupled, i.e. streaming, models).

Why a hand-written collector instead of prometheus_client's Counter: (1) prometheus_client always names counter
samples `<name>_total`, which is not Triton's name; (2) the front-ends run in the process that also hosts vLLM with
`PROMETHEUS_MULTIPROC_DIR` set, where every prometheus_client metric object writes into the multiprocess files the
proxy already reads: these series would then appear twice. The state here lives in this process's memory only,
in its own `CollectorRegistry`.
"""

from __future__ import annotations

import contextlib
import math
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Literal, get_args

from prometheus_client import CollectorRegistry
from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector

from serving_image.metrics.exposition import CONTENT_TYPE_TEXT, TritonCounter, from_client_metrics, write_text

# Internal port of the request metrics (not one of §3.2's public ports). Production runs Triton with
# `--metrics-port 8004`, so the proxy's upstream is http://127.0.0.1:8004/metrics in both places.
FRONTEND_METRICS_PORT = 8004

FailureReason = Literal["REJECTED", "CANCELED", "BACKEND", "OTHER"]
FAILURE_REASONS: tuple[str, ...] = get_args(FailureReason)

# Triton's default buckets of the first-response histogram (milliseconds; docs/user_guide/metrics.md, where
# Triton reports it for decoupled models with `--metrics-config histogram_latencies=true`).
FIRST_RESPONSE_BUCKETS_MS: tuple[float, ...] = (100.0, 500.0, 2000.0, 5000.0)

# (name, HELP) of the per-model counters, in the order Triton lists them.
_COUNTERS: tuple[tuple[str, str], ...] = (
    ("nv_inference_request_success", "Number of successful inference requests, all batch sizes"),
    ("nv_inference_count", "Number of inferences performed (does not include cached requests)"),
    ("nv_inference_exec_count", "Number of model executions performed (does not include cached requests)"),
    (
        "nv_inference_request_duration_us",
        "Cumulative inference request duration in microseconds (includes cached requests)",
    ),
    (
        "nv_inference_queue_duration_us",
        "Cumulative inference queuing duration in microseconds (includes cached requests)",
    ),
    (
        "nv_inference_compute_input_duration_us",
        "Cumulative compute input duration in microseconds (does not include cached requests)",
    ),
    (
        "nv_inference_compute_infer_duration_us",
        "Cumulative compute inference duration in microseconds (does not include cached requests)",
    ),
    (
        "nv_inference_compute_output_duration_us",
        "Cumulative inference compute output duration in microseconds (does not include cached requests)",
    ),
)
FAILURE_COUNTER = "nv_inference_request_failure"
PENDING_GAUGE = "nv_inference_pending_request_count"
FIRST_RESPONSE_HISTOGRAM = "nv_inference_first_response_histogram_ms"

#: Every family this module exports (the dashboards' validation reads it).
FAMILY_NAMES: tuple[str, ...] = (
    *(name for name, _ in _COUNTERS),
    FAILURE_COUNTER,
    PENDING_GAUGE,
    FIRST_RESPONSE_HISTOGRAM,
)


@dataclass
class _ModelStats:
    counters: dict[str, float]
    failures: dict[str, float]
    pending: int = 0
    first_response_buckets: list[int] | None = None
    first_response_sum_ms: float = 0.0
    first_response_count: int = 0


def _check_duration(field: str, value: float) -> float:
    if not isinstance(value, int | float) or isinstance(value, bool) or math.isnan(value) or value < 0:
        raise ValueError(f"{field} must be a non-negative number of seconds, got {value!r}")
    return float(value)


def _check_key(model: str, version: str) -> tuple[str, str]:
    if not isinstance(model, str) or not model:
        raise ValueError(f"model must be a non-empty string, got {model!r}")
    if not isinstance(version, str) or not version:
        raise ValueError(f"version must be a non-empty string, got {version!r}")
    return model, version


class FrontendMetrics(Collector):
    """Per-request statistics of the local front-ends, exported under Triton's metric names.

    One instance per process, shared by the KServe and OpenAI front-ends. Thread-safe; `observe` costs a lock and
    a few additions.
    """

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self._lock = threading.Lock()
        self._stats: dict[tuple[str, str], _ModelStats] = {}
        self.registry = registry if registry is not None else CollectorRegistry(auto_describe=False)
        self.registry.register(self)

    def _model(self, key: tuple[str, str]) -> _ModelStats:
        stats = self._stats.get(key)
        if stats is None:
            stats = _ModelStats(
                counters={name: 0.0 for name, _ in _COUNTERS},
                failures={reason: 0.0 for reason in FAILURE_REASONS},
            )
            self._stats[key] = stats
        return stats

    def register_model(self, model: str, version: str) -> None:
        """Make a model's series appear (at zero) before its first request, as Triton does for loaded models."""
        key = _check_key(model, version)
        with self._lock:
            self._model(key)

    def observe(
        self,
        model: str,
        version: str,
        *,
        success: bool,
        duration_s: float,
        queue_s: float = 0.0,
        compute_input_s: float = 0.0,
        compute_infer_s: float = 0.0,
        compute_output_s: float = 0.0,
        batch_size: int = 1,
        failure_reason: FailureReason = "OTHER",
        first_response_s: float | None = None,
    ) -> None:
        """Record one finished request (call it once per request, when its last response is sent).

        `duration_s` is end to end as the front-end saw it; `queue_s` the time before the engine scheduled it;
        `compute_*` the engine's share. Failures count only in `nv_inference_request_failure{reason}`, as in Triton.
        """
        key = _check_key(model, version)
        if not isinstance(success, bool):
            raise ValueError(f"success must be a bool, got {success!r}")
        durations = {
            "nv_inference_request_duration_us": _check_duration("duration_s", duration_s),
            "nv_inference_queue_duration_us": _check_duration("queue_s", queue_s),
            "nv_inference_compute_input_duration_us": _check_duration("compute_input_s", compute_input_s),
            "nv_inference_compute_infer_duration_us": _check_duration("compute_infer_s", compute_infer_s),
            "nv_inference_compute_output_duration_us": _check_duration("compute_output_s", compute_output_s),
        }
        if not isinstance(batch_size, int) or isinstance(batch_size, bool) or batch_size < 1:
            raise ValueError(f"batch_size must be a positive integer, got {batch_size!r}")
        if failure_reason not in FAILURE_REASONS:
            raise ValueError(f"failure_reason must be one of {', '.join(FAILURE_REASONS)}, got {failure_reason!r}")
        first_ms = None
        if first_response_s is not None:
            first_ms = _check_duration("first_response_s", first_response_s) * 1000.0
        with self._lock:
            stats = self._model(key)
            if not success:
                stats.failures[failure_reason] += 1
                return
            stats.counters["nv_inference_request_success"] += 1
            stats.counters["nv_inference_count"] += batch_size
            stats.counters["nv_inference_exec_count"] += 1
            for name, seconds in durations.items():
                stats.counters[name] += round(seconds * 1e6)
            if first_ms is not None:
                if stats.first_response_buckets is None:
                    stats.first_response_buckets = [0] * len(FIRST_RESPONSE_BUCKETS_MS)
                for i, bound in enumerate(FIRST_RESPONSE_BUCKETS_MS):
                    if first_ms <= bound:
                        stats.first_response_buckets[i] += 1
                stats.first_response_sum_ms += first_ms
                stats.first_response_count += 1

    @contextlib.contextmanager
    def pending(self, model: str, version: str) -> Iterator[None]:
        """Count the request in `nv_inference_pending_request_count` while the block runs."""
        key = _check_key(model, version)
        with self._lock:
            self._model(key).pending += 1
        try:
            yield
        finally:
            with self._lock:
                self._model(key).pending -= 1

    def collect(self) -> Iterator[Metric]:
        with self._lock:
            snapshot = {
                key: (
                    dict(s.counters),
                    dict(s.failures),
                    s.pending,
                    list(s.first_response_buckets) if s.first_response_buckets else None,
                    s.first_response_sum_ms,
                    s.first_response_count,
                )
                for key, s in sorted(self._stats.items())
            }
        for name, help_text in _COUNTERS:
            family = TritonCounter(name, help_text)
            for (model, version), (counters, *_rest) in snapshot.items():
                family.add_sample(name, {"model": model, "version": version}, counters[name])
            yield family
        failure = TritonCounter(FAILURE_COUNTER, "Number of failed inference requests, all batch sizes")
        for (model, version), (_c, failures, *_rest) in snapshot.items():
            for reason in FAILURE_REASONS:
                failure.add_sample(
                    FAILURE_COUNTER, {"model": model, "reason": reason, "version": version}, failures[reason]
                )
        yield failure
        pending = Metric(
            PENDING_GAUGE, "Instantaneous number of pending requests awaiting execution per-model.", "gauge"
        )
        for (model, version), (_c, _f, count, *_rest) in snapshot.items():
            pending.add_sample(PENDING_GAUGE, {"model": model, "version": version}, count)
        yield pending
        histogram = Metric(
            FIRST_RESPONSE_HISTOGRAM, "Duration from request to first response in milliseconds", "histogram"
        )
        for (model, version), (_c, _f, _p, buckets, total_ms, count) in snapshot.items():
            if buckets is None:
                continue
            labels = {"model": model, "version": version}
            for bound, value in zip(FIRST_RESPONSE_BUCKETS_MS, buckets, strict=True):
                histogram.add_sample(f"{FIRST_RESPONSE_HISTOGRAM}_bucket", {**labels, "le": _le(bound)}, value)
            histogram.add_sample(f"{FIRST_RESPONSE_HISTOGRAM}_bucket", {**labels, "le": "+Inf"}, count)
            histogram.add_sample(f"{FIRST_RESPONSE_HISTOGRAM}_count", labels, count)
            histogram.add_sample(f"{FIRST_RESPONSE_HISTOGRAM}_sum", labels, total_ms)
        yield histogram


def _le(bound: float) -> str:
    from prometheus_client.utils import floatToGoString

    return floatToGoString(bound)


@dataclass
class FrontendMetricsServer:
    """A running metrics endpoint; `stop()` closes it."""

    host: str
    port: int
    _server: ThreadingHTTPServer
    _thread: threading.Thread

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}/metrics"

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=5)


def serve_frontend_metrics(
    metrics: FrontendMetrics, port: int = FRONTEND_METRICS_PORT, host: str = "127.0.0.1"
) -> FrontendMetricsServer:
    """Serve `metrics` on http://host:port/metrics (text 0.0.4, as Triton does) from a daemon thread.

    Port 0 picks a free port. Bound to loopback by default: it is the proxy's upstream, not a public endpoint
    (§3.2 lists those). Not prometheus_client's server: its writer would rename Triton's counters (`exposition.py`).
    """
    registry = metrics.registry
    return serve_exposition(lambda: write_text(from_client_metrics(registry.collect())), port=port, host=host)


def serve_exposition(body: Callable[[], bytes], port: int = FRONTEND_METRICS_PORT,
                     host: str = "127.0.0.1") -> FrontendMetricsServer:
    """Serve what `body()` returns (Prometheus text 0.0.4) on http://host:port/metrics from a daemon thread: the
    front-ends' metrics, or embedded Triton's own (its C API's metrics text, serving_image/triton/embedded.py)."""

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 (http.server's naming)
            if self.path.split("?", 1)[0] != "/metrics":
                self.send_error(404, "try /metrics")
                return
            try:
                content = body()
            except Exception as exc:  # the proxy counts a failed upstream; it must not hang on a broken handler
                self.send_error(503, f"metrics unavailable: {exc}")
                return
            self.send_response(200)
            self.send_header("Content-Type", CONTENT_TYPE_TEXT)
            self.send_header("Content-Length", str(len(content)))
            self.end_headers()
            self.wfile.write(content)

        def log_message(self, format: str, *args: object) -> None:
            pass  # scraped every few seconds

    server = ThreadingHTTPServer((host, port), Handler)
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, name="frontend-metrics", daemon=True)
    thread.start()
    return FrontendMetricsServer(host=host, port=server.server_address[1], _server=server, _thread=thread)
