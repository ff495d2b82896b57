"""The client library without a server (docs/clients.md): discovery from a stack-outputs file, the checks a call
makes before anything is sent (the route's kind, tensor inputs against the model's I/O, an experiment's arm against
the call), retries only where safe, and the per-stage records (OpenTelemetry spans, the JSON line without prompt
text). The calls against the shared server are in test_client_remote.py."""

from __future__ import annotations

import json
import logging

import numpy as np
import pytest
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from llm_serving.stack_outputs import StackOutputsError, parse_stack_outputs
from llm_serving_client import (
    Client,
    DeadlineExceeded,
    ExperimentError,
    InvalidRequest,
    LocalEndpoints,
    RetryPolicy,
    Unavailable,
    load_outputs,
)
from llm_serving_client.deadline import Deadline
from llm_serving_client.discovery import Discovery
from llm_serving_client.observe import Observer
from llm_serving_client.retry import call_with_retries
from llm_serving_client.tensor import ModelIO, TensorSpec, check_inputs
from tests.serving.client_outputs import FEATURES, LLM, PIPELINE, RANKER, document

# -- discovery ---------------------------------------------------------------------------------------------------


def test_outputs_load_from_the_file_the_deployment_renders(tmp_path, monkeypatch):
    path = tmp_path / "stack-outputs.json"
    path.write_text(json.dumps(document()))
    assert sorted(load_outputs(path).models) == sorted([LLM, RANKER, PIPELINE, FEATURES])
    monkeypatch.setenv("LLM_SERVING_STACK_OUTPUTS", str(path))
    assert load_outputs().stack == "dev-us-east-1"


@pytest.mark.parametrize("content,message", [
    (None, "no such stack-outputs file"),
    ("{not json", "not JSON"),
    ("[]", "a stack-outputs document is a JSON object, got list"),
    (json.dumps({**document(), "schemaVersion": 3}), "schemaVersion 3 is not supported (this client reads 1, 2)"),
])
def test_a_bad_file_is_named_with_what_is_wrong(tmp_path, content, message):
    path = tmp_path / "stack-outputs.json"
    if content is not None:
        path.write_text(content)
    with pytest.raises(StackOutputsError) as info:
        load_outputs(path)
    assert str(path) in str(info.value) and message in str(info.value)


def test_no_file_and_no_variable_says_where_to_look(monkeypatch):
    monkeypatch.delenv("LLM_SERVING_STACK_OUTPUTS", raising=False)
    with pytest.raises(StackOutputsError, match="set LLM_SERVING_STACK_OUTPUTS"):
        load_outputs()


def test_routes_follow_the_outputs_and_refuse_what_they_do_not_serve():
    discovery = Discovery(parse_stack_outputs(document()))
    route = discovery.route(RANKER, "grpc", "1.0.0")
    assert (route.address, route.tls, route.version) == ("ranker-1-0-0.grpc.llm.dev.internal.acme.example:443", True,
                                                         "1.0.0")
    with pytest.raises(StackOutputsError, match="model 'ranker' is kind python: it answers KServe v2 tensor"):
        discovery.route(RANKER, "openai")
    with pytest.raises(StackOutputsError, match=r"model 'ranker' does not serve version '9.9.9'"):
        discovery.route(RANKER, "grpc", "9.9.9")
    with pytest.raises(StackOutputsError, match=r"model 'chat' is not served by stack dev-us-east-1"):
        discovery.route("chat", "openai")
    local = Discovery(parse_stack_outputs(document()), LocalEndpoints("http://127.0.0.1:9000/v1", "127.0.0.1:8001"))
    assert (local.route(LLM, "openai").address, local.route(LLM, "openai").tls) == ("http://127.0.0.1:9000/v1", False)


# -- checks before sending -----------------------------------------------------------------------------------------

IO = ModelIO({"features": TensorSpec("features", "FP32", (-1, 8))}, {"score": TensorSpec("score", "FP32", (-1, 1))})
ROUTE = Discovery(parse_stack_outputs(document())).route(RANKER, "grpc", "1.0.0")


@pytest.mark.parametrize("inputs,field,message", [
    ({"features": np.zeros((2, 8), np.float64)}, "features", "is FP64 (float64); the model takes FP32"),
    ({"features": np.zeros((2, 7), np.float32)}, "features", "has shape [2, 7]; the model takes [-1, 8]"),
    ({"features": np.zeros(8, np.float32)}, "features", "has shape [8]; the model takes [-1, 8]"),
    ({"features": [[0.0] * 8]}, "features", "is a list; pass a numpy array of FP32"),
    ({}, "features", "is missing (inputs: ['features'])"),
    ({"features": np.zeros((1, 8), np.float32), "extra": np.zeros(1, np.float32)}, "extra",
     "is not an input of the model"),
])
def test_tensor_inputs_are_checked_against_the_models_io(inputs, field, message):
    with pytest.raises(InvalidRequest) as info:
        check_inputs(ROUTE, IO, inputs)
    err = info.value
    assert (err.model, err.version, err.field) == (RANKER, "1.0.0", field)
    assert str(err) == f"model 'ranker' version '1.0.0' field '{field}': {message}" or message in str(err)


def client(**kwargs) -> Client:
    # An address nothing listens on: these calls must fail before they would connect.
    return Client(parse_stack_outputs(document()), local=LocalEndpoints("http://127.0.0.1:9/v1", "127.0.0.1:9"),
                  **kwargs)


def test_an_experiment_call_names_what_conflicts_with_its_arm():
    c = client()
    with pytest.raises(ExperimentError, match="experiment 'nope' is not declared in stack dev-us-east-1"):
        c.chat(experiment="nope", unit="u1", messages=[])
    with pytest.raises(ExperimentError, match=r"needs the call's unit id \(its user\)"):
        c.chat(experiment="chat-temperature", messages=[])
    unit = next(u for u in (f"u{i}" for i in range(100)) if c.experiments.assign(
        "chat-temperature", u, "s").arm.name == "cool")
    with pytest.raises(ExperimentError) as info:
        c.chat(experiment="chat-temperature", unit=unit, messages=[], temperature=0.7)
    assert info.value.field == "temperature" and "arm 'cool' sets it; the call sets it too" in str(info.value)
    with pytest.raises(ExperimentError, match="arm 'cool' calls 'demo-tiny', not this call's model"):
        c.chat(PIPELINE, experiment="chat-temperature", unit=unit, messages=[])
    with pytest.raises(InvalidRequest, match=r"model 'demo-tiny'.*is an LLM"):
        c.infer(LLM, {})


def test_exposure_is_logged_once_per_unit(caplog):
    c = client()
    with caplog.at_level(logging.INFO, logger="llm_serving_client.exposures"):
        for _ in range(3):
            c.experiments.assign("chat-temperature", "user-42", "s")
        c.experiments.assign("chat-temperature", "user-43", "s")
        # A call the client refuses (it sets a field the arm sets) exposes nobody.
        refused = next(f"user-{i}" for i in range(100, 200) if c.experiments.assign(
            "chat-temperature", f"user-{i}", "s", expose=False).arm.name == "cool")
        with pytest.raises(ExperimentError):
            c.chat(experiment="chat-temperature", unit=refused, messages=[], temperature=0.7)
    events = [json.loads(r.getMessage()) for r in caplog.records if r.name == "llm_serving_client.exposures"]
    assert [(e["unit"], e["unit_kind"], e["experiment"]) for e in events] == [
        ("user-42", "user", "chat-temperature"), ("user-43", "user", "chat-temperature")]


# -- retries and deadlines ---------------------------------------------------------------------------------------


def _failing(errors):
    calls = []

    def attempt(n):
        calls.append(n)
        if errors:
            raise errors.pop(0)
        return "answer"
    return attempt, calls


def test_unavailable_is_retried_only_when_safe():
    policy, deadline = RetryPolicy(max_attempts=3, backoff_s=0.001), Deadline.after(10)
    attempt, calls = _failing([Unavailable("down", model="m"), Unavailable("down", model="m")])
    assert call_with_retries(attempt, policy=policy, deadline=deadline, safe=True) == "answer" and calls == [1, 2, 3]
    attempt, calls = _failing([Unavailable("down", model="m")])
    with pytest.raises(Unavailable):
        call_with_retries(attempt, policy=policy, deadline=deadline, safe=False)
    assert calls == [1]
    attempt, calls = _failing([InvalidRequest("bad", model="m", field="x")])
    with pytest.raises(InvalidRequest):
        call_with_retries(attempt, policy=policy, deadline=deadline, safe=True)
    assert calls == [1]
    attempt, calls = _failing([Unavailable("down", model="m")] * 3)
    with pytest.raises(Unavailable):
        call_with_retries(attempt, policy=policy, deadline=deadline, safe=True)
    assert calls == [1, 2, 3]


def test_no_attempt_starts_after_the_deadline():
    deadline = Deadline(at=0.0)
    with pytest.raises(DeadlineExceeded, match="model 'ranker' version '1.0.0': the deadline passed"):
        deadline.timeout("ranker", "1.0.0")


def test_an_unreachable_server_is_unavailable_after_the_retries(caplog):
    c = client(retry=RetryPolicy(max_attempts=2, backoff_s=0.001))
    with caplog.at_level(logging.INFO, logger="llm_serving_client.calls"), pytest.raises(Unavailable) as info:
        c.embed(LLM, ["x"], deadline_s=10)
    assert info.value.model == LLM and "cannot reach http://127.0.0.1:9/v1" in str(info.value)
    record = json.loads(caplog.records[-1].getMessage())
    assert (record["outcome"], record["attempts"], record["call"]) == ("Unavailable", 2, "embed")


# -- per-stage records ---------------------------------------------------------------------------------------------


def test_a_call_is_a_span_with_a_child_per_stage_and_one_log_line_without_content(caplog):
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    observer = Observer(provider)
    with caplog.at_level(logging.INFO, logger="llm_serving_client.calls"):
        with observer.call("chat", LLM, None, "chat-temperature", "cool") as call:
            with call.stage("preprocess"):
                pass
            with call.stage("network"):
                headers = call.headers({"x-llm-serving-experiment": "chat-temperature=cool"})
    spans = {s.name: s for s in exporter.get_finished_spans()}
    root = spans["llm_serving.chat demo-tiny"]
    assert {spans["preprocess"].parent.span_id, spans["network"].parent.span_id} == {root.context.span_id}
    version, trace_id, parent_id, flags = headers["traceparent"].split("-")
    # The server's parent is the span of the stage that sent the request, in the call's trace.
    assert (trace_id, int(parent_id, 16)) == (f"{root.context.trace_id:032x}", spans["network"].context.span_id)
    record = json.loads(caplog.records[-1].getMessage())
    assert record["trace_id"] == trace_id and set(record["stages"]) == {"preprocess", "network"}
    assert (record["model"], record["experiment"], record["arm"], record["outcome"]) == (
        LLM, "chat-temperature", "cool", "ok")
    assert set(record) == {"event", "call", "model", "version", "experiment", "arm", "outcome", "attempts",
                           "trace_id", "stages", "duration_s", "cache"}  # no prompt, no messages, no output


def test_log_lines_are_sampled_by_trace_id_and_errors_always_kept(caplog):
    observer = Observer(TracerProvider(), log_sample_rate=0.0)
    with caplog.at_level(logging.INFO, logger="llm_serving_client.calls"):
        with observer.call("embed", LLM, None):
            pass
        with pytest.raises(RuntimeError), observer.call("embed", LLM, None):
            raise RuntimeError("boom")
    records = [json.loads(r.getMessage()) for r in caplog.records if r.name == "llm_serving_client.calls"]
    assert [r["outcome"] for r in records] == ["RuntimeError"]


# -- the batch path's result cache ---------------------------------------------------------------------------------


def test_a_cached_batch_answer_is_read_before_any_call(tmp_path, caplog):
    from llm_serving.batch_cache import ResultCache
    from llm_serving.object_store import DirectoryStore

    cache = ResultCache(DirectoryStore(tmp_path / "batch"))
    messages = [{"role": "user", "content": "Say hello"}]
    request = {"model": LLM, "messages": messages, "max_tokens": 4, "temperature": 0}
    response = {"choices": [{"index": 0, "message": {"role": "assistant", "content": "hello there"},
                             "finish_reason": "length"}], "usage": {"prompt_tokens": 7, "completion_tokens": 4}}
    assert cache.put(LLM, "1.0.0", "/v1/chat/completions", request, response)  # what a batch wrote
    c = Client(parse_stack_outputs(document()), local=LocalEndpoints("http://127.0.0.1:9/v1", "127.0.0.1:9"),
               result_cache=cache, retry=RetryPolicy(max_attempts=1))
    with caplog.at_level(logging.INFO, logger="llm_serving_client.calls"):
        # Nothing listens on the remote address: the answer came from the cache.
        out = c.chat(LLM, messages, max_tokens=4, temperature=0, cached=True)
    assert (out.text, out.cached, out.completion_tokens) == ("hello there", True, 4)
    record = json.loads(caplog.records[-1].getMessage())
    assert record["cache"] == "hit" and set(record["stages"]) == {"cache"}
    # A sampled request is never cached: the call goes to the model (here: unreachable).
    with caplog.at_level(logging.INFO, logger="llm_serving_client.calls"), pytest.raises(Unavailable):
        c.chat(LLM, messages, max_tokens=4, temperature=0.7, cached=True, deadline_s=5)
    assert json.loads(caplog.records[-1].getMessage())["cache"].startswith("miss (not deterministic")
    with pytest.raises(ValueError, match="cached answers are whole answers"):
        c.chat(LLM, messages, stream=True, cached=True)
