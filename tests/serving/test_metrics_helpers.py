"""Helpers shared by the metrics tests: processes that write real prometheus_client multiprocess files, and
HTTP upstreams that misbehave on purpose.

The misbehaving upstreams stand in for Triton's metrics port misbehaving (a real Triton cannot be made to trickle
bytes or answer 500 on demand); real Triton's metrics through the proxy are tested in test_kserve_startup.py and
test_openai_embedded.py.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import threading
import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

# A process that records metrics the way vLLM does (prometheus_client with PROMETHEUS_MULTIPROC_DIR set before
# the import), prints "ready", and exits when its stdin closes.
_WRITER = textwrap.dedent(
    """
    import sys
    from prometheus_client import Counter, Gauge, Histogram
    tag = sys.argv[1]
    c = Counter("demo:requests", "Requests.", ["model_name"])
    g = Gauge("demo:running", "Running requests.", ["model_name"], multiprocess_mode="livesum")
    m = Gauge("demo:cache_usage", "Cache usage.", ["model_name"], multiprocess_mode="mostrecent")
    h = Histogram("demo:latency_seconds", "Latency.", ["model_name"], buckets=(0.1, 1.0))
    c.labels("demo").inc(int(sys.argv[2]))
    g.labels("demo").set(int(sys.argv[3]))
    m.labels("demo").set(0.25)
    h.labels("demo").observe(0.5)
    print("ready", flush=True)
    sys.stdin.read()
    """
)


def start_writer(multiproc_dir: Path, requests: int, running: int) -> subprocess.Popen[str]:
    env = {**os.environ, "PROMETHEUS_MULTIPROC_DIR": str(multiproc_dir)}
    proc = subprocess.Popen(
        [sys.executable, "-c", _WRITER, "w", str(requests), str(running)],
        env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
    )
    assert proc.stdout is not None
    line = proc.stdout.readline()
    assert line.strip() == "ready", f"metrics writer failed to start: {line!r}"
    return proc


def stop_writer(proc: subprocess.Popen[str]) -> None:
    assert proc.stdin is not None
    proc.stdin.close()
    proc.wait(timeout=10)


@dataclass
class FakeUpstream:
    server: ThreadingHTTPServer
    thread: threading.Thread

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}/metrics"

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def fake_upstream(respond: Callable[[BaseHTTPRequestHandler], None]) -> FakeUpstream:
    """An HTTP server whose GET handler is `respond` (a stand-in for Triton's metrics port, see module doc)."""

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802
            try:
                respond(self)
            except (BrokenPipeError, ConnectionResetError):
                pass  # the proxy gave up on us, as it should

        def log_message(self, format: str, *args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    return FakeUpstream(server, thread)


def send(handler: BaseHTTPRequestHandler, status: int, body: bytes, content_type: str = "text/plain") -> None:
    handler.send_response(status)
    handler.send_header("Content-Type", content_type)
    handler.send_header("Content-Length", str(len(body)))
    handler.end_headers()
    handler.wfile.write(body)


def get(url: str, accept: str | None = None, timeout: float = 30) -> tuple[int, str, str]:
    request = urllib.request.Request(url, headers={"Accept": accept} if accept else {})
    with urllib.request.urlopen(request, timeout=timeout) as response:
        return response.status, response.headers["Content-Type"], response.read().decode()


def series(text: str) -> dict[str, float]:
    """{'name{labels}': value} of every sample line (labels as written, which the writers sort)."""
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            key, value = line.rsplit(" ", 1)
            out[key] = float(value)
    return out


def type_lines(text: str) -> dict[str, str]:
    out: dict[str, str] = {}
    for line in text.splitlines():
        if line.startswith("# TYPE "):
            _, _, name, kind = line.split(" ", 3)
            assert name not in out, f"family {name} has two TYPE lines"
            out[name] = kind
    return out


def wait_for(predicate: Callable[[], bool], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.2)
    raise AssertionError(f"timed out after {timeout} s waiting for {what}")
