"""The analysis gate's PromQL on a real Prometheus (Debian's `prometheus`, installed by the Makefile), scraping a
tiny exporter that serves the §3.8 series (Triton's request counters, vLLM's end-to-end latency histogram) for a
healthy and a failing version with the §3.10 labels the platform's scrape config keeps; the versioned clean-up's
idle proof on the same Prometheus, for a version that served nothing and for versions whose series are gone or
partial. And the client's errors against Prometheus' own error answers.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import threading
import time
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import yaml

from infra.rollout.gate import (
    GateThresholds,
    PrometheusClient,
    PrometheusError,
    analyze,
    coverage_step,
    duration_seconds,
    idle_evidence,
)
from llm_serving.ports import free_port

pytestmark = pytest.mark.timeout(180)

BUCKETS = (0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


IDLE_SCRAPES = 2  # the `gone` version's counter and the `down` version's target last this many scrapes
IDLE_VERSIONS = ("idle", "gone", "down")


class Exporter:
    """Serves /metrics/<version> in the text exposition format; counters grow between scrapes. The idle-proof
    versions: `idle` exports a success counter that stays 0; `gone` exports it for its first scrapes, then no longer
    (a relabeling or rename dropping it); `down` answers its first scrapes, then fails every one (up 0)."""

    def __init__(self):
        self.counts = {"1.0": {"ok": 0, "fail": 0, "lat": 0.8}, "2.0": {"ok": 0, "fail": 0, "lat": 40.0}}
        self.scrapes = dict.fromkeys(IDLE_VERSIONS, 0)
        self.lock = threading.Lock()

    def body(self, version: str) -> str | None:
        """The exposition, or None for a failed scrape."""
        with self.lock:
            if version in self.scrapes:
                self.scrapes[version] += 1
                early = self.scrapes[version] <= IDLE_SCRAPES
                if version == "down" and not early:
                    return None
                counter = version != "gone" or early
                return ("# TYPE nv_inference_request_success counter\nnv_inference_request_success 0\n" if counter
                        else "# TYPE nv_gpu_utilization gauge\nnv_gpu_utilization 0\n")
            c = self.counts[version]
            c["ok"] += 90 if version == "1.0" else 60
            c["fail"] += 1 if version == "1.0" else 40
            total = c["ok"] + c["fail"]
            lines = ["# TYPE nv_inference_request_success counter", f"nv_inference_request_success {c['ok']}",
                     "# TYPE nv_inference_request_failure counter", f"nv_inference_request_failure {c['fail']}",
                     # Triton's cumulative duration of the successful requests (what a non-vLLM model is judged by)
                     "# TYPE nv_inference_request_duration_us counter",
                     f"nv_inference_request_duration_us {c['ok'] * c['lat'] * 1e6:.0f}",
                     "# TYPE vllm:e2e_request_latency_seconds histogram"]
            for le in BUCKETS:
                lines.append(f'vllm:e2e_request_latency_seconds_bucket{{le="{le}"}} {total if c["lat"] <= le else 0}')
            lines += [f'vllm:e2e_request_latency_seconds_bucket{{le="+Inf"}} {total}',
                      f"vllm:e2e_request_latency_seconds_sum {total * c['lat']}",
                      f"vllm:e2e_request_latency_seconds_count {total}"]
            return "\n".join(lines) + "\n"


@pytest.fixture(scope="module")
def prometheus(tmp_path_factory):
    binary = shutil.which("prometheus")
    assert binary, "Prometheus (Debian's `prometheus` package) must be installed by the Makefile's serving-env"
    exporter = Exporter()

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args):
            pass

        def do_GET(self):  # noqa: N802
            text = exporter.body(self.path.rsplit("/", 1)[1])
            if text is None:
                self.send_error(500)
                return
            body = text.encode()
            self.send_response(200)
            self.send_header("Content-Type", "text/plain; version=0.0.4")
            self.end_headers()
            self.wfile.write(body)

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    target = f"127.0.0.1:{server.server_address[1]}"
    work = tmp_path_factory.mktemp("prometheus")
    labels = {"app_kubernetes_io_name": "chat", "app_kubernetes_io_part_of": "llm-serving", "namespace": "m"}
    config = {"global": {"scrape_interval": "1s"}, "scrape_configs": [
        {"job_name": f"v{v}", "metrics_path": f"/metrics/{v}",
         "static_configs": [{"targets": [target], "labels": {**labels, "app_kubernetes_io_version": v}}]}
        for v in ("1.0", "2.0", *IDLE_VERSIONS)]}
    (work / "prometheus.yml").write_text(yaml.safe_dump(config))
    port = free_port()
    log = open(work / "log", "wb")
    proc = subprocess.Popen([binary, f"--config.file={work / 'prometheus.yml'}",
                             f"--storage.tsdb.path={work / 'data'}", f"--web.listen-address=127.0.0.1:{port}"],
                            stdout=log, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    client = PrometheusClient(base)
    try:
        deadline = time.monotonic() + 90
        while True:
            assert proc.poll() is None, (work / "log").read_text()[-2000:]
            try:
                # Successful scrapes (up 1) only: a scrape gets the 1 s interval, which a loaded machine may miss,
                # and a failed one brings no sample to compute a rate from.
                if ((client.scalar('min(sum_over_time(up{job=~"v[0-9].*"}[1m]))') or 0) >= 5
                        # the idle proofs' window (IDLE_WINDOW) inside what was scraped, attempts counted
                        and (client.scalar('min(count_over_time(up{job=~"v[a-z].*"}[1m]))') or 0)
                        >= duration_seconds(IDLE_WINDOW) + 3):
                    break
            except PrometheusError:
                pass
            assert time.monotonic() < deadline, "Prometheus did not scrape the exporter 5 times in 90 s"
            time.sleep(0.5)
        yield client
    finally:
        proc.terminate()
        proc.wait(timeout=30)
        log.close()
        server.shutdown()


def test_healthy_version_passes(prometheus):
    result = analyze(prometheus, "chat", "1.0", GateThresholds(window="30s"))
    assert result.passed, result
    assert result.requests and result.requests > 0
    assert result.error_ratio == pytest.approx(1 / 91, rel=0.05)
    assert 0.5 <= result.latency_s <= 1.0  # the whole histogram sits in the (0.5, 1] bucket


def test_failing_version_fails_on_errors_and_latency(prometheus):
    result = analyze(prometheus, "chat", "2.0", GateThresholds(window="30s"))
    assert not result.passed
    assert result.error_ratio == pytest.approx(0.4, rel=0.05)
    assert "error ratio 40" in result.reason and "above 5.00%" in result.reason
    assert result.latency_s > 30 and "p95 latency" in result.reason
    relaxed = analyze(prometheus, "chat", "2.0", GateThresholds(window="30s", max_error_ratio=0.5,
                                                                  max_latency_s=120))
    assert relaxed.passed, relaxed


def test_a_model_without_vllm_is_judged_by_tritons_mean_request_duration(prometheus):
    """A Python-backend or ensemble model has no vLLM engine, hence no vLLM histogram: its latency is Triton's mean
    request duration (Triton exports cumulative counters, no quantiles); judged on vLLM's histogram it would have no
    latency data and never pass."""
    healthy = analyze(prometheus, "chat", "1.0", GateThresholds(window="30s"), kind="python")
    assert healthy.passed, healthy
    assert healthy.latency_s == pytest.approx(0.8, rel=0.01)
    failing = analyze(prometheus, "chat", "2.0", GateThresholds(window="30s"), kind="python")
    assert not failing.passed and failing.latency_s == pytest.approx(40.0, rel=0.01)
    assert "mean latency 40.00s above 30s" in failing.reason and "error ratio 40" in failing.reason
    assert "no latency" not in analyze(prometheus, "chat", "1.0", GateThresholds(window="30s")).reason


def test_version_without_series_has_no_evidence(prometheus):
    result = analyze(prometheus, "chat", "3.0", GateThresholds(window="30s"))
    assert not result.passed and result.requests is None
    assert "no request counter (nv_inference_request_success) for chat 3.0 in 30s" in result.reason


IDLE_WINDOW = "5s"  # inside the data the fixture waited for


def test_a_version_scraped_for_the_whole_window_that_served_nothing_is_proven_idle(prometheus):
    evidence = idle_evidence(prometheus, "chat", "idle", IDLE_WINDOW)
    assert evidence.idle, evidence.describe()
    assert evidence.requests == 0 and evidence.missing == ()
    busy = idle_evidence(prometheus, "chat", "1.0", IDLE_WINDOW)
    assert not busy.idle and busy.requests > 0 and busy.missing == ()
    assert busy.describe() == f"1.0 ({busy.requests:.0f} requests)"


def test_a_version_without_series_is_not_idle_and_the_evidence_names_both_series(prometheus):
    evidence = idle_evidence(prometheus, "chat", "3.0", IDLE_WINDOW)
    assert not evidence.idle and evidence.requests is None
    sel = 'app_kubernetes_io_name="chat", app_kubernetes_io_version="3.0"'
    assert evidence.missing == (f"up{{{sel}}} (every target scraped for the whole {IDLE_WINDOW})",
                                f"nv_inference_request_success{{{sel}}} (a series for the whole {IDLE_WINDOW})")
    assert evidence.describe().startswith(f"3.0 (not proven idle in {IDLE_WINDOW}: no data for up{{")


def test_a_window_longer_than_the_data_prometheus_holds_proves_nothing(prometheus):
    """The idle version, over a window reaching before this Prometheus started (a restart, a retention shorter than
    the window): the counter reads 0 requests, yet the version is not idle, since the start of the window is
    missing."""
    evidence = idle_evidence(prometheus, "chat", "idle", "10m")
    assert evidence.requests == 0 and not evidence.idle
    assert [m.split("{")[0] for m in evidence.missing] == ["up", "nv_inference_request_success"]
    assert all("for the whole 10m" in m for m in evidence.missing)


def test_a_counter_gone_partway_or_a_target_down_keeps_the_version(prometheus):
    gone = idle_evidence(prometheus, "chat", "gone", IDLE_WINDOW)
    assert not gone.idle
    assert [m.split("{")[0] for m in gone.missing] == ["nv_inference_request_success"]  # scraped fine, no counter
    down = idle_evidence(prometheus, "chat", "down", IDLE_WINDOW)
    assert not down.idle
    # the scrapes fail (up 0), and Prometheus marks the target's series stale: both are named
    assert [m.split("{")[0] for m in down.missing] == ["up", "nv_inference_request_success"]


def test_durations_are_prometheus_durations_and_the_coverage_step_sees_every_minute():
    assert duration_seconds("7d") == 604800 and duration_seconds("1h30m") == 5400 and duration_seconds("30s") == 30
    for bad in ("7 days", "", "0s", "5", "1h 30m", "-1m"):
        with pytest.raises(ValueError, match="not a Prometheus duration"):
            duration_seconds(bad)
    assert coverage_step("7d") == "60s" and coverage_step("30s") == "1s" and coverage_step("30m") == "30s"


def test_prometheus_errors_are_named(prometheus):
    with pytest.raises(PrometheusError, match="HTTP 400.*parse error"):
        prometheus.query("sum(rate(")
    with pytest.raises(PrometheusError, match="returned 2 series, expected one"):
        prometheus.scalar('up{job=~"v[0-9].*"}')
    with pytest.raises(PrometheusError, match="query .* failed"):
        PrometheusClient(f"http://127.0.0.1:{free_port()}", timeout_s=2).query("up")


def test_api_shape_is_what_the_client_reads(prometheus):
    # The client reads Prometheus' documented JSON: {"status", "data": {"resultType", "result": [...]}}.
    url = f"{prometheus.base_url}/api/v1/query?query=up"
    with urllib.request.urlopen(url, timeout=10) as resp:
        body = json.load(resp)
    assert body["status"] == "success" and body["data"]["resultType"] == "vector"
