"""The metrics proxy on port 8002 (docs/architecture.md §3.8): Triton's metrics and every vLLM metric on one /metrics.

Each scrape:
1. fetches the upstream (Triton's metrics: tritonserver's metrics port, or the embedded Triton's C API metrics on
   8004) with a total deadline and a body cap (`upstream.py`); concurrent scrapes share one in-flight fetch;
2. marks exited engine processes dead and reads vLLM's multiprocess files (`multiproc.py`);
3. merges the proxy's own metrics, vLLM's and the upstream's, every family once (`merge.py`);
4. answers 200 in Prometheus text 0.0.4 or OpenMetrics 1.0, whichever the Accept header prefers.

When the upstream is down, slow or sends garbage, the answer is still 200 with vLLM's metrics,
`llm_serving_metrics_upstream_up 0` and `llm_serving_metrics_upstream_scrape_errors_total{reason=...}` counting
why; the cause is logged (at the change, then at most once a minute while it lasts). The proxy never answers 500
for a scrape.

Run it: `python -m serving_image.metrics.proxy --upstream http://127.0.0.1:8004/metrics --multiproc-dir DIR
--port 8002`, or from the startup procedure with `start_proxy(config)` (a thread in that process) or
`spawn_proxy(config)` (a child process).
"""

from __future__ import annotations

import argparse
import gzip
import logging
import os
import subprocess
import sys
import threading
import time
import urllib.request
from concurrent.futures import Future
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

from llm_serving import pod_contract as pc
from serving_image.metrics.exposition import Family, Sample
from serving_image.metrics.formats import negotiate, render
from serving_image.metrics.merge import merge
from serving_image.metrics.multiproc import collect_multiproc, reap_dead_processes
from serving_image.metrics.upstream import ERROR_REASONS, UpstreamResult, fetch_upstream

log = logging.getLogger("serving_image.metrics.proxy")

METRICS_PORT = 8002
DEFAULT_UPSTREAM = f"http://127.0.0.1:{pc.TRITON_METRICS_PORT}/metrics"
PREFIX = "llm_serving_metrics_"
_REPEAT_LOG_S = 60.0


@dataclass(frozen=True)
class ProxyConfig:
    """Everything the proxy needs. `upstream_url=None` serves vLLM's metrics alone (no upstream gauge)."""

    multiproc_dir: Path
    upstream_url: str | None = DEFAULT_UPSTREAM
    host: str = "0.0.0.0"
    port: int = METRICS_PORT
    upstream_timeout_s: float = 1.0
    upstream_max_bytes: int = 16 * 1024 * 1024
    reap_dead_processes: bool = True

    def __post_init__(self) -> None:
        if not (self.upstream_timeout_s > 0):
            raise ValueError(f"upstream_timeout_s must be > 0, got {self.upstream_timeout_s!r}")
        if not (isinstance(self.upstream_max_bytes, int) and self.upstream_max_bytes > 0):
            raise ValueError(f"upstream_max_bytes must be a positive integer, got {self.upstream_max_bytes!r}")
        if not (isinstance(self.port, int) and 0 <= self.port <= 65535):
            raise ValueError(f"port must be 0-65535, got {self.port!r}")
        if self.upstream_url is not None:
            from serving_image.metrics.upstream import UpstreamTarget

            UpstreamTarget.parse(self.upstream_url)  # raises naming the bad URL


@dataclass
class _State:
    lock: threading.Lock = field(default_factory=threading.Lock)
    upstream_up: float = 0.0
    errors: dict[str, float] = field(default_factory=lambda: dict.fromkeys(ERROR_REASONS, 0.0))
    upstream_duration_s: float = 0.0
    multiproc_errors: float = 0.0
    multiproc_files: float = 0.0
    shadowed: float = 0.0
    duplicates: float = 0.0
    scrapes: dict[str, float] = field(default_factory=lambda: {"text": 0.0, "openmetrics": 0.0})
    last_logged: tuple[str | None, float] = (None, 0.0)
    last_shadowed: list[tuple[str, str]] = field(default_factory=list)
    last_duplicates: int = 0


class MetricsProxy:
    """The scrape logic, independent of the HTTP server."""

    def __init__(self, config: ProxyConfig) -> None:
        self.config = config
        self._state = _State()
        self._fetch_lock = threading.Lock()
        self._inflight: Future[UpstreamResult] | None = None
        self._reap_lock = threading.Lock()  # concurrent scrapes would race to remove the same dead files

    # --- upstream, shared by concurrent scrapes ---
    def _fetch_shared(self) -> UpstreamResult:
        assert self.config.upstream_url is not None
        with self._fetch_lock:
            owner = self._inflight is None
            if owner:
                self._inflight = Future()
            future = self._inflight
        if not owner:
            return future.result()
        try:
            result = fetch_upstream(
                self.config.upstream_url,
                timeout_s=self.config.upstream_timeout_s,
                max_bytes=self.config.upstream_max_bytes,
            )
        except Exception as exc:  # a bug must not turn into a 500 or a hung waiter
            log.exception("upstream fetch failed unexpectedly")
            result = UpstreamResult(error="connection", detail=f"unexpected {type(exc).__name__}: {exc}")
        self._record_upstream(result)  # once per fetch, however many scrapes share it
        with self._fetch_lock:
            self._inflight = None
        future.set_result(result)
        return result

    def _record_upstream(self, result: UpstreamResult) -> None:
        state = self._state
        now = time.monotonic()
        with state.lock:
            state.upstream_up = 1.0 if result.up else 0.0
            state.upstream_duration_s = result.duration_s
            if result.error:
                state.errors[result.error] += 1
            previous, when = state.last_logged
            changed = previous != result.error
            if changed or (result.error and now - when >= _REPEAT_LOG_S):
                state.last_logged = (result.error, now)
            else:
                return
        if result.error:
            log.warning("upstream metrics unavailable (%s): %s; serving vLLM's metrics alone", result.error,
                        result.detail)
        elif previous is not None:
            log.info("upstream metrics back after %s", previous)

    def _collect_vllm(self) -> list[Family]:
        directory = self.config.multiproc_dir
        for attempt in (1, 2):
            try:
                if self.config.reap_dead_processes:
                    with self._reap_lock:
                        reap_dead_processes(directory)
                families = collect_multiproc(directory)
                with self._state.lock:
                    self._state.multiproc_files = float(sum(1 for p in Path(directory).glob("*.db")))
                return families
            except Exception as exc:  # e.g. a file removed between listing and reading: retry once
                if attempt == 2:
                    with self._state.lock:
                        self._state.multiproc_errors += 1
                    log.warning("could not read vLLM's multiprocess files in %s: %s: %s", directory,
                                type(exc).__name__, exc)
        return []

    def _own_families(self) -> list[Family]:
        s = self._state
        with s.lock:
            families = [
                Family(PREFIX + "scrapes_total", "counter", "Scrapes answered by the metrics proxy, by format.",
                       [Sample(PREFIX + "scrapes_total", (("format", f),), v) for f, v in sorted(s.scrapes.items())]),
                Family(PREFIX + "multiproc_files", "gauge", "vLLM multiprocess files read in the last scrape.",
                       [Sample(PREFIX + "multiproc_files", (), s.multiproc_files)]),
                Family(PREFIX + "multiproc_errors_total", "counter",
                       "Scrapes in which vLLM's multiprocess files could not be read.",
                       [Sample(PREFIX + "multiproc_errors_total", (), s.multiproc_errors)]),
                Family(PREFIX + "shadowed_families", "gauge",
                       "Upstream families left out in the last scrape because vLLM's files or the proxy hold the "
                       "same name.", [Sample(PREFIX + "shadowed_families", (), s.shadowed)]),
                Family(PREFIX + "duplicate_series_total", "counter",
                       "Repeated series (same name and labels) dropped while merging.",
                       [Sample(PREFIX + "duplicate_series_total", (), s.duplicates)]),
            ]
            if self.config.upstream_url is not None:
                families += [
                    Family(PREFIX + "upstream_up", "gauge",
                           "1 if the last fetch of the upstream (Triton's) metrics succeeded, else 0.",
                           [Sample(PREFIX + "upstream_up", (), s.upstream_up)]),
                    Family(PREFIX + "upstream_scrape_errors_total", "counter",
                           "Failed fetches of the upstream (Triton's) metrics, by reason.",
                           [Sample(PREFIX + "upstream_scrape_errors_total", (("reason", r),), v)
                            for r, v in sorted(s.errors.items())]),
                    Family(PREFIX + "upstream_scrape_duration_seconds", "gauge",
                           "Duration of the last fetch of the upstream metrics.",
                           [Sample(PREFIX + "upstream_scrape_duration_seconds", (), s.upstream_duration_s)]),
                ]
        return families

    def scrape(self, fmt: str = "text") -> bytes:
        """One merged exposition in `fmt` ('text' or 'openmetrics')."""
        upstream: list[Family] = []
        if self.config.upstream_url is not None:
            upstream = self._fetch_shared().families
        vllm = self._collect_vllm()
        with self._state.lock:
            self._state.scrapes[fmt if fmt in self._state.scrapes else "text"] += 1
        own = self._own_families()
        report = merge([("proxy", own), ("vllm", vllm), ("upstream", upstream)])
        with self._state.lock:
            self._state.shadowed = float(len(report.shadowed))
            self._state.duplicates += report.duplicate_series
            shadowed_changed = report.shadowed != self._state.last_shadowed
            duplicates_began = report.duplicate_series > 0 and not self._state.last_duplicates
            self._state.last_shadowed = report.shadowed
            self._state.last_duplicates = report.duplicate_series
        if shadowed_changed and report.shadowed:  # expected with Triton's vLLM backend: said once, not per scrape
            log.info("families served from a higher-priority source instead (source, family): %s", report.shadowed)
        if duplicates_began:
            log.warning("%d repeated series (same name and labels) dropped while merging; the first value of each "
                        "is served", report.duplicate_series)
        # The proxy's own families come first and are never shadowed: redo them so they describe this scrape.
        families = self._own_families() + report.families[len(own):]
        return render(families, fmt)


def _handler_class(proxy: MetricsProxy) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def _send(self, status: int, body: bytes, content_type: str, head: bool = False) -> None:
            if "gzip" in (self.headers.get("Accept-Encoding") or "") and len(body) > 1024:
                body = gzip.compress(body, compresslevel=1)
                encoding = "gzip"
            else:
                encoding = None
            self.send_response(status)
            self.send_header("Content-Type", content_type)
            if encoding:
                self.send_header("Content-Encoding", encoding)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            if not head:
                self.wfile.write(body)

        def _dispatch(self, head: bool) -> None:
            path = self.path.split("?", 1)[0]
            if path == "/metrics":
                fmt, content_type = negotiate(self.headers.get("Accept"))
                try:
                    body = proxy.scrape(fmt)
                except Exception:  # never a 500 for a scrape: serve the proxy's own metrics at least
                    log.exception("merging the metrics failed")
                    body = render(proxy._own_families(), fmt)
                self._send(200, body, content_type, head)
            elif path in ("/health", "/healthz"):
                self._send(200, b"ok\n", "text/plain; charset=utf-8", head)
            else:
                self._send(404, f"no such endpoint {path}; try /metrics\n".encode(), "text/plain; charset=utf-8",
                           head)

        def do_GET(self) -> None:  # noqa: N802 (http.server's naming)
            self._dispatch(head=False)

        def do_HEAD(self) -> None:  # noqa: N802
            self._dispatch(head=True)

        def log_message(self, format: str, *args: object) -> None:  # scrapes are frequent: debug only
            log.debug("%s " + format, self.address_string(), *args)

    return Handler


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True
    request_queue_size = 128


@dataclass
class ProxyHandle:
    """A proxy running in this process (`start_proxy`)."""

    proxy: MetricsProxy
    server: ThreadingHTTPServer
    thread: threading.Thread

    @property
    def port(self) -> int:
        return self.server.server_address[1]

    @property
    def url(self) -> str:
        host = self.server.server_address[0]
        host = "127.0.0.1" if host in ("0.0.0.0", "") else host
        return f"http://{host}:{self.port}/metrics"

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.thread.join(timeout=5)


def start_proxy(config: ProxyConfig) -> ProxyHandle:
    """Serve the proxy from a daemon thread of this process (port 0 picks a free port); returns once bound."""
    proxy = MetricsProxy(config)
    server = _Server((config.host, config.port), _handler_class(proxy))
    thread = threading.Thread(target=server.serve_forever, name="metrics-proxy", daemon=True)
    thread.start()
    log.info("metrics proxy on %s:%d (upstream %s, vLLM files in %s)", config.host, server.server_address[1],
             config.upstream_url, config.multiproc_dir)
    return ProxyHandle(proxy, server, thread)


def _argv(config: ProxyConfig) -> list[str]:
    args = [
        "--multiproc-dir", str(config.multiproc_dir),
        "--host", config.host,
        "--port", str(config.port),
        "--upstream-timeout", str(config.upstream_timeout_s),
        "--upstream-max-bytes", str(config.upstream_max_bytes),
    ]
    args += ["--upstream", config.upstream_url] if config.upstream_url else ["--no-upstream"]
    if not config.reap_dead_processes:
        args.append("--no-reap")
    return args


def spawn_proxy(config: ProxyConfig, *, ready_timeout_s: float = 30.0) -> subprocess.Popen[bytes]:
    """Run the proxy as a child process; returns once its /health answers (port must not be 0)."""
    if config.port == 0:
        raise ValueError("spawn_proxy needs a fixed port (port 0 is only for start_proxy)")
    process = subprocess.Popen([sys.executable, "-m", "serving_image.metrics.proxy", *_argv(config)])
    host = "127.0.0.1" if config.host in ("0.0.0.0", "") else config.host
    deadline = time.monotonic() + ready_timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"metrics proxy exited with status {process.returncode} before it was ready")
        try:
            with urllib.request.urlopen(f"http://{host}:{config.port}/health", timeout=1) as response:
                if response.status == 200:
                    return process
        except OSError:
            time.sleep(0.1)
    process.kill()
    raise RuntimeError(f"metrics proxy did not answer on port {config.port} within {ready_timeout_s:g} s")


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m serving_image.metrics.proxy",
        description="Merge Triton's metrics with vLLM's multiprocess metrics.",
    )
    upstream = parser.add_mutually_exclusive_group()
    upstream.add_argument("--upstream", default=DEFAULT_UPSTREAM, help=f"upstream /metrics URL ({DEFAULT_UPSTREAM})")
    upstream.add_argument("--no-upstream", action="store_true", help="serve vLLM's metrics alone")
    parser.add_argument("--multiproc-dir", type=Path, default=os.environ.get("PROMETHEUS_MULTIPROC_DIR"),
                        help="vLLM's PROMETHEUS_MULTIPROC_DIR (default: that variable)")
    parser.add_argument("--host", default="0.0.0.0")
    parser.add_argument("--port", type=int, default=METRICS_PORT)
    parser.add_argument("--upstream-timeout", type=float, default=1.0, help="total seconds per upstream fetch")
    parser.add_argument("--upstream-max-bytes", type=int, default=16 * 1024 * 1024)
    parser.add_argument("--no-reap", action="store_true",
                        help="do not mark exited processes dead (when not in the engine's PID namespace)")
    return parser


def main(argv: list[str] | None = None) -> None:
    parser = _parser()
    args = parser.parse_args(argv)
    if args.multiproc_dir is None:
        parser.error("--multiproc-dir is required when PROMETHEUS_MULTIPROC_DIR is not set")
    if not Path(args.multiproc_dir).is_dir():
        parser.error(f"--multiproc-dir {args.multiproc_dir} is not a directory")
    try:
        config = ProxyConfig(
            multiproc_dir=Path(args.multiproc_dir),
            upstream_url=None if args.no_upstream else args.upstream,
            host=args.host,
            port=args.port,
            upstream_timeout_s=args.upstream_timeout,
            upstream_max_bytes=args.upstream_max_bytes,
            reap_dead_processes=not args.no_reap,
        )
    except ValueError as exc:
        parser.error(str(exc))
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    handle = start_proxy(config)
    try:
        handle.thread.join()
    except KeyboardInterrupt:
        handle.stop()


if __name__ == "__main__":
    main()
