"""Requests to every model through its Service, as a client service would send them, counted and checked:
KServe v2 gRPC (ServerReady, ModelReady, a streamed generation on ModelStreamInfer, with NVIDIA's tritonclient),
KServe v2 HTTP (health, `generate`) and the OpenAI API (models, completions, chat)."""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass, field

import httpx

from llm_serving import pod_contract as pc


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

    if pc.KSERVE_GRPC_PORT_NAME in ports:
        await asyncio.to_thread(_grpc, service, f"{address}:{ports[pc.KSERVE_GRPC_PORT_NAME]}", model_id, result)
    kserve = f"http://{address}:{ports[pc.KSERVE_HTTP_PORT_NAME]}"
    async with httpx.AsyncClient(timeout=timeout) as client:
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


def _grpc(service: str, url: str, model_id: str, result: TrafficResult) -> None:
    import tritonclient.grpc as grpcclient
    from tritonclient.utils import InferenceServerException

    client = grpcclient.InferenceServerClient(url)
    try:
        for what, call in (("KServe gRPC ServerReady", client.is_server_ready),
                           ("KServe gRPC ModelReady", lambda: client.is_model_ready(model_id))):
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
    client.start_stream(callback=lambda result, error: got.put((result, error)))
    try:
        client.async_stream_infer(model_id, [tensor("text_input", "BYTES", b"Hello"), tensor("stream", "BOOL", True),
                                             tensor("sampling_parameters", "BYTES",
                                                    json.dumps({"max_tokens": 8}).encode())],
                                  request_id="rehearsal", enable_empty_final_response=True)
        texts = []
        while True:
            result, error = got.get(timeout=60)
            if error is not None:
                return False, str(error)
            output = result.as_numpy("text_output")
            if output is not None:
                texts += [o.decode(errors="replace") for o in output.ravel()]
            if result.get_response().parameters["triton_final_response"].bool_param:
                break
        return (bool(texts), "" if texts else "no text_output in the stream")
    except queue.Empty:
        return False, "no response within 60 s"
    finally:
        client.stop_stream()
