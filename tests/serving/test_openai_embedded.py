"""The `openai` serving mode over Triton embedded in the front-end's process (issue 14): the real entrypoint with
`LLM_SERVING_OPENAI_ENGINE=triton` (locally an explicit option until the whole OpenAI suite passes against it; the
image always embeds Triton), the local libtritonserver (2.51) loaded through the project's C API binding, the
stand-in `vllm` backend and its engine process. Driven by the official `openai` client and NVIDIA's tritonclient.

One server for the module; the last test drains it with SIGTERM.
"""

from __future__ import annotations

import json
import queue
import signal
import socket
import time
from pathlib import Path

import httpx
import jsonschema
import numpy as np
import openai
import psutil
import pytest
import tritonclient.grpc as grpcclient
from transformers import AutoTokenizer

from serving_image.local_server import ENGINE_ARGS, Server, publish_demo, start_server
from tests.serving.engine_hold import EngineProcesses

pytestmark = pytest.mark.slow

MODEL = "demo-tiny"
DRAIN_DELAY_S = 10
SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}, "label": {"type": "string", "maxLength": 10}},
          "required": ["ok", "label"], "additionalProperties": False}


@pytest.fixture(scope="module")
def server(demo_model_dir: Path, tmp_path_factory) -> Server:
    root = tmp_path_factory.mktemp("openai-embedded")
    # eager: no graph compilation at start (it dominates the engine's start on 2 cores, and make test's total time)
    package = publish_demo(demo_model_dir, root, engine_args={**ENGINE_ARGS, "enforce_eager": True})
    srv = start_server(package, root / "server", extra_env={"LLM_SERVING_OPENAI_ENGINE": "triton",
                                                            "LLM_SERVING_DRAIN_DELAY_S": str(DRAIN_DELAY_S)})
    yield srv
    srv.kill()


@pytest.fixture(scope="module")
def client(server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def tokenizer(demo_model_dir: Path):
    return AutoTokenizer.from_pretrained(str(demo_model_dir))


def _listening_pids(port: int) -> set[int]:
    return {c.pid for c in psutil.net_connections("tcp") if c.status == psutil.CONN_LISTEN and c.laddr.port == port}


def test_one_process_holds_libtritonserver_and_every_port(server):
    pid = server.proc.pid  # re-executed in place (same pid) with libtritonserver's folder on LD_LIBRARY_PATH
    maps = Path(f"/proc/{pid}/maps").read_text()
    assert "libtritonserver" in maps
    for name in ("openai", "kserve_grpc", "kserve_http", "metrics"):
        assert _listening_pids(server.ports[name]) == {pid}, name
    assert "Triton 2.51.0 (local) embedded in this process, ready" in server.log()
    # started with libtritonserver's dependency folder on the loader's path (re-executed with it, unless inherited)
    from serving_image.triton.local_install import locate

    environ = dict(item.split("=", 1) for item in Path(f"/proc/{pid}/environ").read_text().split("\0") if "=" in item)
    assert str(locate().library_dir) in environ.get("LD_LIBRARY_PATH", "").split(":")


def test_completion_and_streamed_chat(client, server):
    completion = client.completions.create(model=MODEL, prompt="The platform serves", max_tokens=5, temperature=0)
    assert completion.choices[0].finish_reason == "length" and completion.usage.completion_tokens == 5
    assert completion.usage.prompt_tokens > 0
    again = client.completions.create(model=MODEL, prompt="The platform serves", max_tokens=5, temperature=0)
    assert again.choices[0].text == completion.choices[0].text
    chunks = list(client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}],
                                                 max_tokens=6, temperature=0, stream=True,
                                                 stream_options={"include_usage": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finish == ["length"] and chunks[-1].usage.completion_tokens == 6
    whole = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=6,
                                           temperature=0)
    assert whole.choices[0].message.content == text


def test_response_format_reaches_the_backend_as_structured_outputs(client):
    """Never silently dropped: even the random demo model produces schema-valid JSON."""
    response = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "json please"}], max_tokens=60, temperature=1.0,
        response_format={"type": "json_schema", "json_schema": {"name": "r", "schema": SCHEMA}})
    jsonschema.validate(json.loads(response.choices[0].message.content), SCHEMA)
    choice = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "pick"}],
                                            max_tokens=20, extra_body={"structured_outputs": {"choice": ["red",
                                                                                                         "blue"]}})
    assert choice.choices[0].message.content in ("red", "blue")


def test_constraint_extension(client, tokenizer):
    allowed = [tokenizer.convert_tokens_to_ids(t) for t in ("a", "b")]
    response = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "constrained"}],
                                              max_tokens=30, temperature=1.0,
                                              extra_body={"constraint": {"kind": "allowed_tokens", "tokens": allowed}})
    assert set(response.choices[0].message.content) <= {"a", "b"}
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "bad"}],
                                       extra_body={"constraint": {"kind": "token_dfa", "start": 0, "accept": [1],
                                                                  "edges": [[0, 999999, 1]]}})
    assert info.value.body["param"].startswith("constraint.edges[0]")


def test_errors_name_the_field(client):
    with pytest.raises(openai.BadRequestError) as too_long:
        client.completions.create(model=MODEL, prompt="hello", max_tokens=100000)
    assert too_long.value.body["param"] == "max_tokens"
    with pytest.raises(openai.BadRequestError) as logprobs:
        client.completions.create(model=MODEL, prompt="hello", max_tokens=2, logprobs=2)
    assert logprobs.value.body["param"] == "logprobs"  # token log-probabilities do not cross Triton's tensors


def _nv_count(server: Server) -> float:
    text = httpx.get(server.metrics_url, timeout=30).text
    line = next(x for x in text.splitlines() if x.startswith("nv_inference_count{") and f'model="{MODEL}"' in x)
    return float(line.rsplit(" ", 1)[1])


def test_openai_requests_are_counted_by_triton_on_8002(client, server):
    before = _nv_count(server)
    client.completions.create(model=MODEL, prompt="count me", max_tokens=2)
    assert _nv_count(server) == before + 1
    text = httpx.get(server.metrics_url, timeout=30).text
    assert "# TYPE nv_inference_request_success counter" in text  # Triton's own families, from its C API
    assert "vllm:generation_tokens" in text  # and vLLM's, from the stand-in engine's multiprocess files
    assert "llm_serving_metrics_upstream_up 1" in text


def test_tritonclient_streams_from_the_same_instance(server):
    url = f"127.0.0.1:{server.ports['kserve_grpc']}"
    client = grpcclient.InferenceServerClient(url)
    try:
        assert client.is_server_ready() and client.is_model_ready(MODEL)
        inputs = []
        for name, value, dtype in (("text_input", b"Say hello", "BYTES"), ("stream", True, "BOOL"),
                                   ("sampling_parameters", json.dumps({"max_tokens": 4}).encode(), "BYTES"),
                                   ("return_num_output_tokens", True, "BOOL")):
            item = grpcclient.InferInput(name, [1], dtype)
            item.set_data_from_numpy(np.array([value], dtype=np.object_ if dtype == "BYTES" else np.bool_))
            inputs.append(item)
        responses: queue.Queue = queue.Queue()
        client.start_stream(callback=lambda result, error: responses.put((result, error)))
        client.async_stream_infer(MODEL, inputs, request_id="kserve-1", enable_empty_final_response=True)
        tokens = 0
        while True:
            result, error = responses.get(timeout=120)
            assert error is None, error
            if result.get_response().outputs:
                tokens += int(result.as_numpy("num_output_tokens").sum())
            if result.get_response().parameters["triton_final_response"].bool_param:
                break
        client.stop_stream()
        assert tokens == 4
    finally:
        client.close()


def test_kserve_grpc_is_triton_itself(server):
    """8001 answers from the embedded Triton through its C API: Triton's metadata, configuration after the
    backend's auto-complete, repository index, statistics, and Triton's own refusals and error messages."""
    from tritonclient.utils import InferenceServerException

    client = grpcclient.InferenceServerClient(f"127.0.0.1:{server.ports['kserve_grpc']}")
    try:
        metadata = client.get_server_metadata()
        assert (metadata.name, metadata.version) == ("triton", "2.51.0")
        config = client.get_model_config(MODEL, as_json=True)["config"]
        assert config["backend"] == "vllm" and config["model_transaction_policy"] == {"decoupled": True}
        assert config["input"][0]["name"] == "text_input"
        index = client.get_model_repository_index(as_json=True)["models"]
        assert [(m["name"], m["state"]) for m in index] == [(MODEL, "READY")]
        assert client.get_model_metadata(MODEL).versions == ["1"]
        text = grpcclient.InferInput("text_input", [1], "BYTES")
        text.set_data_from_numpy(np.array([b"hello"], dtype=np.object_))
        with pytest.raises(InferenceServerException) as unary:
            client.infer(MODEL, [text])
        assert "doesn't support models with decoupled transaction policy" in unary.value.message()
        with pytest.raises(InferenceServerException) as unknown:
            client.get_model_metadata("no-such-model")
        assert "no-such-model" in unknown.value.message()
        stats = client.get_inference_statistics(MODEL, as_json=True)["model_stats"][0]
        assert int(stats["inference_count"]) > 0  # the OpenAI requests of the tests above, counted by Triton

        errors: queue.Queue = queue.Queue()
        client.start_stream(callback=lambda result, error: errors.put((result, error)))
        params = grpcclient.InferInput("sampling_parameters", [1], "BYTES")
        params.set_data_from_numpy(np.array([json.dumps({"max_tokens": "many"}).encode()], dtype=np.object_))
        client.async_stream_infer(MODEL, [text, params], request_id="bad-1")
        result, error = errors.get(timeout=120)
        client.stop_stream()
        assert result is None and "sampling_parameters.max_tokens" in error.message()
        assert client.is_server_ready()  # a bad request leaves the server ready
    finally:
        client.close()


def test_kserve_http_is_triton_itself(server):
    base = f"http://127.0.0.1:{server.ports['kserve_http']}"
    assert httpx.get(f"{base}/v2/health/ready", timeout=30).status_code == 200
    assert httpx.get(f"{base}/v2", timeout=30).json()["version"] == "2.51.0"
    assert httpx.get(f"{base}/v2/models/{MODEL}/config", timeout=30).json()["backend"] == "vllm"
    assert httpx.get(f"{base}/v2/models/nope/ready", timeout=30).status_code == 400
    assert httpx.get(f"{base}/v2/models/nope", timeout=30).status_code == 404
    unary = httpx.post(f"{base}/v2/models/{MODEL}/infer", json={"inputs": []}, timeout=30)
    assert unary.status_code == 501 and "decoupled transaction policy" in unary.json()["error"]
    # Triton's (and NVIDIA's backend's) outputs: text_output, and only the extra outputs asked for
    one = httpx.post(f"{base}/v2/models/{MODEL}/generate", timeout=120, json={
        "text_input": "Say hello", "exclude_input_in_output": True, "return_num_output_tokens": True,
        "parameters": {"max_tokens": 3, "ignore_eos": True}}).json()
    assert one["num_output_tokens"] == 3 and isinstance(one["text_output"], str) and "finish_reason" not in one
    events = httpx.post(f"{base}/v2/models/{MODEL}/generate_stream", timeout=120, json={
        "text_input": "Say hello", "stream": True, "return_num_output_tokens": True,
        "sampling_parameters": json.dumps({"max_tokens": 4, "ignore_eos": True})}).text
    data = [json.loads(line[len("data: "):]) for line in events.splitlines() if line.startswith("data: ")]
    assert sum(d["num_output_tokens"] for d in data) == 4 and not any("error" in d for d in data)
    bad = httpx.post(f"{base}/v2/models/{MODEL}/generate", timeout=120, json={
        "text_input": "x", "sampling_parameters": json.dumps({"max_tokens": "many"})})
    assert bad.status_code == 400 and "sampling_parameters.max_tokens" in bad.json()["error"]
    unknown = httpx.post(f"{base}/v2/models/{MODEL}/generate", timeout=120, json={"text_input": "x", "colour": 1})
    assert unknown.status_code == 400 and "'colour'" in unknown.json()["error"]


def _vllm_processes(server: Server) -> EngineProcesses:
    """vLLM's processes under the stand-in's engine host (a grandchild of the server, through the backend stub)."""
    for proc in psutil.Process(server.proc.pid).children(recursive=True):
        if "serving_image.triton.engine_host" in " ".join(proc.cmdline()):
            return EngineProcesses(tuple(c.pid for c in proc.children(recursive=True)
                                         if "resource_tracker" not in " ".join(c.cmdline())))
    raise AssertionError("no stand-in engine host under the server")


def test_client_that_leaves_aborts_its_request_in_the_engine(server):
    """The request reaches the engine, which is held, so it is still there when the client disconnects, whatever
    the machine's speed; the front-end cancels it in Triton, whose backend aborts it in the engine."""
    engine = _vllm_processes(server)
    log_start = len(server.log())
    body = json.dumps({"model": MODEL, "prompt": "long", "max_tokens": 400, "ignore_eos": True, "stream": True})
    request = (f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
               f"Content-Length: {len(body)}\r\n\r\n{body}").encode()
    with engine.held():
        sock = socket.create_connection(("127.0.0.1", server.ports["openai"]), timeout=30)
        sock.sendall(request)
        deadline = time.monotonic() + 60
        while "submitted to the engine" not in server.log()[log_start:]:
            assert time.monotonic() < deadline, f"the request never reached the engine:\n{server.log()[-3000:]}"
            time.sleep(0.05)
        sock.close()
        while "aborted in the engine (its client cancelled it)" not in server.log()[log_start:]:
            assert time.monotonic() < deadline, f"no abort in the engine:\n{server.log()[-3000:]}"
            time.sleep(0.05)
    def records() -> list[dict]:
        return [json.loads(line.split("llm_serving.requests: ", 1)[1])
                for line in server.log()[log_start:].splitlines() if "llm_serving.requests: " in line]

    while not records():  # the front-end logs the request once its scope is released
        assert time.monotonic() < deadline, f"no request record:\n{server.log()[-3000:]}"
        time.sleep(0.05)
    assert [r["status"] for r in records()] == [499], records()  # logged as the client's departure
    assert httpx.get(f"{server.url}/health/ready", timeout=30).status_code == 200


def test_sigterm_drains_then_stops_triton_and_exits_zero(server):
    server.proc.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + DRAIN_DELAY_S
    while httpx.get(f"{server.url}/health/ready", timeout=30).status_code != 503:
        assert time.monotonic() < deadline, "readiness did not turn false"
        time.sleep(0.05)
    assert server.proc.wait(timeout=120) == 0
    log = server.log()
    assert "successfully unloaded 'demo-tiny'" in log  # Triton stopped: the model unloaded, its engine stopped
    assert "Traceback" not in log
