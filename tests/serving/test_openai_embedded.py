"""The `openai` serving mode over Triton embedded in the front-end's process: the real entrypoint (the
image and local runs alike embed Triton), the local libtritonserver (2.51) loaded through the project's C API
binding, the stand-in `vllm` backend with vLLM in its Python backend stub. Driven by the official `openai` client and
NVIDIA's tritonclient; the KServe front-ends on 8000/8001 answer from that same Triton.

On the suite's shared server of the `openai` topology (tests/serving/conftest.py, `openai_server`: every model kind
on one embedded Triton). Its drain on SIGTERM is test_server_lifecycle.py's.
"""

from __future__ import annotations

import base64
import json
import queue
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
import tritonclient.http as httpclient
from transformers import AutoTokenizer
from tritonclient.utils import InferenceServerException

from bench.local_server import Server
from dev_packages.demo import FEATURES_ID, PIPELINE_ID, RANKER_ID, RELEVANCE_ID
from examples import kserve_client
from llm_serving.kserve_stream import is_final, until_final
from serving_image.constraints.spec import constraint_text
from tests.serving import embed_score_reference as reference
from tests.serving.conftest import OPENAI_AUTH
from tests.serving.engine_hold import EngineProcesses, submitted, wait_submitted

pytestmark = pytest.mark.slow

MODEL = "demo-tiny"
SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}, "label": {"type": "string", "maxLength": 10}},
          "required": ["ok", "label"], "additionalProperties": False}


@pytest.fixture(scope="module")
def server(openai_server) -> Server:
    return openai_server


@pytest.fixture(scope="module")
def client(openai_client) -> openai.OpenAI:
    return openai_client


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
        model=MODEL, messages=[{"role": "user", "content": "json please"}], max_tokens=60, temperature=1.0, seed=1,
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


def _letter_tokens(tokenizer, letters: set[str]) -> list[int]:
    """The ids of every token that decodes to letters of `letters` only (44 of the demo model's 624 for a to m)."""
    return [i for i in range(len(tokenizer)) if (text := tokenizer.decode([i])) and set(text) <= letters]


def test_a_long_allowed_set_travels_packed_and_constrains_as_its_list(client, tokenizer):
    """A set whose bitmask is shorter than its list is handed on packed (docs/architecture.md §3.5): through the
    embedded Triton, the stub and vLLM's worker it allows what the list allows. A client may send it packed too,
    and a bad bitmask is refused naming it."""
    letters = set("abcdefghijklm")
    allowed = _letter_tokens(tokenizer, letters)
    vocab = len(tokenizer)
    assert "bitmask" in constraint_text({"kind": "allowed_tokens", "tokens": allowed}, vocab, None)  # packed
    bits = bytearray((vocab + 7) // 8)
    for t in allowed:
        bits[t // 8] |= 1 << (t % 8)
    for constraint in ({"kind": "allowed_tokens", "tokens": allowed},
                       {"kind": "allowed_tokens", "bitmask": base64.b64encode(bytes(bits)).decode()}):
        response = client.completions.create(model=MODEL, prompt="letters", max_tokens=24, temperature=1.0, seed=5,
                                             extra_body={"constraint": constraint, "ignore_eos": True})
        text = response.choices[0].text
        assert response.usage.completion_tokens == 24 and set(text) <= letters, text
    beyond = bytes(bits) + b"\x80"  # one more byte, its top bit id 631: beyond the 624-token vocabulary
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=MODEL, prompt="bad", extra_body={"constraint": {
            "kind": "allowed_tokens", "bitmask": base64.b64encode(beyond).decode()}})
    assert info.value.body["param"] == "constraint.bitmask"
    assert "token id 631 is outside the vocabulary (0..623)" in info.value.body["message"]


def test_errors_name_the_field(client):
    with pytest.raises(openai.BadRequestError) as too_long:
        client.completions.create(model=MODEL, prompt="hello", max_tokens=100000)
    assert too_long.value.body["param"] == "max_tokens"


def test_logprobs_cross_triton_in_the_backends_logprobs_output(client):
    """OpenAI logprobs ride NVIDIA's `logprobs` output (tests/serving/test_openai_api.py checks their values)."""
    completion = client.completions.create(model=MODEL, prompt="hello", max_tokens=3, logprobs=2, temperature=0)
    logprobs = completion.choices[0].logprobs
    assert len(logprobs.tokens) == 3 and all(len(top) == 2 for top in logprobs.top_logprobs)
    assert "".join(logprobs.tokens) == completion.choices[0].text


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
                                   ("sampling_parameters", json.dumps({"max_tokens": 4, "logprobs": 1}).encode(),
                                    "BYTES"),
                                   ("return_num_output_tokens", True, "BOOL"), ("return_logprobs", True, "BOOL")):
            item = grpcclient.InferInput(name, [1], dtype)
            item.set_data_from_numpy(np.array([value], dtype=np.object_ if dtype == "BYTES" else np.bool_))
            inputs.append(item)
        responses: queue.Queue = queue.Queue()
        client.start_stream(callback=lambda result, error: responses.put((result, error)))
        client.async_stream_infer(MODEL, inputs, request_id="kserve-1", enable_empty_final_response=True)
        tokens, positions = 0, []
        for result, error in until_final(responses, timeout=120):
            assert error is None, error
            if result.get_response().outputs:
                tokens += int(result.as_numpy("num_output_tokens").sum())
                positions += json.loads(result.as_numpy("logprobs")[0])  # NVIDIA's form: JSON per choice
        client.stop_stream()
        assert tokens == 4 and len(positions) == 4
        for position in positions:  # token id -> logprob, rank, decoded_token; the sampled token and the top 1
            assert 1 <= len(position) <= 2
            assert all(set(entry) == {"logprob", "rank", "decoded_token"} for entry in position.values())
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
        # Every Triton model the packages name (the LLM's id, its pooling and scoring models, the ranker, the
        # pipeline and its two Python steps), each ready.
        assert sorted((m["name"], m["state"]) for m in index) == sorted(
            (name, "READY") for name in (MODEL, f"{MODEL}-embed", f"{MODEL}-score", RANKER_ID, PIPELINE_ID,
                                         FEATURES_ID, RELEVANCE_ID))
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


def test_several_requests_share_one_stream_and_oversized_messages_are_refused_by_grpc(server):
    """ModelStreamInfer carries any number of requests on one stream (the front-end's fan-in), each answered to the
    end with its own final response; a message above the front-end's limit is refused by gRPC itself."""
    from tritonclient.utils import InferenceServerException

    from serving_image.kserve.triton_grpc import MAX_MESSAGE_BYTES

    client = grpcclient.InferenceServerClient(f"127.0.0.1:{server.ports['kserve_grpc']}")

    def inputs(prompt: bytes, max_tokens: int):
        items = []
        for name, value, dtype in (("text_input", prompt, "BYTES"), ("stream", True, "BOOL"),
                                   ("sampling_parameters", json.dumps({"max_tokens": max_tokens,
                                                                       "ignore_eos": True}).encode(), "BYTES"),
                                   ("return_num_output_tokens", True, "BOOL")):
            item = grpcclient.InferInput(name, [1], dtype)
            item.set_data_from_numpy(np.array([value], dtype=np.object_ if dtype == "BYTES" else np.bool_))
            items.append(item)
        return items

    try:
        responses: queue.Queue = queue.Queue()
        client.start_stream(callback=lambda result, error: responses.put((result, error)))
        wanted = {"share-a": 5, "share-b": 3, "share-c": 4}
        for request_id, max_tokens in wanted.items():
            client.async_stream_infer(MODEL, inputs(b"Say hello", max_tokens), request_id=request_id,
                                      enable_empty_final_response=True)
        tokens = dict.fromkeys(wanted, 0)
        finals: set[str] = set()
        for result, error in until_final(responses, timeout=120, finals=len(wanted)):
            assert error is None, error
            response = result.get_response()
            if response.outputs:
                tokens[response.id] += int(result.as_numpy("num_output_tokens").sum())
            if is_final(response):
                assert response.id not in finals  # one final response per request
                finals.add(response.id)
        client.stop_stream()
        assert finals == set(wanted) and tokens == wanted
        with pytest.raises(InferenceServerException) as huge:
            client.infer(MODEL, inputs(b"x" * (MAX_MESSAGE_BYTES + 1), 1))
        assert "RESOURCE_EXHAUSTED" in str(huge.value.status()) or "larger than max" in huge.value.message()
        assert client.is_server_ready()
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
    """The LLM's vLLM engine processes, children of the backend stub that runs its in-stub engine (grandchildren of
    the server)."""
    return EngineProcesses.of(server.proc.pid, MODEL)


def test_every_model_kind_through_one_call_on_the_embedded_triton(server, client):
    """Every model kind through one interface in the openai mode: the ranker (unary ModelInfer over gRPC and HTTP, a
    batch of rows), the pipeline (an ensemble, one call) and the LLM (streamed) on the same KServe endpoint as the
    OpenAI front-end, through docs/kserve.md's client program (examples/kserve_client.py)."""
    grpc_url = f"127.0.0.1:{server.ports['kserve_grpc']}"
    http_url = f"127.0.0.1:{server.ports['kserve_http']}"
    grpc = grpcclient.InferenceServerClient(grpc_url)
    http = httpclient.InferenceServerClient(http_url)
    try:
        rows = kserve_client.feature_rows(5)
        scores = kserve_client.rank(grpc, rows)
        assert scores.shape == (5, 1) and scores.dtype == np.float32 and np.isfinite(scores).all()
        assert len(set(scores.reshape(-1).round(6).tolist())) > 1  # the booster tells the rows apart
        np.testing.assert_array_equal(kserve_client.rank_http(http, rows), scores)
        outputs = kserve_client.pipeline(grpc, rows)
        assert outputs["relevant"].dtype == np.bool_ and outputs["relevance"].shape == (5, 1)
        # ignore_eos: sampled at vLLM's default temperature the answer may end before 8 tokens (a CI run once got 3);
        # with it, fewer than 8 can only mean a lost response
        text, tokens = kserve_client.generate(grpc, "Say hello", 8, ignore_eos=True)
        assert tokens == 8 and text
        # The OpenAI front-end still serves its LLM beside them (a ranker is not an OpenAI model).
        assert client.completions.create(model=MODEL, prompt="Say hello", max_tokens=4).usage.completion_tokens == 4
        with pytest.raises(openai.NotFoundError):
            client.completions.create(model=RANKER_ID, prompt="x", max_tokens=1)
    finally:
        grpc.close()
        http.close()
    kserve_client.main(["--grpc", grpc_url, "--http", http_url])  # the example program as a user runs it


def test_embeddings_and_scores_through_triton_match_the_vllm_direct_engine(server, client):
    """/v1/embeddings through the pooling model (NVIDIA's `embedding_request`) and /v1/score through the platform's
    scoring model give what the engine in the process gives (the reference recorded from it)."""
    assert f"Triton models {MODEL}, {MODEL}-embed, {MODEL}-score" in server.log()
    reference.check(reference.measure(server.url, headers=OPENAI_AUTH))
    b64 = client.embeddings.create(model=MODEL, input="the platform", encoding_format="base64")
    assert isinstance(b64.data[0].embedding, str)
    with pytest.raises(openai.BadRequestError) as dims:
        client.embeddings.create(model=MODEL, input="x", dimensions=64)
    assert dims.value.body["param"] == "dimensions"
    with pytest.raises(openai.BadRequestError) as ids:
        client.embeddings.create(model=MODEL, input=[[1, 2], [10**7]])
    assert ids.value.body["param"] == "input[1]"
    long_prompt = " ".join(str(i) for i in range(3000))  # beyond the 2048-token window with any candidate
    too_long = httpx.post(f"{server.url}/v1/score", json={"model": MODEL, "prompt": long_prompt,
                                                          "candidates": ["a", "b"]}, headers=OPENAI_AUTH, timeout=120)
    assert too_long.status_code == 400 and too_long.json()["error"]["param"].startswith("candidates["), \
        too_long.text


def test_embedding_and_scoring_models_over_kserve(server):
    """The same models for KServe clients on the same endpoint: NVIDIA's `embedding_request` streamed to the pooling
    model (the vector as JSON in `text_output`), refused by the LLM in NVIDIA's words, and the scoring model called
    with unary ModelInfer like any non-LLM model."""
    client = grpcclient.InferenceServerClient(f"127.0.0.1:{server.ports['kserve_grpc']}")
    try:
        index = {m["name"]: m.get("state") for m in client.get_model_repository_index(as_json=True)["models"]}
        assert all(index.get(m) == "READY" for m in (MODEL, f"{MODEL}-embed", f"{MODEL}-score")), index
        responses: queue.Queue = queue.Queue()
        client.start_stream(callback=lambda result, error: responses.put((result, error)))

        def embed(model: str, body: dict):
            request = grpcclient.InferInput("embedding_request", [1], "BYTES")
            request.set_data_from_numpy(np.array([json.dumps(body).encode()], dtype=np.object_))
            flag = grpcclient.InferInput("return_num_input_tokens", [1], "BOOL")
            flag.set_data_from_numpy(np.array([True]))
            client.async_stream_infer(model, [request, flag])
            return responses.get(timeout=120)

        result, error = embed(f"{MODEL}-embed", {"input": "the platform", "pooling_params": {}})
        assert error is None, error
        vector = json.loads(result.as_numpy("text_output")[0])
        expected = json.loads(reference.GOLDEN.read_text())["embeddings"][0]
        assert vector == pytest.approx(expected["vector"], abs=reference.VECTOR_ABS)
        assert int(result.as_numpy("num_input_tokens").reshape(-1)[0]) > 0
        _, error = embed(f"{MODEL}-embed", {"input": "x", "pooling_params": {"dimensions": [64]}})
        assert "embedding_request.pooling_params.dimensions" in str(error)
        _, error = embed(MODEL, {"input": "x", "pooling_params": {}})
        assert f"Model {MODEL} does not support 'embed' request" in str(error)
        client.stop_stream()

        case = reference.SCORE_CASES[0]
        prompt = grpcclient.InferInput("prompt", [1], "BYTES")
        prompt.set_data_from_numpy(np.array([case[0].encode()], dtype=np.object_))
        candidates = grpcclient.InferInput("candidates", [len(case[1])], "BYTES")
        candidates.set_data_from_numpy(np.array([c.encode() for c in case[1]], dtype=np.object_))
        result = client.infer(f"{MODEL}-score", [prompt, candidates])
        expected = json.loads(reference.GOLDEN.read_text())["scores"][0]
        assert result.as_numpy("logprob").tolist() == pytest.approx(expected["logprob"], abs=reference.LOGPROB_ABS)
        assert result.as_numpy("num_tokens").tolist() == expected["tokens"]
        empty = grpcclient.InferInput("candidates", [0], "BYTES")
        empty.set_data_from_numpy(np.array([], dtype=np.object_))
        with pytest.raises(InferenceServerException, match="input 'candidates' is empty"):
            client.infer(f"{MODEL}-score", [prompt, empty])
    finally:
        client.close()


def test_client_that_leaves_aborts_its_request_in_the_engine(server):
    """The request reaches the engine, which is held, so it is still there when the client disconnects, whatever
    the machine's speed; the front-end cancels it in Triton, whose backend aborts it in the engine."""
    engine = _vllm_processes(server)
    log_start = len(server.log())
    submitted_before = submitted(server.metrics_url, MODEL)
    body = json.dumps({"model": MODEL, "prompt": "long", "max_tokens": 400, "ignore_eos": True, "stream": True})
    request = (f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
               f"Authorization: {OPENAI_AUTH['Authorization']}\r\n"
               f"Content-Length: {len(body)}\r\n\r\n{body}").encode()
    with engine.held():
        sock = socket.create_connection(("127.0.0.1", server.ports["openai"]), timeout=30)
        sock.sendall(request)
        wait_submitted(server.metrics_url, MODEL, submitted_before + 1)
        sock.close()
        deadline = time.monotonic() + 60
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
