"""The round trip: the OpenAI front-end -> the Triton-remote engine adapter (RemoteTritonEngine) -> real
`tritonserver` over the tritonclient gRPC wire protocol (`ModelStreamInfer`) -> the stand-in vllm backend and its
in-stub engine; checked against a raw KServe call to the same server.

The KServe server is NVIDIA's tritonserver itself: the session's standalone one (tests/serving/conftest.py,
`triton_standalone`; nothing here stops it), on the package it was started with (its model id, version, context
window and tokenizer are read from that package, not assumed). At temperature 0 the OpenAI answer must be what a plain
tritonclient `stream_infer` of the same prompt gives: the same text and the same prompt and completion token counts,
for completions, chat (the chat template rendered by the model's tokenizer), JSON schemas, stop strings and the
step-wise `constraint` extension; log-probabilities are served (NVIDIA's return_logprobs / `logprobs` output), and
a refusal keeps its meaning (a 400 naming the field). The official `openai` client drives the front-end in-process
(httpx's ASGI transport).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import uuid
from dataclasses import dataclass
from pathlib import Path

import httpx
import jsonschema
import numpy as np
import openai
import pytest
import pytest_asyncio
import tritonclient.grpc.aio as grpcaio

from llm_serving.kserve_stream import until_final_async
from tests.serving.engine_hold import EngineProcesses

pytestmark = [pytest.mark.slow, pytest.mark.asyncio(loop_scope="module")]

# Bounded on purpose (a boolean and a short string): an unbounded integer can run past max_tokens.
SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}, "label": {"type": "string", "maxLength": 10}},
          "required": ["ok", "label"], "additionalProperties": False}
CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Say hello"}]
CONSTRAINT = {"kind": "token_dfa", "start": 0, "accept": [2], "edges": [[0, 17, 1], [1, 42, 2], [1, 17, 1]]}


@dataclass
class Remote:
    openai: openai.AsyncOpenAI  # the OpenAI front-end over the remote adapter
    engine: object  # the RemoteTritonEngine
    url: str  # Triton's KServe gRPC address
    model: str  # the package's model id: Triton's model name
    version: str
    max_model_len: int
    vocab_size: int
    tokenizer_path: Path
    tokenizer: object  # the package's tokenizer, loaded here (for the chat template and token ids)
    server: object  # the session's standalone server (bench.local_server.Server)


@dataclass
class KServeAnswer:
    """One raw streamed KServe request's answer, the text of every response joined."""

    text: str
    prompt_tokens: int
    completion_tokens: int
    finish_reason: str
    responses: int
    logprobs: list[dict]  # the backend's `logprobs` positions, when asked for


def _client(app) -> openai.AsyncOpenAI:
    http = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://frontend", timeout=120)
    return openai.AsyncOpenAI(base_url="http://frontend/v1", api_key="unused", http_client=http, max_retries=0)


def _served_package(server, workdir: Path):
    """The package the standalone server was started on: the entrypoint's first argument
    (`python -m serving_image.startup PACKAGE ...`, bench.local_server._launch)."""
    from llm_serving.package import open_package

    package = Path(server.proc.args[3])
    assert server.proc.args[1:3] == ["-m", "serving_image.startup"], server.proc.args
    return open_package(package, workdir)


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def remote(triton_standalone, tmp_path_factory):
    # triton_standalone is a synchronous session fixture (the server is a child process): any event loop may use it.
    from transformers import AutoTokenizer

    from serving_image.openai_api.app import create_app
    from serving_image.triton.adapter import RemoteTritonEngine, model_vocab_size

    package = _served_package(triton_standalone, tmp_path_factory.mktemp("remote-package"))
    manifest = package.manifest
    tokenizer_path = package.root / (manifest.engine.tokenizer or manifest.engine.model)
    max_model_len = int(manifest.engine.args["max_model_len"])
    url = f"127.0.0.1:{triton_standalone.ports['kserve_grpc']}"
    engine = await RemoteTritonEngine.connect(url=url, model_name=manifest.model.id, version=manifest.model.version,
                                              tokenizer_path=tokenizer_path, max_model_len=max_model_len)
    tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_path))
    client = _client(create_app(engine))
    try:
        yield Remote(client, engine, url, manifest.model.id, manifest.model.version, max_model_len,
                     model_vocab_size(tokenizer_path, tokenizer), tokenizer_path, tokenizer, triton_standalone)
    finally:
        await client.close()
        await engine.shutdown()


def _inputs(prompt: str, params: dict, *, logprobs: bool = False) -> list:
    """The streaming request of the vllm backend's tensor contract (see test_kserve_startup.py): the prompt, streamed,
    excluded from the output, with every count and the finish reason switched on."""
    inputs = []

    def add(name: str, datatype: str, value) -> None:
        item = grpcaio.InferInput(name, [1], datatype)
        item.set_data_from_numpy(np.array([value], dtype=np.object_ if datatype == "BYTES" else bool))
        inputs.append(item)

    add("text_input", "BYTES", prompt.encode())
    add("stream", "BOOL", True)
    add("exclude_input_in_output", "BOOL", True)
    add("sampling_parameters", "BYTES", json.dumps(params).encode())
    for flag in ("return_finish_reason", "return_num_input_tokens", "return_num_output_tokens",
                 *(("return_logprobs",) if logprobs else ())):
        add(flag, "BOOL", True)
    return inputs


async def _kserve(remote: Remote, prompt: str, params: dict, *, logprobs: bool = False) -> KServeAnswer:
    """Stream one request to Triton with tritonclient's asyncio client (ModelStreamInfer), as any KServe client."""
    client = grpcaio.InferenceServerClient(remote.url)
    results = []

    async def requests():
        yield {"model_name": remote.model, "inputs": _inputs(prompt, params, logprobs=logprobs),
               "request_id": f"raw-{uuid.uuid4().hex[:12]}"}
        await asyncio.sleep(3600)  # the request side stays open, as a real client's does

    stream = client.stream_infer(requests())
    try:
        async for result, error in until_final_async(stream):
            assert error is None, error
            results.append(result)
    finally:
        stream.cancel()
        await client.close()
    outputs = [r for r in results if r.as_numpy("text_output") is not None]
    assert outputs, "no response with text_output"
    positions = [p for r in outputs for p in json.loads(r.as_numpy("logprobs")[0])] if logprobs else []
    return KServeAnswer(text="".join(r.as_numpy("text_output")[0].decode() for r in outputs),
                        prompt_tokens=int(outputs[-1].as_numpy("num_input_tokens")[0]),
                        completion_tokens=sum(int(r.as_numpy("num_output_tokens")[0]) for r in outputs),
                        finish_reason=outputs[-1].as_numpy("finish_reason")[0].decode(),
                        responses=len(outputs), logprobs=positions)


def _chat_text(remote: Remote, messages: list[dict]) -> str:
    """The chat prompt as text, rendered by the model's own template (what a KServe client sends Triton)."""
    return remote.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)


async def test_remote_adapter_reports_the_model(remote):
    engine = remote.engine
    assert engine.is_ready() and engine.dead_reason is None
    assert (engine.info.name, engine.info.version) == (remote.model, remote.version)
    assert engine.info.max_model_len == remote.max_model_len
    assert engine.info.vocab_size == remote.vocab_size  # the model's (config.json), not the tokenizer's
    assert engine.info.eos_token_id == remote.tokenizer.eos_token_id
    assert engine.encode_prompt("hello", add_special_tokens=True) == remote.tokenizer.encode("hello")
    models = (await remote.openai.models.list()).data
    assert [m.id for m in models] == [remote.model]


@pytest.mark.parametrize("prompt", ["The platform serves", "Client services call every model", "{\"name\":"])
async def test_completions_match_a_raw_kserve_call(remote, prompt):
    completion = await remote.openai.completions.create(model=remote.model, prompt=prompt, max_tokens=24,
                                                        temperature=0)
    raw = await _kserve(remote, prompt, {"max_tokens": 24, "temperature": 0})
    choice = completion.choices[0]
    assert choice.text == raw.text and choice.text
    assert choice.finish_reason == raw.finish_reason
    assert completion.usage.prompt_tokens == raw.prompt_tokens
    assert completion.usage.completion_tokens == raw.completion_tokens


async def test_chat_and_streaming_match_a_raw_kserve_call(remote):
    kwargs = {"model": remote.model, "messages": CHAT, "max_tokens": 20, "temperature": 0}
    chat = await remote.openai.chat.completions.create(**kwargs)
    raw = await _kserve(remote, _chat_text(remote, CHAT), {"max_tokens": 20, "temperature": 0})
    assert chat.choices[0].message.content == raw.text and raw.text
    assert chat.choices[0].finish_reason == raw.finish_reason
    assert (chat.usage.prompt_tokens, chat.usage.completion_tokens) == (raw.prompt_tokens, raw.completion_tokens)
    pieces, usage = [], None
    stream = await remote.openai.chat.completions.create(**kwargs, stream=True,
                                                         stream_options={"include_usage": True})
    async for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            pieces.append(chunk.choices[0].delta.content)
        usage = chunk.usage or usage
    # (How many chunks: one per Triton response, and the engine merges outputs its consumer has not taken yet, so a
    # loaded machine may see few; httpx's ASGI transport hands the client the body only once the app is done.)
    assert pieces
    assert "".join(pieces) == raw.text
    assert (usage.prompt_tokens, usage.completion_tokens) == (raw.prompt_tokens, raw.completion_tokens)


async def test_a_client_that_leaves_aborts_its_request_in_the_engine(remote):
    """Closing the adapter's stream cancels the request in Triton, whose backend aborts it in the engine. Forced: the
    engine's vLLM processes are held (SIGSTOP; the stub and its in-stub engine's thread run) before the request is
    sent, so the request is still in the engine when its client leaves, whatever the machine's speed (held after a
    first output instead, a fast engine may have finished every token before the hold: a race, not a test)."""
    from serving_image.engine.base import EngineRequest, SamplingSpec

    server = remote.server
    request_id = f"remote-leave-{uuid.uuid4().hex[:8]}"
    vllm = EngineProcesses.of(server.proc.pid, remote.model)
    log_start = len(server.log())
    vllm.hold()
    try:
        stream = remote.engine.generate(EngineRequest(request_id, "long",
                                                      SamplingSpec(max_tokens=64, ignore_eos=True)))
        first = asyncio.ensure_future(anext(stream))
        deadline = asyncio.get_running_loop().time() + 60
        pattern = rf"request (\S+) \(client id '{request_id}'\) submitted to the engine"
        while not (submitted := re.search(pattern, server.log()[log_start:])):
            assert asyncio.get_running_loop().time() < deadline, (
                f"the request never reached the engine:\n{server.log()[-3000:]}")
            await asyncio.sleep(0.05)
        assert not first.done(), "an output came from a held engine"
        first.cancel()  # the client leaves: the adapter's generator unwinds and cancels its stream, Triton the request
        with contextlib.suppress(asyncio.CancelledError, StopAsyncIteration):
            await first
        await stream.aclose()
        aborted = f"request {submitted.group(1)} aborted in the engine (its client cancelled it)"
        while aborted not in server.log()[log_start:]:
            assert asyncio.get_running_loop().time() < deadline, (
                f"the request was not aborted in the engine:\n{server.log()[-3000:]}")
            await asyncio.sleep(0.05)
    finally:
        vllm.release()
    after = await remote.openai.completions.create(model=remote.model, prompt="hi", max_tokens=3, temperature=0)
    assert after.usage.completion_tokens <= 3  # the engine serves on


async def test_json_schema_and_stop_through_kserve(remote):
    from serving_image.triton.pins import load_pins

    key = load_pins().pinned.structured_outputs_key  # what the adapter sends, read by the backend of this release
    fmt = {"type": "json_schema", "json_schema": {"name": "item", "schema": SCHEMA}}
    for i in range(3):
        messages = [{"role": "user", "content": f"item {i}"}]
        chat = await remote.openai.chat.completions.create(model=remote.model, messages=messages, max_tokens=120,
                                                           temperature=0, response_format=fmt)
        raw = await _kserve(remote, _chat_text(remote, messages),
                            {"max_tokens": 120, "temperature": 0, key: json.dumps({"json": SCHEMA})})
        content = chat.choices[0].message.content
        assert content == raw.text
        assert chat.choices[0].finish_reason == "stop" == raw.finish_reason
        jsonschema.validate(json.loads(content), SCHEMA)
    completion = await remote.openai.completions.create(model=remote.model, prompt="The platform", max_tokens=40,
                                                        temperature=0, stop=["e"])
    raw = await _kserve(remote, "The platform", {"max_tokens": 40, "temperature": 0, "stop": ["e"]})
    assert completion.choices[0].text == raw.text and "e" not in raw.text
    assert completion.choices[0].finish_reason == raw.finish_reason
    assert completion.usage.completion_tokens == raw.completion_tokens


async def test_constraint_through_kserve(remote):
    """The step-wise constraint (an OpenAI extension) reaches the engine as SamplingParams.extra_args.constraint."""
    greedy = await remote.openai.completions.create(model=remote.model, prompt="constrained", max_tokens=12,
                                                    temperature=0, extra_body={"constraint": CONSTRAINT})
    raw = await _kserve(remote, "constrained", {"max_tokens": 12, "temperature": 0,
                                                "extra_args": {"constraint": CONSTRAINT}})
    assert greedy.choices[0].text == raw.text
    assert greedy.usage.completion_tokens == raw.completion_tokens
    sampled = await remote.openai.completions.create(model=remote.model, prompt="constrained", max_tokens=12,
                                                     temperature=1.0, seed=None,
                                                     extra_body={"constraint": CONSTRAINT})
    for completion in (greedy, sampled):
        ids = remote.tokenizer.encode(completion.choices[0].text, add_special_tokens=False)
        assert ids[:1] == [17] and set(ids) <= {17, 42}, ids
        assert ids[-1] == 42 or completion.choices[0].finish_reason == "length"


async def test_logprobs_are_served_through_triton(remote):
    """OpenAI logprobs ride NVIDIA's return_logprobs input and `logprobs` output: through real Triton they are
    served, the same as a raw KServe call's."""
    completion = await remote.openai.completions.create(model=remote.model, prompt="hello", max_tokens=4,
                                                        temperature=0, logprobs=2)
    raw = await _kserve(remote, "hello", {"max_tokens": 4, "temperature": 0, "logprobs": 2}, logprobs=True)
    choice = completion.choices[0]
    logprobs = choice.logprobs
    assert logprobs is not None and choice.text == raw.text
    assert len(logprobs.tokens) == completion.usage.completion_tokens == raw.completion_tokens == len(raw.logprobs)
    assert "".join(logprobs.tokens) == choice.text
    assert all(len(top) == 2 for top in logprobs.top_logprobs)
    # the sampled token's log-probability is the first entry of each of the backend's positions
    expected = [float(next(iter(position.values()))["logprob"]) for position in raw.logprobs]
    assert logprobs.token_logprobs == pytest.approx(expected, abs=1e-4)


async def test_refusals_keep_their_meaning_through_kserve(remote):
    from serving_image.openai_api.app import create_app
    from serving_image.triton.adapter import RemoteTritonEngine

    with pytest.raises(openai.BadRequestError) as refused:
        await remote.openai.completions.create(model=remote.model, prompt="hi", max_tokens=100000)
    assert "max_tokens" in str(refused.value) and refused.value.body["param"] == "max_tokens"
    # The front-end refused that one itself (it knows the context window). An adapter told a larger window lets it
    # through: Triton's backend refuses it (sampling_parameters.max_tokens, on the gRPC stream), and the adapter
    # turns that back into a 400 naming max_tokens.
    unaware = await RemoteTritonEngine.connect(url=remote.url, model_name=remote.model, version=remote.version,
                                               tokenizer_path=remote.tokenizer_path,
                                               max_model_len=10 * 100000)
    client = _client(create_app(unaware))
    try:
        with pytest.raises(openai.BadRequestError) as refused:
            await client.completions.create(model=remote.model, prompt="hi", max_tokens=100000)
    finally:
        await client.close()
        await unaware.shutdown()
    assert "max_tokens" in str(refused.value) and refused.value.body["param"] == "max_tokens"
    # and the path still works afterwards
    ok = await remote.openai.completions.create(model=remote.model, prompt="hi", max_tokens=3, temperature=0)
    assert ok.usage.completion_tokens <= 3
