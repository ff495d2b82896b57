"""Schemathesis over the OpenAI front-end's own OpenAPI document, in process: the real app (serving_image/openai_api)
on a fake engine that answers every request in the shape it asked for (n choices, at most max_tokens tokens,
log-probabilities when asked, embeddings and scores). The fuzzing is about the front-end's classification of
fields and its error contract (no 5xx, documented status codes and content types, every response matching its
schema), which needs no real engine, so it runs many examples fast; a small smoke run against the real server
(test_openai_api.py, test_fuzzing_the_openapi_schema_finds_no_server_error) shows the same contract holds there."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest

from serving_image.openai_api.admission import APIConfig
from serving_image.openai_api.app import create_app
from serving_image.served_model import (
    CandidateScore,
    ChoiceDelta,
    Embedding,
    GenerationOutput,
    GenerationRequest,
    ModelInfo,
    ServedModel,
    TokenLogprob,
    TopLogprob,
)

MODEL = ModelInfo(name="fake", version="3", max_model_len=256, vocab_size=100, eos_token_id=0, embedding_dim=4)
KEY = "fuzz-key"


class ShapedModel(ServedModel):
    """Answers like a real engine in shape: `n` choices of min(max_tokens, 3) tokens each (a "length" finish when
    max_tokens cut it, else "stop"), per-token log-probabilities with the top k when asked, an embedding per input
    and a score per candidate. Its tokenizer is one token per character."""

    info = MODEL

    async def generate(self, request: GenerationRequest) -> AsyncIterator[GenerationOutput]:
        s = request.sampling
        prompt_tokens = len(request.prompt) if isinstance(request.prompt, list) else len(request.prompt) + 1
        limit = s.max_tokens if s.max_tokens is not None else 3
        count = min(limit, 3)
        for step in range(count):
            last = step == count - 1
            choices = []
            for index in range(s.n):
                logprobs = None
                if s.logprobs is not None:
                    top = tuple(TopLogprob(chr(97 + k), 97 + k, -0.5 - k) for k in range(s.logprobs))
                    logprobs = (TokenLogprob("a", 97, -0.5, top, 1),)
                finish = ("length" if count == limit else "stop") if last else None
                choices.append(ChoiceDelta(index, "a", (97,), logprobs, finish))
            yield GenerationOutput(request.request_id, prompt_tokens, tuple(choices), finished=last)

    async def abort(self, request_id: str) -> None:
        pass

    def is_ready(self) -> bool:
        return True

    @property
    def dead_reason(self) -> str | None:
        return None

    def encode_prompt(self, text: str, *, add_special_tokens: bool) -> list[int]:
        return [1] * add_special_tokens + [ord(c) % MODEL.vocab_size for c in text]

    def decode(self, token_ids: list[int]) -> str:
        return "".join(chr(97 + t % 26) for t in token_ids)

    def render_chat(self, messages: list[dict[str, str]], *, add_generation_prompt: bool = True) -> str:
        return "\n".join(str(m.get("content")) for m in messages)

    async def embed(self, inputs: list[str | list[int]], request_id: str) -> list[Embedding]:
        return [Embedding((0.5, 0.5, 0.5, 0.5), len(item) + (not isinstance(item, list))) for item in inputs]

    async def score(self, prompt: str, candidates: list[str], request_id: str) -> list[CandidateScore]:
        return [CandidateScore(-1.0 * (i + 1), max(1, len(c))) for i, c in enumerate(candidates)]

    async def shutdown(self) -> None:
        pass


def test_fuzzing_the_openapi_schema_in_process_finds_no_server_error(monkeypatch, tmp_path):
    import schemathesis
    from hypothesis import HealthCheck, given, settings
    from schemathesis.checks import not_a_server_error
    from schemathesis.specs.openapi.checks import (
        content_type_conformance,
        response_schema_conformance,
        status_code_conformance,
    )

    monkeypatch.setenv("LLM_SERVING_API_KEYS", KEY)
    from serving_image.batch.api import mounted
    from serving_image.batch.config import BatchConfig

    # with the Batch API on (a directory store), so that its routes are fuzzed too
    batch = BatchConfig.from_env({"LLM_SERVING_BATCH_STORE": str(tmp_path / "batch-store")})
    app = create_app(ShapedModel(), config=APIConfig(max_inflight_tokens=100_000), extensions=(mounted(batch),))
    schema = schemathesis.openapi.from_asgi("/openapi.json", app)
    operations = [result.ok() for result in schema.get_all_operations()]
    assert {op.path for op in operations} >= {"/v1/completions", "/v1/chat/completions", "/v1/embeddings",
                                             "/v1/score", "/v1/models", "/v1/files", "/v1/batches"}

    def check_operation(op) -> None:
        @settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck), database=None)
        @given(case=op.as_strategy())
        def check(case) -> None:
            case.headers = {**(case.headers or {}), "Authorization": f"Bearer {KEY}"}
            if isinstance(case.body, dict) and "model" in case.body:
                case.body["model"] = MODEL.name  # past the model lookup (its 404 is tested on its own)
            case.call_and_validate(checks=[not_a_server_error, status_code_conformance, content_type_conformance,
                                           response_schema_conformance])

        check()

    for operation in operations:
        check_operation(operation)


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_the_fake_engine_answers_in_the_shape_asked(path):
    """The fuzz above proves something only if the fake answers as the app expects an engine to: a well-formed
    request through it is a 200 with n choices."""
    import httpx

    app = create_app(ShapedModel(), config=APIConfig(max_inflight_tokens=100_000))
    body = {"model": MODEL.name, "max_tokens": 2, "n": 2, "temperature": 1.0,
            **({"prompt": "hi"} if path == "/v1/completions" else {"messages": [{"role": "user", "content": "hi"}]})}

    async def call():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://server") as client:
            return await client.post(path, json=body)

    import asyncio

    response = asyncio.run(call())
    assert response.status_code == 200, response.text
    assert len(response.json()["choices"]) == 2
    assert response.json()["usage"]["completion_tokens"] == 4


def test_each_post_endpoint_is_described_once_and_refuses_other_methods_in_openais_shape():
    """The POST endpoints are plain Starlette routes (app.py POST_HANDLERS), described in the document from
    ENDPOINTS: each has one operation with its request body and every error status, and another method on its
    path is a 405 with OpenAI's error object."""
    import asyncio

    import httpx

    from serving_image.openai_api.openapi import ERROR_STATUSES
    from serving_image.openai_api.protocol import ENDPOINTS

    app = create_app(ShapedModel())
    spec = app.openapi()
    operation_ids = [op["operationId"] for path in spec["paths"].values() for op in path.values()]
    assert len(operation_ids) == len(set(operation_ids))
    for endpoint in ENDPOINTS:
        assert set(spec["paths"][endpoint.path]) == {"post"}
        operation = spec["paths"][endpoint.path]["post"]
        assert operation["requestBody"]["content"]["application/json"]["schema"]
        assert set(operation["responses"]) == {"200", *ERROR_STATUSES}

    async def call():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://server") as client:
            return [await client.get(endpoint.path) for endpoint in ENDPOINTS]

    for response in asyncio.run(call()):
        assert response.status_code == 405, response.text
        assert set(response.json()["error"]) == {"message", "type", "param", "code"}
