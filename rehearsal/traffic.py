"""Requests to every model through its Service, as a client service would send them, counted and checked. An LLM
(the model's KServe metadata names the input `text_input`, §3.3): KServe v2 gRPC (ServerReady, ModelReady, a streamed
generation on ModelStreamInfer, with NVIDIA's tritonclient), KServe v2 HTTP (health, `generate`) and the OpenAI API
(models, completions, chat). Any other model (a Python-backend model such as the ranker, served by Triton alone):
KServe v2 gRPC (ServerReady, ModelReady, a unary ModelInfer) and HTTP (health, `infer`), with inputs made from its
metadata's declared tensors and every declared output checked in the answer."""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass, field

import httpx

from llm_serving import pod_contract as pc
from llm_serving.kserve_stream import until_final
from rehearsal import secrets


@dataclass
class TrafficResult:
    requests: int = 0
    failed: int = 0
    failures: list[str] = field(default_factory=list)

    def record(self, what: str, ok: bool, detail: str = "") -> None:
        self.requests += 1
        if not ok:
            self.failed += 1
            self.failures.append(f"{what}: {detail}")


async def drive(service: str, address: str, ports: dict[str, int], model_id: str, result: TrafficResult,
                completions: int = 4) -> None:
    """`ports`: the Service's ports by name (the pod contract's names)."""
    timeout = httpx.Timeout(120.0)

    async def call(client: httpx.AsyncClient, what: str, method: str, url: str, **kwargs) -> httpx.Response | None:
        try:
            response = await client.request(method, url, **kwargs)
        except httpx.HTTPError as exc:
            result.record(f"{service} {what}", False, f"{type(exc).__name__}: {exc}")
            return None
        ok = response.status_code == 200
        result.record(f"{service} {what}", ok, "" if ok else f"HTTP {response.status_code}: {response.text[:300]}")
        return response if ok else None

    kserve = f"http://{address}:{ports[pc.KSERVE_HTTP_PORT_NAME]}"
    async with httpx.AsyncClient(timeout=timeout, headers=secrets.auth_headers()) as client:
        metadata = await call(client, "KServe model metadata", "GET", f"{kserve}/v2/models/{model_id}")
        if metadata is None:
            return
        declared = metadata.json()
        if "text_input" not in {t["name"] for t in declared.get("inputs", [])}:
            await _tensor_model(service, address, ports, model_id, declared, result, client, call)
            return
        if pc.KSERVE_GRPC_PORT_NAME in ports:
            await asyncio.to_thread(_grpc, service, f"{address}:{ports[pc.KSERVE_GRPC_PORT_NAME]}", model_id, result)
        await call(client, "KServe ready", "GET", f"{kserve}{pc.READY_PATH}")
        body = {"text_input": "Hello", "exclude_input_in_output": True,
                "sampling_parameters": json.dumps({"max_tokens": 8})}
        generated = await call(client, "KServe generate", "POST", f"{kserve}/v2/models/{model_id}/generate",
                               json=body)
        if generated is not None and "text_output" not in generated.json():
            result.record(f"{service} KServe generate output", False, f"no text_output in {generated.text[:200]}")
        if pc.OPENAI_PORT_NAME not in ports:
            return
        openai = f"http://{address}:{ports[pc.OPENAI_PORT_NAME]}"
        models = await call(client, "OpenAI models", "GET", f"{openai}/v1/models")
        if models is None:
            return
        name = models.json()["data"][0]["id"]
        jobs = [call(client, "OpenAI completion", "POST", f"{openai}/v1/completions",
                     json={"model": name, "prompt": f"Request {i}:", "max_tokens": 16})
                for i in range(completions)]
        jobs.append(call(client, "OpenAI chat", "POST", f"{openai}/v1/chat/completions",
                         json={"model": name, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 8}))
        await asyncio.gather(*jobs)


_NUMPY = {"FP32": "float32", "FP64": "float64", "FP16": "float16", "INT8": "int8", "INT16": "int16",
          "INT32": "int32", "INT64": "int64", "UINT8": "uint8", "UINT32": "uint32", "UINT64": "uint64", "BOOL": "bool"}


def example_inputs(declared: dict, rows: int = 3) -> dict[str, object]:
    """Arrays for a model's declared inputs (its KServe metadata): a variable dimension (-1, the batch) as `rows`,
    numeric values in [0, 1), fixed. BYTES inputs and other types cannot be made up: ValueError, naming the input."""
    import numpy as np

    rng = np.random.default_rng(17)
    arrays = {}
    for tensor in declared.get("inputs", []):
        if tensor["datatype"] not in _NUMPY:
            raise ValueError(f"input {tensor['name']!r} is {tensor['datatype']}: the rehearsal makes up numeric "
                             "inputs only")
        shape = [rows if int(d) < 0 else int(d) for d in tensor["shape"]]
        arrays[tensor["name"]] = rng.random(shape).astype(_NUMPY[tensor["datatype"]])
    return arrays


async def _tensor_model(service: str, address: str, ports: dict[str, int], model_id: str, declared: dict,
                        result: TrafficResult, client: httpx.AsyncClient, call) -> None:
    """A model that is not an LLM: a unary infer over gRPC and HTTP with its declared inputs; every declared output
    must be in the answer."""
    try:
        arrays = example_inputs(declared)
    except ValueError as exc:
        result.record(f"{service} KServe infer", False, str(exc))
        return
    outputs = [t["name"] for t in declared.get("outputs", [])]
    if pc.KSERVE_GRPC_PORT_NAME in ports:
        await asyncio.to_thread(_grpc_infer, service, f"{address}:{ports[pc.KSERVE_GRPC_PORT_NAME]}", model_id,
                                arrays, outputs, result)
    kserve = f"http://{address}:{ports[pc.KSERVE_HTTP_PORT_NAME]}"
    await call(client, "KServe ready", "GET", f"{kserve}{pc.READY_PATH}")
    body = {"inputs": [{"name": name, "shape": list(a.shape), "datatype": t["datatype"], "data": a.ravel().tolist()}
                       for (name, a), t in zip(arrays.items(), declared["inputs"], strict=True)]}
    answer = await call(client, "KServe infer", "POST", f"{kserve}/v2/models/{model_id}/infer", json=body)
    if answer is not None:
        missing = sorted(set(outputs) - {o["name"] for o in answer.json().get("outputs", [])})
        if missing:
            result.record(f"{service} KServe infer outputs", False, f"declared outputs {missing} not in the answer")


def _grpc_infer(service: str, url: str, model_id: str, arrays: dict, outputs: list[str],
                result: TrafficResult) -> None:
    import tritonclient.grpc as grpcclient
    from tritonclient.utils import InferenceServerException, np_to_triton_dtype

    client = grpcclient.InferenceServerClient(url)
    try:
        headers = secrets.auth_headers()
        for what, probe in (("KServe gRPC ServerReady", lambda: client.is_server_ready(headers=headers)),
                            ("KServe gRPC ModelReady", lambda: client.is_model_ready(model_id, headers=headers))):
            try:
                ok = bool(probe())
                result.record(f"{service} {what}", ok, "" if ok else "answered not ready")
            except InferenceServerException as exc:
                result.record(f"{service} {what}", False, str(exc))
        inputs = []
        for name, array in arrays.items():
            tensor = grpcclient.InferInput(name, list(array.shape), np_to_triton_dtype(array.dtype))
            tensor.set_data_from_numpy(array)
            inputs.append(tensor)
        try:
            answer = client.infer(model_id, inputs, headers=headers)
        except InferenceServerException as exc:
            result.record(f"{service} KServe gRPC ModelInfer", False, str(exc))
            return
        missing = [name for name in outputs if answer.as_numpy(name) is None]
        result.record(f"{service} KServe gRPC ModelInfer", not missing,
                      f"declared outputs {missing} not in the answer" if missing else "")
    finally:
        client.close()


def _grpc(service: str, url: str, model_id: str, result: TrafficResult) -> None:
    import tritonclient.grpc as grpcclient
    from tritonclient.utils import InferenceServerException

    client = grpcclient.InferenceServerClient(url)
    try:
        headers = secrets.auth_headers()
        for what, call in (("KServe gRPC ServerReady", lambda: client.is_server_ready(headers=headers)),
                           ("KServe gRPC ModelReady", lambda: client.is_model_ready(model_id, headers=headers))):
            try:
                ok = bool(call())
                result.record(f"{service} {what}", ok, "" if ok else "answered not ready")
            except InferenceServerException as exc:
                result.record(f"{service} {what}", False, str(exc))
        result.record(f"{service} KServe gRPC ModelStreamInfer", *_stream_generate(client, grpcclient, model_id))
    finally:
        client.close()


def _stream_generate(client, grpcclient, model_id: str) -> tuple[bool, str]:
    """One streamed generation (§3.3's tensors) on ModelStreamInfer: (ok, why not)."""
    import queue

    import numpy as np

    def tensor(name: str, dtype: str, value) -> object:
        t = grpcclient.InferInput(name, [1], dtype)
        t.set_data_from_numpy(np.array([value], dtype=np.object_ if dtype == "BYTES" else bool))
        return t

    got: queue.Queue = queue.Queue()
    client.start_stream(callback=lambda result, error: got.put((result, error)), headers=secrets.auth_headers())
    try:
        client.async_stream_infer(model_id, [tensor("text_input", "BYTES", b"Hello"), tensor("stream", "BOOL", True),
                                             tensor("sampling_parameters", "BYTES",
                                                    json.dumps({"max_tokens": 8}).encode())],
                                  request_id="rehearsal", enable_empty_final_response=True)
        texts = []
        for result, error in until_final(got, timeout=60):
            if error is not None:
                return False, str(error)
            output = result.as_numpy("text_output")
            if output is not None:
                texts += [o.decode(errors="replace") for o in output.ravel()]
        return (bool(texts), "" if texts else "no text_output in the stream")
    except queue.Empty:
        return False, "no response within 60 s"
    finally:
        client.stop_stream()
