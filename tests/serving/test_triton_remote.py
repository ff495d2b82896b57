"""The round trip: the OpenAI front-end -> the Triton-remote engine adapter -> the local KServe gRPC server, over the
real tritonclient wire protocol -> the vLLM engine; checked against the same front-end on the direct engine.

One vLLM engine for the module serves both paths, so at temperature 0 both must produce the same text and the same
token counts, for completions, chat, streaming, JSON schemas and step-wise constraints. The official `openai`
client drives both apps in-process (httpx's ASGI transport).
"""

from __future__ import annotations

import asyncio
import json

import httpx
import jsonschema
import openai
import pytest
import pytest_asyncio

from serving_image.local_server import free_port
from tests.serving.engine_hold import EngineProcesses

pytestmark = [pytest.mark.slow, pytest.mark.asyncio(loop_scope="module")]

# float32: see tests/serving/test_kserve_server.py (this VM SIGILLs in vLLM's bf16 AMX attention kernel).
ENGINE_ARGS = {"max_model_len": 512, "kv_cache_memory_bytes": 128 * 1024 * 1024, "enforce_eager": True,
               "dtype": "float32"}
MODEL = "demo-tiny"
# Bounded on purpose (a boolean and a short string): an unbounded integer can run past max_tokens.
SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}, "label": {"type": "string", "maxLength": 10}},
          "required": ["ok", "label"], "additionalProperties": False}


class Paths:
    def __init__(self, direct: openai.AsyncOpenAI, remote: openai.AsyncOpenAI, remote_engine, engine):
        self.direct = direct
        self.remote = remote
        self.remote_engine = remote_engine
        self.engine = engine


def _client(app) -> openai.AsyncOpenAI:
    http = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://frontend", timeout=120)
    return openai.AsyncOpenAI(base_url="http://frontend/v1", api_key="unused", http_client=http, max_retries=0)


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def paths(demo_model_dir):
    from serving_image.engine.triton_adapter import RemoteTritonEngine
    from serving_image.engine.vllm_local import VllmLocalEngine
    from serving_image.kserve.frontends import start_kserve
    from serving_image.openai_api.app import create_app

    engine = await VllmLocalEngine.start(name=MODEL, version="1.0.0", model_path=demo_model_dir,
                                         tokenizer_path=demo_model_dir, args=dict(ENGINE_ARGS))
    kserve = await start_kserve(engine, None, host="127.0.0.1", grpc_port=free_port(), http_port=free_port())
    remote = await RemoteTritonEngine.connect(url=f"127.0.0.1:{kserve.grpc_port}", model_name=MODEL,
                                              version="1.0.0", tokenizer_path=demo_model_dir,
                                              max_model_len=engine.info.max_model_len)
    direct_client, remote_client = _client(create_app(engine)), _client(create_app(remote))
    try:
        yield Paths(direct_client, remote_client, remote, engine)
    finally:
        await direct_client.close()
        await remote_client.close()
        await remote.shutdown()
        await kserve.stop()
        await engine.shutdown()


async def test_remote_adapter_reports_the_model(paths):
    assert paths.remote_engine.is_ready()
    assert paths.remote_engine.info.vocab_size == paths.engine.info.vocab_size  # the model's, not the tokenizer's
    assert paths.remote_engine.info.eos_token_id == paths.engine.info.eos_token_id
    assert paths.remote_engine.encode_prompt("hello", add_special_tokens=True) == \
        paths.engine.encode_prompt("hello", add_special_tokens=True)
    assert [m.id for m in (await paths.remote.models.list()).data] == [MODEL]


@pytest.mark.parametrize("prompt", ["The platform serves", "Client services call every model", "{\"name\":"])
async def test_completions_match_the_direct_engine(paths, prompt):
    kwargs = {"model": MODEL, "prompt": prompt, "max_tokens": 24, "temperature": 0}
    direct = await paths.direct.completions.create(**kwargs)
    remote = await paths.remote.completions.create(**kwargs)
    assert remote.choices[0].text == direct.choices[0].text
    assert remote.choices[0].finish_reason == direct.choices[0].finish_reason
    assert remote.usage.prompt_tokens == direct.usage.prompt_tokens
    assert remote.usage.completion_tokens == direct.usage.completion_tokens


async def test_chat_and_streaming_match(paths):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Say hello"}]
    direct = await paths.direct.chat.completions.create(model=MODEL, messages=messages, max_tokens=20,
                                                        temperature=0)
    remote = await paths.remote.chat.completions.create(model=MODEL, messages=messages, max_tokens=20,
                                                        temperature=0)
    assert remote.choices[0].message.content == direct.choices[0].message.content
    assert remote.usage == direct.usage
    pieces = []
    stream = await paths.remote.chat.completions.create(model=MODEL, messages=messages, max_tokens=20,
                                                        temperature=0, stream=True,
                                                        stream_options={"include_usage": True})
    usage = None
    async for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            pieces.append(chunk.choices[0].delta.content)
        usage = chunk.usage or usage
    # (How many chunks: one per engine output, and vLLM merges those its consumer has not taken yet, so a loaded
    # machine may see few. That outputs come through before the end: test_remote_adapter_streams_before_the_end.)
    assert pieces
    assert "".join(pieces) == direct.choices[0].message.content
    assert usage.completion_tokens == direct.usage.completion_tokens


async def test_remote_adapter_streams_before_the_end(paths):
    """The remote adapter passes each output on as the engine makes it, not once the request is done. Forced: the
    engine is held (SIGSTOP) from the first output on, so the request is still running when it is checked."""
    from serving_image.engine.base import EngineRequest, SamplingSpec

    engine = EngineProcesses.in_this_process()
    stream = paths.remote_engine.generate(EngineRequest("remote-stream", "long",
                                                        SamplingSpec(max_tokens=400, ignore_eos=True)))
    try:
        first = await anext(stream)
        engine.hold()
        assert not first.finished
        assert paths.engine._llm.output_processor.has_unfinished_requests(), "the request ended before its output"
    finally:
        engine.release()
        await stream.aclose()  # the client leaves: the request is aborted
    for _ in range(600):  # a guard only
        if not paths.engine._llm.output_processor.has_unfinished_requests():
            break
        await asyncio.sleep(0.1)
    assert not paths.engine._llm.output_processor.has_unfinished_requests()


async def test_json_schema_and_stop_through_kserve(paths):
    fmt = {"type": "json_schema", "json_schema": {"name": "item", "schema": SCHEMA}}
    for i in range(3):
        messages = [{"role": "user", "content": f"item {i}"}]
        direct = await paths.direct.chat.completions.create(model=MODEL, messages=messages, max_tokens=120,
                                                            temperature=0, response_format=fmt)
        remote = await paths.remote.chat.completions.create(model=MODEL, messages=messages, max_tokens=120,
                                                            temperature=0, response_format=fmt)
        assert remote.choices[0].message.content == direct.choices[0].message.content
        assert remote.choices[0].finish_reason == "stop"
        jsonschema.validate(json.loads(remote.choices[0].message.content), SCHEMA)
    direct = await paths.direct.completions.create(model=MODEL, prompt="The platform", max_tokens=40,
                                                   temperature=0, stop=["e"])
    remote = await paths.remote.completions.create(model=MODEL, prompt="The platform", max_tokens=40,
                                                   temperature=0, stop=["e"])
    assert remote.choices[0].text == direct.choices[0].text and "e" not in remote.choices[0].text


async def test_constraint_through_kserve(paths):
    constraint = {"kind": "token_dfa", "start": 0, "accept": [2], "edges": [[0, 17, 1], [1, 42, 2], [1, 17, 1]]}
    kwargs = {"model": MODEL, "prompt": "constrained", "max_tokens": 12, "temperature": 1.0, "seed": None,
              "extra_body": {"constraint": constraint}}
    remote = await paths.remote.completions.create(**kwargs)
    ids = paths.engine.encode_prompt(remote.choices[0].text, add_special_tokens=False)
    assert ids[:1] == [17] and set(ids) <= {17, 42}, ids
    assert ids[-1] == 42 or remote.choices[0].finish_reason == "length"


async def test_refusals_keep_their_meaning_through_kserve(paths):
    with pytest.raises(openai.BadRequestError) as direct:
        await paths.direct.completions.create(model=MODEL, prompt="hi", max_tokens=100000)
    with pytest.raises(openai.BadRequestError) as remote:
        await paths.remote.completions.create(model=MODEL, prompt="hi", max_tokens=100000)
    assert "max_tokens" in str(direct.value) and "max_tokens" in str(remote.value)
    # This project's own KServe front-end (the LLM_SERVING_OPENAI_ENGINE=vllm option) produces no log probabilities:
    # its refusal of NVIDIA's return_logprobs reaches the OpenAI client as a 400 naming `logprobs` (through real
    # Triton they are served: tests/serving/test_openai_embedded.py)
    with pytest.raises(openai.BadRequestError) as remote:
        await paths.remote.completions.create(model=MODEL, prompt="hi", max_tokens=4, logprobs=2)
    assert "logprobs" in str(remote.value) and remote.value.body["param"] == "logprobs"
    # and the path still works afterwards
    ok = await paths.remote.completions.create(model=MODEL, prompt="hi", max_tokens=3, temperature=0)
    assert ok.usage.completion_tokens <= 3
