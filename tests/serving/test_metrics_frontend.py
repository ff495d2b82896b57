"""The local front-ends' request metrics under Triton's names, types and labels (Triton: docs/user_guide/metrics.md)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import threading

import pytest

from serving_image.metrics import frontend
from serving_image.metrics.exposition import parse_text
from serving_image.metrics.frontend import FrontendMetrics, serve_frontend_metrics
from tests.serving.test_metrics_helpers import get, series, type_lines


@pytest.fixture
def served():
    metrics = FrontendMetrics()
    server = serve_frontend_metrics(metrics, port=0)
    yield metrics, server
    server.stop()


def test_names_types_and_labels_are_tritons(served):
    metrics, server = served
    metrics.observe("chat", "2", success=True, duration_s=0.5, queue_s=0.1, compute_input_s=0.01,
                    compute_infer_s=0.3, compute_output_s=0.02, batch_size=4, first_response_s=0.05)
    metrics.observe("chat", "2", success=False, duration_s=0.2, failure_reason="BACKEND")
    status, content_type, text = get(server.url)
    assert status == 200 and content_type.startswith("text/plain; version=0.0.4")
    assert type_lines(text) == {
        **{name: "counter" for name in frontend.FAMILY_NAMES if name.endswith(("_success", "_failure", "_us"))},
        "nv_inference_count": "counter",
        "nv_inference_exec_count": "counter",
        "nv_inference_pending_request_count": "gauge",
        "nv_inference_first_response_histogram_ms": "histogram",
    }
    values = series(text)
    key = '{model="chat",version="2"}'
    assert values["nv_inference_request_success" + key] == 1
    assert values["nv_inference_count" + key] == 4  # a batch of n counts n inferences
    assert values["nv_inference_exec_count" + key] == 1
    # cumulative microseconds of successful requests only (the failure's 0.2 s is not added), as Triton does
    assert values["nv_inference_request_duration_us" + key] == 500000
    assert values["nv_inference_queue_duration_us" + key] == 100000
    assert values["nv_inference_compute_input_duration_us" + key] == 10000
    assert values["nv_inference_compute_infer_duration_us" + key] == 300000
    assert values["nv_inference_compute_output_duration_us" + key] == 20000
    for reason in ("REJECTED", "CANCELED", "BACKEND", "OTHER"):
        expected = 1 if reason == "BACKEND" else 0
        assert values[f'nv_inference_request_failure{{model="chat",reason="{reason}",version="2"}}'] == expected
    buckets = {k: v for k, v in values.items() if k.startswith("nv_inference_first_response_histogram_ms_bucket")}
    assert buckets == {  # Triton's default buckets; 50 ms falls in the first
        f'nv_inference_first_response_histogram_ms_bucket{{le="{le}",model="chat",version="2"}}': 1.0
        for le in ("100.0", "500.0", "2000.0", "5000.0", "+Inf")
    }
    assert values["nv_inference_first_response_histogram_ms_sum" + key] == 50.0
    assert values["nv_inference_first_response_histogram_ms_count" + key] == 1
    assert not any(name.endswith("_total") for name in type_lines(text))


def test_pending_gauge_counts_requests_in_flight(served):
    metrics, server = served
    key = 'nv_inference_pending_request_count{model="m",version="1"}'
    with metrics.pending("m", "1"), metrics.pending("m", "1"):
        assert series(get(server.url)[2])[key] == 2
    with pytest.raises(RuntimeError), metrics.pending("m", "1"):
        raise RuntimeError("the request failed")
    assert series(get(server.url)[2])[key] == 0


def test_registered_model_shows_zeros_before_its_first_request(served):
    metrics, server = served
    assert parse_text(get(server.url)[2])[0].samples == []
    metrics.register_model("m", "1")
    values = series(get(server.url)[2])
    assert values['nv_inference_request_success{model="m",version="1"}'] == 0


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"model": ""}, "model must be a non-empty string"),
        ({"version": 1}, "version must be a non-empty string"),
        ({"success": "yes"}, "success must be a bool"),
        ({"duration_s": -1.0}, "duration_s must be a non-negative"),
        ({"queue_s": float("nan")}, "queue_s must be a non-negative"),
        ({"compute_infer_s": "1"}, "compute_infer_s must be a non-negative"),
        ({"batch_size": 0}, "batch_size must be a positive integer"),
        ({"failure_reason": "TIMEOUT"}, "failure_reason must be one of REJECTED, CANCELED, BACKEND, OTHER"),
        ({"first_response_s": -0.1}, "first_response_s must be a non-negative"),
    ],
)
def test_bad_observations_are_rejected_naming_the_field(kwargs, message):
    metrics = FrontendMetrics()
    args = {"model": "m", "version": "1", "success": True, "duration_s": 0.1, **kwargs}
    model, version = args.pop("model"), args.pop("version")
    with pytest.raises(ValueError, match=message):
        metrics.observe(model, version, **args)
    assert metrics.registry.get_sample_value("nv_inference_request_success", {"model": "m", "version": "1"}) in (
        None, 0.0,
    )


def test_concurrent_observations_are_all_counted(served):
    metrics, server = served

    def worker():
        for _ in range(500):
            metrics.observe("m", "1", success=True, duration_s=0.001)

    threads = [threading.Thread(target=worker) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    values = series(get(server.url)[2])
    assert values['nv_inference_request_success{model="m",version="1"}'] == 4000
    assert values['nv_inference_request_duration_us{model="m",version="1"}'] == 4000 * 1000


def test_writes_nothing_into_the_multiprocess_directory(tmp_path):
    """The front-ends share a process with vLLM, where PROMETHEUS_MULTIPROC_DIR is set: their metrics must stay in
    memory, or the proxy would read them twice (from the files and over HTTP)."""
    script = textwrap.dedent(
        """
        from serving_image.metrics.frontend import FrontendMetrics
        m = FrontendMetrics()
        m.observe("m", "1", success=True, duration_s=0.1, first_response_s=0.01)
        with m.pending("m", "1"):
            pass
        """
    )
    env = {**os.environ, "PROMETHEUS_MULTIPROC_DIR": str(tmp_path)}
    subprocess.run([sys.executable, "-c", script], env=env, check=True, timeout=60)
    assert list(tmp_path.iterdir()) == []


def test_first_response_histogram_buckets_are_cumulative(served):
    metrics, server = served
    for seconds in (0.05, 0.7, 0.7, 9.0):
        metrics.observe("m", "1", success=True, duration_s=seconds, first_response_s=seconds)
    values = series(get(server.url)[2])
    bucket = 'nv_inference_first_response_histogram_ms_bucket{{le="{}",model="m",version="1"}}'
    assert [values[bucket.format(le)] for le in ("100.0", "500.0", "2000.0", "5000.0", "+Inf")] == [1, 1, 3, 3, 4]
    assert values['nv_inference_first_response_histogram_ms_count{model="m",version="1"}'] == 4
    assert values['nv_inference_first_response_histogram_ms_sum{model="m",version="1"}'] == 50 + 700 + 700 + 9000
