"""The metrics proxy against real prometheus_client multiprocess files and real HTTP upstreams (no engine here:
`test_metrics_vllm.py` runs the proxy against a real vLLM engine).

The upstream stands in for Triton's metrics port: when it should work, `TritonMetricsStandIn` (Triton's per-model
families under its names, types and labels) served by the real `serve_exposition`, the server that serves embedded
Triton's metrics text in the pod; when it should not, small HTTP servers that misbehave on purpose. Real Triton's
metrics through the proxy are tested in tests/serving/test_kserve_startup.py and test_openai_embedded.py.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import gzip
import logging
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry
from prometheus_client.core import GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.metrics_core import Metric
from prometheus_client.openmetrics.parser import text_string_to_metric_families as parse_openmetrics
from prometheus_client.registry import Collector

from serving_image.metrics.exposition import TritonCounter, from_client_metrics, write_text
from serving_image.metrics.frontend import FAMILY_NAMES, FrontendMetricsServer, serve_exposition
from serving_image.metrics.multiproc import clear_multiproc_dir
from serving_image.metrics.proxy import ProxyConfig, main, spawn_proxy, start_proxy
from tests.serving.test_metrics_helpers import (
    fake_upstream,
    get,
    send,
    series,
    start_writer,
    stop_writer,
    type_lines,
    wait_for,
)

OPENMETRICS = "application/openmetrics-text;version=1.0.0,text/plain;version=0.0.4;q=0.5"

FAILURE = "nv_inference_request_failure"
PENDING = "nv_inference_pending_request_count"
FIRST_RESPONSE = "nv_inference_first_response_histogram_ms"
COUNTERS = tuple(name for name in FAMILY_NAMES if name not in (FAILURE, PENDING, FIRST_RESPONSE))
FAILURE_REASONS = ("REJECTED", "CANCELED", "BACKEND", "OTHER")
FIRST_RESPONSE_BUCKETS_MS = (100.0, 500.0, 2000.0, 5000.0)  # Triton's defaults


class TritonMetricsStandIn(Collector):
    """Stands in for Triton's metrics port: one model's per-model families as Triton writes them (its
    docs/user_guide/metrics.md), holding what the test counts. Triton itself runs where its metrics are tested
    through the proxy: tests/serving/test_kserve_startup.py and test_openai_embedded.py.

    prometheus_client metric families in a plain `CollectorRegistry`, written in text 0.0.4 by the proxy's own writer:
    Triton's counters have no `_total` suffix (`nv_inference_request_success{...} 3` under
    `# TYPE nv_inference_request_success counter`), which prometheus_client's `Counter` and `generate_latest` always
    add, so they would not be Triton's series (serving_image/metrics/exposition.py)."""

    def __init__(self, model: str, version: str = "1") -> None:
        self._labels = (model, version)
        self._lock = threading.Lock()
        self._counters = dict.fromkeys(COUNTERS, 0.0)
        self._failures = dict.fromkeys(FAILURE_REASONS, 0.0)
        self._pending = 0
        self._first_response_ms: list[float] = []
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(self)

    def succeeded(self, duration_s: float, first_response_s: float | None = None) -> None:
        """One successful request, all of it compute (the engine's), as Triton counts it."""
        with self._lock:
            for name in ("nv_inference_request_success", "nv_inference_count", "nv_inference_exec_count"):
                self._counters[name] += 1
            for name in ("nv_inference_request_duration_us", "nv_inference_compute_infer_duration_us"):
                self._counters[name] += round(duration_s * 1e6)
            if first_response_s is not None:
                self._first_response_ms.append(first_response_s * 1000)

    def failed(self, reason: str) -> None:
        with self._lock:
            self._failures[reason] += 1

    @contextlib.contextmanager
    def pending(self) -> Iterator[None]:
        with self._lock:
            self._pending += 1
        try:
            yield
        finally:
            with self._lock:
                self._pending -= 1

    def collect(self) -> Iterator[Metric]:
        with self._lock:
            counters, failures, pending = dict(self._counters), dict(self._failures), self._pending
            first_ms = list(self._first_response_ms)
        model, version = self._labels
        for name, value in counters.items():
            counter = TritonCounter(name, f"Triton's {name}")
            counter.add_sample(name, {"model": model, "version": version}, value)
            yield counter
        failure = TritonCounter(FAILURE, "Number of failed inference requests, all batch sizes")
        for reason, value in failures.items():
            failure.add_sample(FAILURE, {"model": model, "reason": reason, "version": version}, value)
        yield failure
        gauge = GaugeMetricFamily(PENDING, "Instantaneous number of pending requests", labels=["model", "version"])
        gauge.add_metric(self._labels, pending)
        yield gauge
        if first_ms:  # only once a first response was sent
            histogram = HistogramMetricFamily(FIRST_RESPONSE, "Duration from request to first response in ms",
                                              labels=["model", "version"])
            buckets = [(str(bound), sum(ms <= bound for ms in first_ms)) for bound in FIRST_RESPONSE_BUCKETS_MS]
            histogram.add_metric(self._labels, [*buckets, ("+Inf", len(first_ms))], sum(first_ms))
            yield histogram

    def text(self) -> bytes:
        return write_text(from_client_metrics(self.registry.collect()))

    def serve(self, port: int = 0) -> FrontendMetricsServer:
        """On the server that serves embedded Triton's metrics text in the pod."""
        return serve_exposition(self.text, port=port)


@pytest.fixture
def mpdir(tmp_path: Path) -> Path:
    directory = tmp_path / "prom"
    directory.mkdir()
    return directory


@pytest.fixture
def triton():
    """The stand-in for Triton's metrics port, after one successful and one rejected request."""
    metrics = TritonMetricsStandIn("demo")
    metrics.succeeded(duration_s=0.25, first_response_s=0.05)
    metrics.failed("REJECTED")
    server = metrics.serve()
    yield metrics, server
    server.stop()


@pytest.fixture
def writers(mpdir: Path):
    """Two live processes writing vLLM-style multiprocess files."""
    procs = [start_writer(mpdir, requests=3, running=2), start_writer(mpdir, requests=4, running=5)]
    yield procs
    for proc in procs:
        if proc.poll() is None:
            stop_writer(proc)


# The proxy's default upstream deadline (1 s) is short for a loaded machine, where even the in-process upstream of
# these tests may answer later: a test that needs the upstream's families gives it this guard instead, which only a
# hung upstream reaches. The tests of the deadline itself hold their upstream past a short one.
UPSTREAM_GUARD_S = 30.0


def _proxy(mpdir: Path, upstream: str | None, **kwargs):
    kwargs.setdefault("upstream_timeout_s", UPSTREAM_GUARD_S)
    return start_proxy(ProxyConfig(multiproc_dir=mpdir, upstream_url=upstream, host="127.0.0.1", port=0, **kwargs))


def test_merges_multiprocess_files_and_upstream_every_family_once(mpdir, writers, triton):
    _, server = triton
    handle = _proxy(mpdir, server.url)
    try:
        status, content_type, text = get(handle.url)
    finally:
        handle.stop()
    assert status == 200
    assert content_type.startswith("text/plain; version=0.0.4")
    values = series(text)
    types = type_lines(text)  # asserts one TYPE line per family
    # vLLM side, summed across the two processes as prometheus_client defines it
    assert values['demo:requests_total{model_name="demo"}'] == 7
    assert values['demo:running{model_name="demo"}'] == 7  # livesum: 2 + 5
    assert values['demo:latency_seconds_count{model_name="demo"}'] == 2
    assert types["demo:requests_total"] == "counter" and types["demo:latency_seconds"] == "histogram"
    # upstream side, with Triton's exact names (no `_total` added)
    assert values['nv_inference_request_success{model="demo",version="1"}'] == 1
    assert values['nv_inference_request_failure{model="demo",reason="REJECTED",version="1"}'] == 1
    assert values['nv_inference_request_duration_us{model="demo",version="1"}'] == 250000
    assert values['nv_inference_pending_request_count{model="demo",version="1"}'] == 0
    assert values['nv_inference_first_response_histogram_ms_count{model="demo",version="1"}'] == 1
    assert types["nv_inference_request_success"] == "counter"
    assert types["nv_inference_pending_request_count"] == "gauge"
    assert types["nv_inference_first_response_histogram_ms"] == "histogram"
    assert values["llm_serving_metrics_upstream_up"] == 1
    # no series twice
    lines = [line for line in text.splitlines() if line and not line.startswith("#")]
    assert len(lines) == len({line.rsplit(" ", 1)[0] for line in lines})


def test_openmetrics_by_content_negotiation_parses_with_the_openmetrics_parser(mpdir, writers, triton):
    _, server = triton
    handle = _proxy(mpdir, server.url)
    try:
        status, content_type, text = get(handle.url, accept=OPENMETRICS)
        _, plain_type, _ = get(handle.url, accept="text/plain;version=0.0.4")
    finally:
        handle.stop()
    assert status == 200
    assert content_type == "application/openmetrics-text; version=1.0.0; charset=utf-8"
    assert plain_type.startswith("text/plain; version=0.0.4")
    assert text.endswith("# EOF\n")
    families = {f.name: f for f in parse_openmetrics(text)}  # raises on anything that is not OpenMetrics
    assert families["demo:requests"].type == "counter"
    assert {s.name for s in families["demo:requests"].samples} == {"demo:requests_total"}
    # Triton's counters keep their series name; OpenMetrics can only say so with type unknown
    assert families["nv_inference_request_success"].type == "unknown"
    assert families["nv_inference_request_success"].samples[0].value == 1


def test_gzip_when_asked(mpdir, writers):
    handle = _proxy(mpdir, None)
    try:
        request = urllib.request.Request(handle.url, headers={"Accept-Encoding": "gzip"})
        with urllib.request.urlopen(request, timeout=10) as response:
            assert response.headers["Content-Encoding"] == "gzip"
            text = gzip.decompress(response.read()).decode()
    finally:
        handle.stop()
    assert 'demo:requests_total{model_name="demo"} 7.0' in text


def _slow(handler):
    time.sleep(60)  # far beyond the proxy's deadline and the test client's timeout
    send(handler, 200, b"nv_inference_count 1\n")


def _trickle(handler):
    handler.send_response(200)
    handler.send_header("Content-Type", "text/plain")
    handler.end_headers()
    for _ in range(600):  # one byte every 0.1 s for a minute: each read is quick, the whole body is not
        handler.wfile.write(b"#")
        handler.wfile.flush()
        time.sleep(0.1)


@pytest.mark.parametrize(
    ("respond", "reason"),
    [
        (lambda h: send(h, 200, b"<html><body>502 Bad Gateway</body></html>", "text/html"), "parse"),
        (lambda h: send(h, 200, b'{"metrics": []}', "application/json"), "parse"),
        (lambda h: send(h, 200, b"# TYPE a counter\na 1\n# TYPE a gauge\na 2\n"), "parse"),
        (lambda h: send(h, 200, b"\xff\xfe binary"), "parse"),
        (lambda h: send(h, 500, b"internal error"), "http_status"),
        (lambda h: send(h, 200, b"x 1\n" * 100_000), "too_large"),
        (_slow, "timeout"),
        (_trickle, "timeout"),
    ],
    ids=["html", "json", "two-types", "binary", "http-500", "too-large", "slow", "trickle"],
)
def test_bad_upstream_still_answers_200_with_vllm_metrics_and_upstream_down(mpdir, writers, respond, reason, caplog):
    upstream = fake_upstream(respond)
    # A short deadline only where the upstream is held past it (it answers in 60 s at the earliest): elsewhere the
    # reason must be the bad answer's, which a slow machine must not turn into a timeout.
    deadline_s = 0.5 if reason == "timeout" else UPSTREAM_GUARD_S
    handle = _proxy(mpdir, upstream.url, upstream_timeout_s=deadline_s, upstream_max_bytes=64 * 1024)
    try:
        with caplog.at_level(logging.WARNING, logger="serving_image.metrics.proxy"):
            # If the proxy waited for a held upstream, the client's timeout would fail the test.
            status, _, text = get(handle.url, timeout=2 * UPSTREAM_GUARD_S)
    finally:
        handle.stop()
        upstream.stop()
    assert status == 200
    values = series(text)
    assert values['demo:requests_total{model_name="demo"}'] == 7  # vLLM's metrics are all there
    assert values["llm_serving_metrics_upstream_up"] == 0
    assert values[f'llm_serving_metrics_upstream_scrape_errors_total{{reason="{reason}"}}'] == 1
    assert not any(name.startswith("nv_") or name.startswith("x") for name in values)  # nothing half-parsed
    assert any(f"({reason})" in record.getMessage() for record in caplog.records), caplog.text


def test_upstream_down_then_back(mpdir, writers, caplog):
    metrics = TritonMetricsStandIn("demo")
    server = metrics.serve()
    port = server.port
    handle = _proxy(mpdir, server.url)
    try:
        assert series(get(handle.url)[2])["llm_serving_metrics_upstream_up"] == 1
        server.stop()
        with caplog.at_level(logging.WARNING, logger="serving_image.metrics.proxy"):
            status, _, text = get(handle.url)
        assert status == 200
        values = series(text)
        assert values["llm_serving_metrics_upstream_up"] == 0
        assert values['llm_serving_metrics_upstream_scrape_errors_total{reason="connection"}'] == 1
        assert "Connection refused" in caplog.text
        server = metrics.serve(port=port)
        values = series(get(handle.url)[2])
        assert values["llm_serving_metrics_upstream_up"] == 1
        assert values['nv_inference_request_success{model="demo",version="1"}'] == 0
    finally:
        handle.stop()
        server.stop()


def test_upstream_family_that_vllm_files_also_hold_is_served_once(mpdir, writers, caplog):
    """Triton's vLLM backend exports some `vllm:*` families itself: the engine's own files win, once."""
    body = (
        b"# HELP demo:requests_total bridge copy\n# TYPE demo:requests_total counter\n"
        b'demo:requests_total{model="demo",version="1"} 99\n'
        b"# TYPE nv_inference_count counter\n"
        b'nv_inference_count{model="demo",version="1"} 5\nnv_inference_count{model="demo",version="1"} 6\n'
    )
    upstream = fake_upstream(lambda h: send(h, 200, body))
    handle = _proxy(mpdir, upstream.url)
    try:
        with caplog.at_level(logging.INFO, logger="serving_image.metrics.proxy"):
            text = get(handle.url)[2]
            get(handle.url)  # the same again: logged once, not per scrape
    finally:
        handle.stop()
        upstream.stop()
    assert sum("('upstream', 'demo:requests_total')" in r.getMessage() for r in caplog.records) == 1
    assert sum("1 repeated series" in r.getMessage() for r in caplog.records) == 1
    types = type_lines(text)
    assert list(types).count("demo:requests_total") == 1
    values = series(text)
    assert values['demo:requests_total{model_name="demo"}'] == 7
    assert 'demo:requests_total{model="demo",version="1"}' not in values
    assert values["llm_serving_metrics_shadowed_families"] == 1
    assert values['nv_inference_count{model="demo",version="1"}'] == 5  # first of a repeated series
    assert values["llm_serving_metrics_duplicate_series_total"] == 1


def test_dead_process_live_gauges_are_removed_counters_kept(mpdir, writers):
    handle = _proxy(mpdir, None)
    try:
        before = series(get(handle.url)[2])
        assert before['demo:running{model_name="demo"}'] == 7
        stop_writer(writers[1])  # the process that had 5 running and 4 requests exits
        after = series(get(handle.url)[2])
    finally:
        handle.stop()
    assert after['demo:running{model_name="demo"}'] == 2  # its live gauge file was marked dead
    assert after['demo:requests_total{model_name="demo"}'] == 7  # its counters stay
    assert not list(mpdir.glob(f"gauge_livesum_{writers[1].pid}.db"))


def test_clear_multiproc_dir_removes_stale_files(mpdir, writers, caplog):
    for proc in writers:
        stop_writer(proc)
    stale = sorted(p.name for p in mpdir.glob("*.db"))
    assert stale, "the writers should have left files"
    (mpdir / "notes.txt").write_text("not a metrics file")
    with caplog.at_level(logging.WARNING):
        removed = clear_multiproc_dir(mpdir)
    assert removed == len(stale)
    assert sorted(p.name for p in mpdir.iterdir()) == ["notes.txt"]
    assert "notes.txt" in caplog.text
    fresh = mpdir.parent / "fresh"
    assert clear_multiproc_dir(fresh) == 0 and fresh.is_dir()


def test_missing_multiproc_dir_is_an_error_on_the_command_line(tmp_path, capsys):
    with pytest.raises(SystemExit) as exc:
        main(["--multiproc-dir", str(tmp_path / "nope"), "--port", "0"])
    assert exc.value.code == 2
    assert "is not a directory" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"upstream_url": "ftp://x/metrics"}, "upstream URL must be http"),
        ({"upstream_timeout_s": 0}, "upstream_timeout_s"),
        ({"upstream_max_bytes": -1}, "upstream_max_bytes"),
        ({"port": 70000}, "port"),
    ],
)
def test_bad_config_names_the_field(tmp_path, kwargs, message):
    with pytest.raises(ValueError, match=message):
        ProxyConfig(multiproc_dir=tmp_path, **kwargs)


def test_spawned_child_process_serves_the_merge(mpdir, writers, triton):
    """The startup procedure's other way to run it: `python -m serving_image.metrics.proxy` as a child."""
    from llm_serving.ports import free_port

    _, server = triton
    port = free_port()
    proc = spawn_proxy(ProxyConfig(multiproc_dir=mpdir, upstream_url=server.url, host="127.0.0.1", port=port,
                                   upstream_timeout_s=UPSTREAM_GUARD_S))
    try:
        values = series(get(f"http://127.0.0.1:{port}/metrics")[2])
        assert values['demo:requests_total{model_name="demo"}'] == 7
        assert values['nv_inference_request_success{model="demo",version="1"}'] == 1
        with pytest.raises(urllib.request.HTTPError) as err:
            get(f"http://127.0.0.1:{port}/nope")
        assert err.value.code == 404
    finally:
        proc.terminate()
        proc.wait(timeout=10)


def test_promtool_check_metrics_finds_no_error_and_no_lint_in_the_proxys_own_names(mpdir, writers, triton):
    """promtool parses the whole output. Its lint findings may only be about names the proxy passes through
    (vLLM's colon names, Triton's counters without `_total`), never about the proxy's own metrics."""
    _, server = triton
    handle = _proxy(mpdir, server.url)
    try:
        text = get(handle.url)[2]
    finally:
        handle.stop()
    result = subprocess.run(["promtool", "check", "metrics"], input=text, capture_output=True, text=True)
    findings = (result.stdout + result.stderr).strip().splitlines()
    assert result.returncode in (0, 3), f"promtool could not parse the exposition: {findings}"
    linted = {line.split()[0] for line in findings}
    passed_through = {name for name in type_lines(text) if name.startswith(("demo:", "nv_"))}
    assert linted <= passed_through, f"lint findings about the proxy's own names: {linted - passed_through}"


def test_module_runs_as_a_script(mpdir):
    result = subprocess.run(
        [sys.executable, "-m", "serving_image.metrics.proxy", "--help"], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0 and "--upstream-timeout" in result.stdout


class _CountingLock:
    """A lock that counts how often it was released: put in place of the proxy's fetch lock, it tells how many
    scrapes have decided, under that lock, whether to start the upstream fetch or to wait for the one in flight."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.released = 0

    def __enter__(self) -> _CountingLock:
        self._lock.acquire()
        return self

    def __exit__(self, *exc: object) -> None:
        self.released += 1  # still under the lock: no update is lost
        self._lock.release()


def test_concurrent_scrapes_share_one_upstream_fetch_and_count_each_failure_once(mpdir, writers):
    """Ten scrapes while an upstream fetch is in flight share it: one fetch, its failure counted once.

    The overlap is forced: the upstream answers only once all ten scrapes have passed the proxy's fetch lock (the
    first started the fetch, the nine others found it in flight), however slowly the scrapes arrive."""
    answer = threading.Event()
    hits = []

    def respond(handler):
        hits.append(1)
        answer.wait(60)
        send(handler, 200, b"<html>not metrics</html>")

    upstream = fake_upstream(respond)
    handle = _proxy(mpdir, upstream.url)
    lock = handle.proxy._fetch_lock = _CountingLock()
    try:
        with concurrent.futures.ThreadPoolExecutor(max_workers=10) as pool:
            scrapes = [pool.submit(get, handle.url) for _ in range(10)]
            # The fetch cannot end before `answer` is set, so its owner releases the lock once and so does each
            # of the nine waiters.
            wait_for(lambda: lock.released >= 10 and len(hits) == 1, timeout=60,
                     what="ten scrapes sharing one upstream fetch")
            answer.set()
            answers = [scrape.result() for scrape in scrapes]
        shared_fetches = len(hits)
        final = series(get(handle.url)[2])  # a fetch of its own: the in-flight one has ended
    finally:
        answer.set()
        handle.stop()
        upstream.stop()
    assert all(status == 200 for status, _, _ in answers)
    assert shared_fetches == 1, "concurrent scrapes should share the in-flight upstream fetch"
    assert len(hits) == 2
    assert final['llm_serving_metrics_upstream_scrape_errors_total{reason="parse"}'] == 2
