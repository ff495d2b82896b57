"""The analysis gate's PromQL on a real Prometheus (Debian's `prometheus`, installed by the Makefile), scraping a
tiny exporter that serves the §3.8 series (Triton's request counters, vLLM's end-to-end latency histogram) for a
healthy and a failing version with the §3.10 labels the platform's scrape config keeps. And the client's errors
against Prometheus' own error answers.
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

from infra.rollout.gate import GateThresholds, PrometheusClient, PrometheusError, analyze, request_count
from llm_serving.ports import free_port

pytestmark = pytest.mark.timeout(180)

BUCKETS = (0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


class Exporter:
    """Serves /metrics/<version> in the text exposition format; counters grow between scrapes."""

    def __init__(self):
        self.counts = {"1.0": {"ok": 0, "fail": 0, "lat": 0.8}, "2.0": {"ok": 0, "fail": 0, "lat": 40.0}}
        self.lock = threading.Lock()

    def body(self, version: str) -> str:
        with self.lock:
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
            body = exporter.body(self.path.rsplit("/", 1)[1]).encode()
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
        for v in ("1.0", "2.0")]}
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
                if (client.scalar('min(sum_over_time(up{job=~"v.*"}[1m]))') or 0) >= 5:
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
    assert not result.passed and "0 requests in 30s" in result.reason
    assert request_count(prometheus, "chat", "3.0", "1m") == 0  # an idle version
    assert request_count(prometheus, "chat", "1.0", "1m") > 0


def test_prometheus_errors_are_named(prometheus):
    with pytest.raises(PrometheusError, match="HTTP 400.*parse error"):
        prometheus.query("sum(rate(")
    with pytest.raises(PrometheusError, match="returned 2 series, expected one"):
        prometheus.scalar('up{job=~"v.*"}')
    with pytest.raises(PrometheusError, match="query .* failed"):
        PrometheusClient(f"http://127.0.0.1:{free_port()}", timeout_s=2).query("up")


def test_api_shape_is_what_the_client_reads(prometheus):
    # The client reads Prometheus' documented JSON: {"status", "data": {"resultType", "result": [...]}}.
    url = f"{prometheus.base_url}/api/v1/query?query=up"
    with urllib.request.urlopen(url, timeout=10) as resp:
        body = json.load(resp)
    assert body["status"] == "success" and body["data"]["resultType"] == "vector"
