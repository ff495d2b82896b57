"""The example Python-backend package (examples/ticket_triage) through real Triton: its own prompt template and
tokenizer-counted truncation, a streamed BLS call to the LLM model of the same server (the stand-in vllm backend),
and its post-processing into a typed record, driven by tritonclient, streaming and not.

The server is the session's (tests/serving/conftest.py): the startup procedure serves demo-tiny with ticket-triage
beside it (`--with-package`).
"""

from __future__ import annotations

import json
import queue
import sys

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient

from llm_serving.kserve_stream import until_final
from tests.serving.conftest import EXAMPLE

sys.path.insert(0, str(EXAMPLE / "model"))
from triage_record import CATEGORIES, SCHEMA, SUMMARY_MAX, RecordError, Triage  # noqa: E402
from triage_text import fit_to_budget, render_prompt, tokenize  # noqa: E402

pytestmark = pytest.mark.slow

MODEL = "ticket-triage"
BUDGET = 24  # config.pbtxt's ticket_token_budget


def _inputs(ticket: str, stream: bool | None = None):
    text = grpcclient.InferInput("ticket", [1], "BYTES")
    text.set_data_from_numpy(np.array([ticket.encode()], dtype=np.object_))
    inputs = [text]
    if stream is not None:
        flag = grpcclient.InferInput("stream", [1], "BOOL")
        flag.set_data_from_numpy(np.array([stream]))
        inputs.append(flag)
    return inputs


def _call(server, ticket: str, stream: bool | None = None) -> tuple[list, list]:
    got: queue.Queue = queue.Queue()
    client = grpcclient.InferenceServerClient(f"127.0.0.1:{server.ports['kserve_grpc']}")
    results, errors = [], []
    try:
        client.start_stream(callback=lambda result, error: got.put((result, error)))
        client.async_stream_infer(MODEL, _inputs(ticket, stream))
        for result, error in until_final(got, timeout=180):
            if error is not None:
                errors.append(error)
                break
            results.append(result)
        client.stop_stream()
    finally:
        client.close()
    return results, errors


def _record(result) -> Triage:
    return Triage(result.as_numpy("category")[0].decode(), int(result.as_numpy("priority")[0]),
                  result.as_numpy("summary")[0].decode())


# -- the model's own pieces (pure) ----------------------------------------------------------------------------


def test_own_tokenizer_and_budget():
    assert len(tokenize("Can't log in, error 403!")) == 9  # Can ' t log in , error 403 !
    short = fit_to_budget("  Printer is on fire.  ", BUDGET)
    assert short == type(short)("Printer is on fire.", 5, False)
    long = fit_to_budget(" ".join(f"w{i}" for i in range(40)), BUDGET)
    assert long.truncated and long.tokens == 40 and long.text.endswith("w23 ...")
    assert "Ticket: hello\n" in render_prompt("hello")


def test_record_parsing_is_typed_and_strict():
    assert Triage.parse('{"category":"billing","priority":2,"summary":"double  charge"}') == \
        Triage("billing", 2, "double charge")
    for bad in ('{"category":"weather","priority":2,"summary":""}', '{"category":"bug","priority":"2","summary":""}',
                '{"category":"bug","priority":9,"summary":""}', "not json"):
        with pytest.raises(RecordError):
            Triage.parse(bad)
    assert set(SCHEMA["properties"]["category"]["enum"]) == set(CATEGORIES)


# -- through Triton -------------------------------------------------------------------------------------------


def test_example_triages_a_ticket_in_one_response(triton_standalone):
    ticket = "My invoice was charged twice this month, please refund it"
    results, errors = _call(triton_standalone, ticket)
    assert not errors, [str(e) for e in errors]
    assert len(results) == 1
    result = results[0]
    record = _record(result)
    assert record == Triage.parse(result.as_numpy("text_output")[0].decode())  # the record is the LLM's JSON, typed
    assert record.category in CATEGORIES and 1 <= record.priority <= 5 and len(record.summary) <= SUMMARY_MAX
    assert result.as_numpy("priority").dtype == np.int32
    assert int(result.as_numpy("ticket_tokens")[0]) == len(tokenize(ticket)) == 11
    assert not bool(result.as_numpy("truncated")[0])


def test_example_streams_its_llm_call_then_the_record(triton_standalone):
    """python-backend-api: a decoupled Python model streaming a BLS call (InferenceRequest.exec(decoupled=True)) to
    the stand-in vllm backend, both in the same real Triton."""
    ticket = " ".join(f"word{i}" for i in range(60))
    results, errors = _call(triton_standalone, ticket, stream=True)
    assert not errors, [str(e) for e in errors]
    assert len(results) >= 3, "the LLM's text is forwarded as it arrives, then the record"
    *chunks, last = results
    streamed = "".join(r.as_numpy("text_output")[0].decode() for r in chunks)
    assert _record(last) == Triage.parse(streamed)
    assert bool(last.as_numpy("truncated")[0]) and int(last.as_numpy("ticket_tokens")[0]) == 60


def test_example_answers_http_clients_and_refuses_an_empty_ticket(triton_standalone):
    client = httpclient.InferenceServerClient(f"127.0.0.1:{triton_standalone.ports['kserve_http']}")
    try:
        config = client.get_model_config(MODEL)
        assert config["backend"] == "python" and config["model_transaction_policy"] == {"decoupled": True}
        assert client.is_model_ready(MODEL)
    finally:
        client.close()
    results, errors = _call(triton_standalone, "   ")
    assert not results and "input 'ticket' is empty" in str(errors[0])
    check = grpcclient.InferenceServerClient(f"127.0.0.1:{triton_standalone.ports['kserve_grpc']}")
    try:
        assert check.is_model_ready(MODEL) and check.is_model_ready("demo-tiny")
    finally:
        check.close()
    assert json.loads(json.dumps(SCHEMA))  # the schema the LLM is constrained to is plain JSON
