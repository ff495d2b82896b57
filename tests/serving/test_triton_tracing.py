"""Triton's own OpenTelemetry tracing in the `standalone` mode (serving_image/triton/tracing.py): the tracing
variables of the pod's environment become tritonserver's `--trace-config`, a wrong one is named, and, against the real
tritonserver, one trace id joins a caller's stages (llm_serving_client) and the spans Triton exports for the call.

The slow tests start a server of their own (`traced_server`) instead of the shared `triton_standalone`: Triton's
OpenTelemetry settings are fixed at start (its trace extension cannot change them while it runs), and tracing the
shared server would send every test's traced request through Triton's exporter, changing the server they test."""

from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from llm_serving import pod_contract as pc
from serving_image.triton.tracing import SERVICE_NAME, TracingConfigError, TritonTracing

# -- the configuration --------------------------------------------------------------------------------------------


def test_tracing_is_off_without_an_endpoint():
    assert TritonTracing.from_env({}) is None
    assert TritonTracing.from_env({pc.ENV_TRACE_OTLP_URL: "  "}) is None


def test_the_endpoint_and_rate_become_triton_trace_config():
    tracing = TritonTracing.from_env({pc.ENV_TRACE_OTLP_URL: "http://otel-collector:4318/v1/traces",
                                      pc.ENV_TRACE_RATE: "100"})
    assert tracing == TritonTracing("http://otel-collector:4318/v1/traces", 100)
    assert tracing.arguments() == [
        "--trace-config=mode=opentelemetry", "--trace-config=level=TIMESTAMPS", "--trace-config=rate=100",
        "--trace-config=count=-1", "--trace-config=opentelemetry,url=http://otel-collector:4318/v1/traces",
        f"--trace-config=opentelemetry,resource=service.name={SERVICE_NAME}"]


def test_a_collector_without_a_path_gets_the_otlp_traces_path_and_rate_defaults_to_callers_only():
    for url in ("http://otel-collector:4318", "http://otel-collector:4318/"):
        assert TritonTracing.from_env({pc.ENV_TRACE_OTLP_URL: url}) == \
            TritonTracing("http://otel-collector:4318/v1/traces", 0)


def test_the_command_line_carries_the_tracing():
    from pathlib import Path

    from serving_image.triton.standalone import tritonserver_command

    plain = tritonserver_command(Path("/repo"), "m", http_port=8000, grpc_port=8001, metrics_port=8004)
    assert not any(a.startswith("--trace-config") for a in plain)
    tracing = TritonTracing("http://collector:4318/v1/traces")
    traced = tritonserver_command(Path("/repo"), "m", http_port=8000, grpc_port=8001, metrics_port=8004,
                                  tracing=tracing)
    assert traced == plain + tracing.arguments()


@pytest.mark.parametrize(("env", "named"), [
    ({pc.ENV_TRACE_OTLP_URL: "otel-collector:4318"}, pc.ENV_TRACE_OTLP_URL),
    ({pc.ENV_TRACE_OTLP_URL: "grpc://otel-collector:4317"}, pc.ENV_TRACE_OTLP_URL),
    ({pc.ENV_TRACE_OTLP_URL: "http://otel-collector:99999/v1/traces"}, pc.ENV_TRACE_OTLP_URL),
    ({pc.ENV_TRACE_OTLP_URL: "http://a:4318/v1/traces,b"}, pc.ENV_TRACE_OTLP_URL),
    ({pc.ENV_TRACE_OTLP_URL: "http://a:4318/v1/traces?x=1"}, pc.ENV_TRACE_OTLP_URL),
    ({pc.ENV_TRACE_OTLP_URL: "http://a:4318", pc.ENV_TRACE_RATE: "often"}, pc.ENV_TRACE_RATE),
    ({pc.ENV_TRACE_OTLP_URL: "http://a:4318", pc.ENV_TRACE_RATE: "-1"}, pc.ENV_TRACE_RATE),
    ({pc.ENV_TRACE_RATE: "10"}, pc.ENV_TRACE_RATE),
])
def test_a_wrong_value_is_named(env, named):
    with pytest.raises(TracingConfigError, match=f"^{named}="):
        TritonTracing.from_env(env)


# -- against the real tritonserver --------------------------------------------------------------------------------

GRPC_CALLS = 6  # traced gRPC calls in the join test (see there why more than one)
EXPORT_TIMEOUT_S = 90  # Triton's batch span processor exports every 5 s; generous for a loaded machine


class OtlpReceiver:
    """A minimal OTLP/HTTP traces receiver: keeps every span posted to /v1/traces (Triton posts JSON), and what it
    could not read, so that a test fails naming it rather than timing out."""

    def __init__(self, port: int):
        self.spans: list[dict] = []
        self.problems: list[str] = []
        self.posts = 0
        self._lock = threading.Lock()
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                receiver._receive(self.path, self.headers.get("Content-Type", ""), body)
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", "2")
                self.end_headers()
                self.wfile.write(b"{}")

            def log_message(self, *args):  # quiet: the test reports what it needs
                pass

        self._server = ThreadingHTTPServer(("127.0.0.1", port), Handler)
        self.url = f"http://127.0.0.1:{port}/v1/traces"
        self._thread = threading.Thread(target=self._server.serve_forever, name="otlp-receiver", daemon=True)
        self._thread.start()

    def _receive(self, path: str, content_type: str, body: bytes) -> None:
        with self._lock:
            self.posts += 1
            if path != "/v1/traces" or not content_type.startswith("application/json"):
                self.problems.append(f"POST {path} ({content_type}, {len(body)} bytes)")
                return
            for resource in json.loads(body).get("resourceSpans", []):
                attributes = _attributes(resource.get("resource", {}))
                for scope in resource.get("scopeSpans", []):
                    self.spans += [{**span, "resource": attributes} for span in scope.get("spans", [])]

    def wait_for(self, trace_id: str, names: set[str]) -> dict[str, dict]:
        """The spans of `trace_id` by name, once every one of `names` has arrived (bounded)."""
        return self.wait_for_any([trace_id], names)[1]

    def wait_for_any(self, trace_ids: list[str], names: set[str]) -> tuple[str, dict[str, dict]]:
        """The first of `trace_ids` all of whose `names` have arrived, and its spans by name (bounded)."""
        deadline = time.monotonic() + EXPORT_TIMEOUT_S
        while True:
            with self._lock:
                assert not self.problems, f"the OTLP receiver got what it cannot read: {self.problems}"
                found = {t: {s["name"]: s for s in self.spans if s.get("traceId") == t} for t in trace_ids}
                others = sorted({(s.get("traceId"), s["name"]) for s in self.spans
                                 if s.get("traceId") not in trace_ids})
            for trace_id, spans in found.items():
                if names <= set(spans):
                    return trace_id, spans
            if time.monotonic() >= deadline:
                raise AssertionError(f"Triton exported no trace of {trace_ids} with all of {sorted(names)} in "
                                     f"{EXPORT_TIMEOUT_S}s (got {({t: sorted(f) for t, f in found.items()})}; "
                                     f"spans of other traces: {others}; {self.posts} POSTs)")
            time.sleep(0.2)

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()


def _attributes(holder: dict) -> dict:
    return {a["key"]: next(iter(a["value"].values()), None) for a in holder.get("attributes", [])}


def _events(span: dict) -> list[str]:
    return [e["name"] for e in span.get("events", [])]


@pytest.fixture(scope="module")
def receiver():
    from llm_serving.ports import free_port

    otlp = OtlpReceiver(free_port())
    yield otlp
    otlp.close()


@pytest.fixture(scope="module")
def traced_server(receiver, ranker_packages, tmp_path_factory):
    """tritonserver (the startup procedure, `standalone`) serving the demo ranker, exporting to `receiver`."""
    from bench.local_server import start_standalone_server

    server = start_standalone_server(ranker_packages[0], tmp_path_factory.mktemp("traced") / "work",
                                     extra_env={pc.ENV_TRACE_OTLP_URL: receiver.url})
    yield server
    server.kill()


@pytest.mark.slow
def test_one_trace_id_joins_a_callers_kserve_call_and_tritons_spans(traced_server, receiver):
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    from examples import kserve_client
    from llm_serving.stack_outputs import parse_stack_outputs
    from llm_serving_client import Client, LocalEndpoints
    from tests.serving.client_outputs import RANKER, document

    assert "--trace-config=mode=opentelemetry" in traced_server.log()  # the startup passed it on
    caller_spans = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(caller_spans))
    # No OpenAI port in this mode: the calls below are KServe gRPC only, the OpenAI address is never used.
    local = LocalEndpoints("http://127.0.0.1:9/v1", f"127.0.0.1:{traced_server.ports['kserve_grpc']}")
    client = Client(parse_stack_outputs(document()), local=local, timeout_s=60, tracer_provider=provider)
    try:
        # Several calls, each its own trace: tritonserver 2.51's gRPC endpoint ignores a call's `traceparent` now and
        # then (measured: 11 of 230 calls, none of 30 over
        # HTTP; docs/clients.md), and with rate 0 such a call is not
        # traced at all. One call would make this test fail about once in 20 runs, for Triton's defect.
        for _ in range(GRPC_CALLS):
            scores = client.infer(RANKER, {"features": kserve_client.feature_rows(3)}, version="1.0.0")
            assert len(scores["score"]) == 3
    finally:
        client.close()

    # The stage whose span sent each request: its id is the server's parent.
    networks = {format(s.context.trace_id, "032x"): s for s in caller_spans.get_finished_spans()
                if s.name == "network"}
    assert len(networks) == GRPC_CALLS  # one trace per call
    trace_id, spans = receiver.wait_for_any(list(networks), {"InferRequest", RANKER, "compute"})
    network = networks[trace_id]
    with receiver._lock:  # every call of ours Triton did trace hangs under that call's network stage
        requests = [r for r in receiver.spans if r["name"] == "InferRequest" and r["traceId"] in networks]
    assert all(r["parentSpanId"] == format(networks[r["traceId"]].context.span_id, "016x") for r in requests)
    request, model, compute = spans["InferRequest"], spans[RANKER], spans["compute"]
    # One trace: Triton's request span is a child of the caller's network stage, the model's of the request's.
    assert request["parentSpanId"] == format(network.context.span_id, "016x")
    assert model["parentSpanId"] == request["spanId"] and compute["parentSpanId"] == model["spanId"]
    assert {"GRPC_WAITREAD_END", "GRPC_SEND_START", "GRPC_SEND_END"} <= set(_events(request))
    # The server's stages: the model's queue and its compute, with their timestamps.
    assert _attributes(model)["triton.model_name"] == RANKER
    assert _events(model)[:2] == ["REQUEST_START", "QUEUE_START"] and "REQUEST_END" in _events(model)
    assert {"COMPUTE_START", "COMPUTE_INPUT_END", "COMPUTE_OUTPUT_START", "COMPUTE_END"} <= set(_events(compute))
    assert all(int(e["timeUnixNano"]) > 0 for e in model["events"] + compute["events"])
    assert model["resource"]["service.name"] == SERVICE_NAME


@pytest.mark.slow
def test_a_kserve_http_call_with_a_traceparent_is_traced_under_its_trace_id(traced_server, receiver):
    import tritonclient.http as httpclient

    from examples import kserve_client
    from tests.serving.client_outputs import RANKER

    trace_id, parent = "4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7"
    http = httpclient.InferenceServerClient(f"127.0.0.1:{traced_server.ports['kserve_http']}")
    try:
        rows = kserve_client.feature_rows(2)
        features = httpclient.InferInput("features", list(rows.shape), "FP32")
        features.set_data_from_numpy(rows)
        result = http.infer(RANKER, [features], headers={"traceparent": f"00-{trace_id}-{parent}-01"})
    finally:
        http.close()
    assert len(result.as_numpy("score")) == 2
    spans = receiver.wait_for(trace_id, {"InferRequest", RANKER})
    assert spans["InferRequest"]["parentSpanId"] == parent
    assert {"HTTP_RECV_START", "HTTP_SEND_END"} <= set(_events(spans["InferRequest"]))


@pytest.mark.slow
def test_a_wrong_tracing_variable_stops_startup_naming_it(ranker_packages, tmp_path):
    from bench.local_server import start_standalone_server

    with pytest.raises(AssertionError, match="exited with 14") as failed:
        start_standalone_server(ranker_packages[0], tmp_path / "work",
                                extra_env={pc.ENV_TRACE_OTLP_URL: "http://127.0.0.1:4318", pc.ENV_TRACE_RATE: "often"})
    assert f"{pc.ENV_TRACE_RATE}='often': expected a whole number" in str(failed.value)
