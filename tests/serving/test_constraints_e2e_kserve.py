"""Constraints through KServe v2 end to end: `sampling_parameters.constraint` on ModelStreamInfer (gRPC, NVIDIA's
`tritonclient`) and on the HTTP generate endpoint, served by the local KServe front-ends over the real vLLM engine
(the constraint processor loaded from its entry point). Concurrent requests of all three kinds; a malformed
constraint is INVALID_ARGUMENT / 400 naming the field.

The specs use whole-word tokens, none a prefix of another, so each output text maps back to one token sequence,
which the pure-Python reference checks.
"""

from __future__ import annotations

import asyncio
import json
import socket

import httpx
import numpy as np
import pytest
import pytest_asyncio
import tritonclient.grpc.aio as grpcaio

from serving_image.constraints.reference import satisfies
from serving_image.constraints.spec import validate_constraint

pytestmark = [pytest.mark.slow, pytest.mark.asyncio(loop_scope="module")]

ENGINE_ARGS = {"max_model_len": 512, "kv_cache_memory_bytes": 128 * 1024 * 1024, "enforce_eager": True,
               "dtype": "float32"}
N_REQUESTS = 48


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def servers(demo_model_dir):
    from serving_image.engine.vllm_local import VllmLocalEngine
    from serving_image.kserve.frontends import start_kserve
    from serving_image.metrics.frontend import FrontendMetrics

    engine = await VllmLocalEngine.start(name="demo-tiny", version="1.0.0", model_path=demo_model_dir,
                                         tokenizer_path=demo_model_dir, args=dict(ENGINE_ARGS))
    grpc_port, http_port = _free_port(), _free_port()
    running = await start_kserve(engine, FrontendMetrics(), host="127.0.0.1", grpc_port=grpc_port,
                                 http_port=http_port)
    try:
        yield engine, f"127.0.0.1:{grpc_port}", f"127.0.0.1:{http_port}"
    finally:
        await running.stop()
        await engine.shutdown()


@pytest.fixture(scope="module")
def words(servers) -> dict[int, str]:
    engine = servers[0]
    cands = {i: engine.decode([i]) for i in range(engine.info.vocab_size)}
    cands = {i: s for i, s in cands.items() if s.startswith(" ") and s[1:].isalpha() and len(s) > 3}
    texts = list(cands.values())
    return {i: s for i, s in cands.items() if not any(o != s and o.startswith(s) for o in texts)}


def specs(words: dict[int, str]) -> list[dict]:
    w = sorted(words)[:12]
    return [
        {"kind": "choice_sequence", "choices": [[w[0], w[1]], [w[2]], [w[3], w[4], w[5]], [w[6]]],
         "separator": [w[7]], "min_items": 1, "max_items": 3, "unique": True},
        {"kind": "token_dfa", "start": 0, "accept": [2],
         "edges": [[0, w[8], 1], [1, w[9], 2], [2, w[10], 0], [1, w[11], 1]]},
        {"kind": "allowed_tokens", "tokens": [w[0], w[3], w[6], w[9]]},
    ]


def check(spec: dict, text: str, finish_reason: str, words: dict[int, str], eos: int) -> None:
    by_text = {s: i for i, s in words.items()}
    tokens, at = [], 0
    while at < len(text):
        match = [s for s in by_text if text.startswith(s, at)]
        assert len(match) == 1, f"text {text!r} is not a sequence of the constraint's words (at {at})"
        tokens.append(by_text[match[0]])
        at += len(match[0])
    problem = satisfies(validate_constraint(spec, None, None), eos, tokens, finished_by_eos=finish_reason == "stop")
    assert problem is None, f"{spec['kind']}: {problem} (text {text!r}, finish {finish_reason})"


def _inputs(prompt: str, params: dict) -> list:
    text = grpcaio.InferInput("text_input", [1], "BYTES")
    text.set_data_from_numpy(np.array([prompt.encode()], dtype=np.object_))
    sp = grpcaio.InferInput("sampling_parameters", [1], "BYTES")
    sp.set_data_from_numpy(np.array([json.dumps(params).encode()], dtype=np.object_))
    ex = grpcaio.InferInput("exclude_input_in_output", [1], "BOOL")
    ex.set_data_from_numpy(np.array([True], dtype=bool))
    return [text, sp, ex]


async def _generate(url: str, model: str, prompt: str, params: dict, request_id: str):
    """One request on its own ModelStreamInfer stream: (text, finish_reason) or the error."""
    client = grpcaio.InferenceServerClient(url)

    async def requests():
        yield {"model_name": model, "inputs": _inputs(prompt, params), "request_id": request_id}

    try:
        async for result, error in client.stream_infer(requests()):
            if error is not None:
                return error
            response = result.get_response()
            if response.parameters["triton_final_response"].bool_param:
                return (result.as_numpy("text_output")[0].decode(), result.as_numpy("finish_reason")[0].decode())
    finally:
        await client.close()
    raise AssertionError("the stream ended without a final response")


async def test_concurrent_constrained_streams_satisfy_their_constraints(servers, words):
    engine, grpc_url, _ = servers
    all_specs = specs(words)
    results = await asyncio.gather(*(
        _generate(grpc_url, engine.info.name, f"Request {i}: name a few things",
                  {"max_tokens": 40, "temperature": 1.0, "constraint": all_specs[i % 3]}, f"r{i}")
        for i in range(N_REQUESTS)))
    for i, result in enumerate(results):
        assert isinstance(result, tuple), result
        check(all_specs[i % 3], *result, words, engine.info.eos_token_id)
    assert any(finish == "stop" for i, (_, finish) in enumerate(results) if i % 3 == 0)


async def test_http_generate_respects_the_constraint(servers, words):
    engine, _, http_url = servers
    spec = specs(words)[1]
    async with httpx.AsyncClient(base_url=f"http://{http_url}", timeout=120) as client:
        response = await client.post(f"/v2/models/{engine.info.name}/generate", json={
            "text_input": "generate", "exclude_input_in_output": True,
            "sampling_parameters": json.dumps({"max_tokens": 30, "constraint": spec})})
    assert response.status_code == 200, response.text
    body = response.json()
    check(spec, body["text_output"], body["finish_reason"], words, engine.info.eos_token_id)


@pytest.mark.parametrize(
    ("constraint", "field", "message"),
    [
        ({"kind": "token_dfa", "start": 0, "accept": [1], "edges": [[0, 5, 1], [1, 6, 1], [1, 7, 0], [0, 99999, 1]]},
         "sampling_parameters.constraint.edges[3][1]", "token id 99999 is outside the vocabulary"),
        ({"kind": "choice_sequence", "choices": [[5], [5]], "separator": [3]},
         "sampling_parameters.constraint.choices[1]", "duplicates constraint.choices[0]"),
    ],
)
async def test_malformed_constraint_is_refused_naming_the_field(servers, constraint, field, message):
    engine, grpc_url, http_url = servers
    error = await _generate(grpc_url, engine.info.name, "x", {"max_tokens": 4, "constraint": constraint}, "bad")
    assert not isinstance(error, tuple)
    assert field in str(error) and message in str(error), str(error)
    async with httpx.AsyncClient(base_url=f"http://{http_url}", timeout=60) as client:
        response = await client.post(f"/v2/models/{engine.info.name}/generate", json={
            "text_input": "x", "sampling_parameters": json.dumps({"max_tokens": 4, "constraint": constraint})})
    assert response.status_code == 400 and field in response.text, response.text
