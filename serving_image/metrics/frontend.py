"""Triton's metrics on the internal metrics port, where the metrics proxy fetches them (docs/architecture.md §3.8).

Triton counts every request itself, the OpenAI and KServe front-ends' too: in the `openai` mode it is embedded in
this process, and `serve_exposition` serves its C API's metrics text (serving_image/triton/embedded.py) on
pc.TRITON_METRICS_PORT, bound to loopback; in the `standalone` mode `tritonserver --metrics-port` listens there
itself. Either way the proxy fetches http://127.0.0.1:8004/metrics over HTTP and merges it with vLLM's
multiprocess files, so dashboards and alerts read Triton's own `nv_*` families (nv_inference_request_success,
nv_inference_count, nv_inference_pending_request_count, ...) in both modes.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from llm_serving import pod_contract as pc
from serving_image.metrics.exposition import CONTENT_TYPE_TEXT

# Internal port of Triton's metrics (pc.TRITON_METRICS_PORT, not one of §3.2's public ports): standalone Triton runs
# with `--metrics-port 8004`, and the embedded one's text is served here, so the proxy's upstream is
# http://127.0.0.1:8004/metrics in both modes.

#: Triton's per-model request families (its docs/user_guide/metrics.md), the ones the dashboards and alerts may use
#: (test_metrics_observability.py checks their expressions against this list).
FAMILY_NAMES: tuple[str, ...] = (
    "nv_inference_request_success",
    "nv_inference_count",
    "nv_inference_exec_count",
    "nv_inference_request_duration_us",
    "nv_inference_queue_duration_us",
    "nv_inference_compute_input_duration_us",
    "nv_inference_compute_infer_duration_us",
    "nv_inference_compute_output_duration_us",
    "nv_inference_request_failure",
    "nv_inference_pending_request_count",
    "nv_inference_first_response_histogram_ms",
)


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


def serve_exposition(body: Callable[[], bytes], port: int = pc.TRITON_METRICS_PORT,
                     host: str = "127.0.0.1") -> FrontendMetricsServer:
    """Serve what `body()` returns (Prometheus text 0.0.4) on http://host:port/metrics from a daemon thread: embedded
    Triton's own metrics (its C API's metrics text, serving_image/triton/embedded.py).

    Port 0 picks a free port. Bound to loopback by default: it is the proxy's upstream, not a public endpoint (§3.2
    lists those). Not prometheus_client's server: it serves a registry, and this serves Triton's text as it is."""

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
    thread = threading.Thread(target=server.serve_forever, name="triton-metrics", daemon=True)
    thread.start()
    return FrontendMetricsServer(host=host, port=server.server_address[1], _server=server, _thread=thread)
