"""Constraints through both client APIs end to end, on one real server (the suite's shared `openai_server`,
tests/serving/conftest.py): the startup procedure (the image's entrypoint) over the real vLLM engine, with the
constraint processor loaded from its entry point.

- OpenAI (`constraint` in `extra_body`, the official `openai` client): concurrent completions and chats of all
  three kinds, streaming, and 400s that name the field;
- KServe v2 (`sampling_parameters.extra_args.constraint`: the backend hands `sampling_parameters` to vLLM's
  SamplingParams, whose `extra_args` is where the constraint processor reads it): concurrent ModelStreamInfer streams
  (NVIDIA's `tritonclient`), the HTTP generate endpoint, and errors naming the field; a top-level
  `sampling_parameters.constraint` is refused, saying where it goes (never dropped).

The specs use whole-word tokens, none a prefix of another, so an output text maps back to exactly one token
sequence, which the pure-Python reference then checks.
"""

from __future__ import annotations

import asyncio
import json
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import numpy as np
import openai
import pytest
import tritonclient.grpc.aio as grpcaio

from llm_serving.kserve_stream import is_final
from serving_image.constraints.reference import satisfies
from serving_image.constraints.spec import validate_constraint

pytestmark = pytest.mark.slow

MODEL = "demo-tiny"
N_REQUESTS = 48


@pytest.fixture(scope="module")
def server(openai_server):
    return openai_server


@pytest.fixture(scope="module")
def client(openai_client) -> openai.OpenAI:
    return openai_client


@pytest.fixture(scope="module")
def tokenizer(demo_model_dir: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(demo_model_dir))


@pytest.fixture(scope="module")
def words(tokenizer) -> dict[int, str]:
    """Token id -> text for whole-word tokens, none a prefix of another (so text parses back uniquely)."""
    cands = {i: tokenizer.decode([i]) for i in range(len(tokenizer))}
    cands = {i: s for i, s in cands.items() if s.startswith(" ") and s[1:].isalpha() and len(s) > 3}
    texts = list(cands.values())
    return {i: s for i, s in cands.items() if not any(o != s and o.startswith(s) for o in texts)}


def specs(words: dict[int, str]) -> list[dict]:
    w = sorted(words)[:12]
    return [
        {"kind": "choice_sequence", "choices": [[w[0], w[1]], [w[2]], [w[3], w[4], w[5]], [w[6]]],
         "separator": [w[7]], "min_items": 2, "max_items": 3, "unique": True},
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
    # may be empty: eos first is allowed by allowed_tokens (the reference decides)
    problem = satisfies(validate_constraint(spec, None, None), eos, tokens, finished_by_eos=finish_reason == "stop")
    assert problem is None, f"{spec['kind']}: {problem} (text {text!r}, finish {finish_reason})"


BAD = [
    ({"kind": "token_dfa", "start": 0, "accept": [1], "edges": [[0, 5, 1], [1, 6, 1], [1, 7, 0], [0, 99999, 1]]},
     "constraint.edges[3][1]", "token id 99999 is outside the vocabulary (0..623)"),
    ({"kind": "choice_sequence", "choices": [[5]], "separator": [5]}, "constraint.separator[0]",
     "also appears in constraint.choices[0]"),
    ({"kind": "choice_sequence", "choices": [[5], [5]], "separator": [3]}, "constraint.choices[1]",
     "duplicates constraint.choices[0]"),
    ({"kind": "allowed_tokens", "tokens": [1, "x"]}, "constraint.tokens[1]", "must be an integer"),
    ({"kind": "regex"}, "constraint.kind", "must be one of"),
]


# -- OpenAI ----------------------------------------------------------------------------------------------------------


def test_openai_concurrent_completions_and_chats_satisfy_their_constraints(client, words, tokenizer):
    all_specs = specs(words)

    def one(i: int):
        spec = all_specs[i % 3]
        if i % 2:
            r = client.completions.create(model=MODEL, prompt=f"Request {i}: list a few things", max_tokens=40,
                                          extra_body={"constraint": spec})
            return spec, r.choices[0].text, r.choices[0].finish_reason
        r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": f"Say {i}"}],
                                           max_tokens=40, extra_body={"constraint": spec})
        return spec, r.choices[0].message.content, r.choices[0].finish_reason

    with ThreadPoolExecutor(24) as pool:
        results = list(pool.map(one, range(N_REQUESTS)))
    for spec, text, finish in results:
        check(spec, text, finish, words, tokenizer.eos_token_id)
    # the unique choice sequence ends by itself (at most 3 items, then only eos)
    assert any(finish == "stop" for spec, _, finish in results if spec["kind"] == "choice_sequence")


def test_openai_streaming_respects_the_constraint(client, words, tokenizer):
    spec = specs(words)[0]
    stream = client.completions.create(model=MODEL, prompt="stream", max_tokens=40, stream=True,
                                       extra_body={"constraint": spec})
    text, finish = "", None
    for chunk in stream:
        if chunk.choices:
            text += chunk.choices[0].text
            finish = chunk.choices[0].finish_reason or finish
    check(spec, text, finish, words, tokenizer.eos_token_id)


@pytest.mark.parametrize(("constraint", "field", "message"), BAD)
def test_openai_malformed_constraint_is_a_400_naming_the_field(client, constraint, field, message):
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model=MODEL, prompt="x", max_tokens=4, extra_body={"constraint": constraint})
    assert err.value.status_code == 400
    assert field in str(err.value) and message in str(err.value)


# -- KServe v2 -------------------------------------------------------------------------------------------------------


def _inputs(prompt: str, params: dict) -> list:
    text = grpcaio.InferInput("text_input", [1], "BYTES")
    text.set_data_from_numpy(np.array([prompt.encode()], dtype=np.object_))
    sp = grpcaio.InferInput("sampling_parameters", [1], "BYTES")
    sp.set_data_from_numpy(np.array([json.dumps(params).encode()], dtype=np.object_))
    ex = grpcaio.InferInput("exclude_input_in_output", [1], "BOOL")
    ex.set_data_from_numpy(np.array([True], dtype=bool))
    # Triton's backends send finish_reason only when asked (docs/kserve.md, "Outputs beyond text_output").
    finish = grpcaio.InferInput("return_finish_reason", [1], "BOOL")
    finish.set_data_from_numpy(np.array([True], dtype=bool))
    return [text, sp, ex, finish]


async def _generate(url: str, prompt: str, params: dict, request_id: str):
    """One request on its own ModelStreamInfer stream: (text, finish_reason), or the error."""
    client = grpcaio.InferenceServerClient(url)

    async def requests():
        yield {"model_name": MODEL, "inputs": _inputs(prompt, params), "request_id": request_id}

    try:
        async for result, error in client.stream_infer(requests()):
            if error is not None:
                return error
            if is_final(result):
                return result.as_numpy("text_output")[0].decode(), result.as_numpy("finish_reason")[0].decode()
    finally:
        await client.close()
    raise AssertionError("the stream ended without a final response")


async def test_kserve_concurrent_streams_satisfy_their_constraints(server, words, tokenizer):
    grpc_url = f"127.0.0.1:{server.ports['kserve_grpc']}"
    all_specs = specs(words)
    results = await asyncio.gather(*(
        _generate(grpc_url, f"Request {i}: name a few things",
                  {"max_tokens": 40, "temperature": 1.0, "extra_args": {"constraint": all_specs[i % 3]}}, f"r{i}")
        for i in range(N_REQUESTS)))
    for i, result in enumerate(results):
        assert isinstance(result, tuple), result
        check(all_specs[i % 3], *result, words, tokenizer.eos_token_id)
    assert any(finish == "stop" for i, (_, finish) in enumerate(results) if i % 3 == 0)


async def test_kserve_http_generate_respects_the_constraint(server, words, tokenizer):
    spec = specs(words)[1]
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{server.ports['kserve_http']}", timeout=120) as http:
        response = await http.post(f"/v2/models/{MODEL}/generate", json={
            "text_input": "generate", "exclude_input_in_output": True, "return_finish_reason": True,
            "sampling_parameters": json.dumps({"max_tokens": 30, "extra_args": {"constraint": spec}})})
    assert response.status_code == 200, response.text
    body = response.json()
    check(spec, body["text_output"], body["finish_reason"], words, tokenizer.eos_token_id)


@pytest.mark.parametrize(("constraint", "field", "message"), BAD)
async def test_kserve_malformed_constraint_is_refused_naming_the_field(server, constraint, field, message):
    named = f"sampling_parameters.extra_args.{field}"
    error = await _generate(f"127.0.0.1:{server.ports['kserve_grpc']}", "x",
                            {"max_tokens": 4, "extra_args": {"constraint": constraint}}, "bad")
    assert not isinstance(error, tuple)
    assert named in str(error) and message in str(error), str(error)
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{server.ports['kserve_http']}", timeout=60) as http:
        response = await http.post(f"/v2/models/{MODEL}/generate", json={
            "text_input": "x", "sampling_parameters": json.dumps({"max_tokens": 4,
                                                                  "extra_args": {"constraint": constraint}})})
    assert response.status_code == 400 and named in response.text, response.text


async def test_kserve_constraint_outside_extra_args_is_refused_saying_where_it_goes(server, words):
    """NVIDIA's backend builds SamplingParams from `sampling_parameters`, which has no `constraint` field: a
    top-level one would fail there naming nothing, so it is refused here, naming it and `extra_args.constraint`."""
    error = await _generate(f"127.0.0.1:{server.ports['kserve_grpc']}", "x",
                            {"max_tokens": 4, "constraint": specs(words)[0]}, "misplaced")
    assert not isinstance(error, tuple)
    assert "sampling_parameters.constraint" in str(error) and "extra_args.constraint" in str(error), str(error)
