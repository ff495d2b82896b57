"""What a request says about its caller, read the same by every front-end (serving_image/request_context.py), and the
KServe gRPC front-end's request record (serving_image/kserve/request_log.py). No server: the records of real requests
are checked against the shared server in test_client_remote.py."""

from __future__ import annotations

import json
import logging
from types import SimpleNamespace

import pytest

from serving_image.kserve.request_log import KServeRecord, metadata_dict
from serving_image.request_context import EXPERIMENT_REQUESTS, count_experiment, experiment_from, log_record

TRACEPARENT = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
REQUEST = SimpleNamespace(id="r-1", model_name="ranker", model_version="")


@pytest.mark.parametrize("value", ["Chat=cool", "chat-temperature", "chat=", "=cool", "chat=cool=warm",
                                   "chat temperature=cool"])
def test_a_malformed_arm_is_refused_naming_the_header(value):
    with pytest.raises(ValueError, match=r"header x-llm-serving-experiment: .* is not '<experiment>=<arm>'"):
        experiment_from(value)


def test_an_arm_is_read_and_counted():
    assert experiment_from(None) is None and experiment_from(" chat-temperature=cool ") == "chat-temperature=cool"
    series = EXPERIMENT_REQUESTS.labels("chat-temperature", "cool", "openai", "200")
    before = series._value.get()
    count_experiment("chat-temperature=cool", "openai", "200")
    count_experiment(None, "openai", "200")
    assert series._value.get() == before + 1


def test_the_kserve_record_carries_the_callers_trace_and_arm(caplog):
    metadata = metadata_dict([("traceparent", TRACEPARENT), ("X-LLM-Serving-Experiment", b"ranking=booster")])
    with caplog.at_level(logging.INFO, logger="llm_serving.kserve_requests"):
        record = KServeRecord.open("ModelInfer", REQUEST, metadata)
        record.response_left()
        record.close()
    line = json.loads(caplog.records[-1].getMessage())
    assert list(line) == ["rpc", "request_id", "model", "model_version", "trace_id", "experiment", "status",
                          "duration_s", "first_response_s", "last_response_s"]
    assert (line["trace_id"], line["experiment"], line["status"]) == ("4bf92f3577b34da6a3ce929d0e0e4736",
                                                                      "ranking=booster", "OK")
    assert 0 <= line["first_response_s"] <= line["last_response_s"] <= line["duration_s"]


def test_a_record_line_is_logged_as_logger_info_logs_it_and_percent_signs_stay(caplog):
    """log_record skips logging's caller lookup, not its rules: the logger's level decides, the handlers get an INFO
    record of the logger's name, and the line is not %-formatted (a record's JSON may hold a '%')."""
    logger = logging.getLogger("llm_serving.test_records")
    with caplog.at_level(logging.WARNING, logger=logger.name):
        log_record(logger, '{"a": 1}')
    assert not caplog.records
    with caplog.at_level(logging.INFO, logger=logger.name):
        log_record(logger, '{"prompt": "100% %s"}')
    [record] = caplog.records
    assert (record.name, record.levelno, record.getMessage()) == (logger.name, logging.INFO, '{"prompt": "100% %s"}')
    assert logging.Formatter("%(levelname)s %(name)s: %(message)s").format(record) == \
        'INFO llm_serving.test_records: {"prompt": "100% %s"}'


def test_a_kserve_record_without_context_says_null():
    record = KServeRecord.open("ModelStreamInfer", REQUEST, metadata_dict(None))
    assert (record.trace_id, record.experiment, record.first_response_s) == (None, None, None)
    with pytest.raises(ValueError, match="x-llm-serving-experiment"):
        KServeRecord.open("ModelInfer", REQUEST, {"x-llm-serving-experiment": "bad"})


def test_the_kserve_http_record_comes_from_the_path_the_headers_and_the_response(caplog):
    from fastapi import FastAPI
    from fastapi.responses import JSONResponse, StreamingResponse
    from fastapi.testclient import TestClient

    from serving_image.kserve.request_log import HttpRecordMiddleware

    app = FastAPI()
    app.add_middleware(HttpRecordMiddleware)

    @app.post("/v2/models/{model}/infer")
    async def infer(model: str):
        return JSONResponse({"model_name": model}, status_code=400 if model == "bad" else 200)

    @app.post("/v2/models/{model}/generate_stream")
    async def stream(model: str):
        async def events():
            for i in range(3):
                yield f"data: {i}\n\n".encode()
        return StreamingResponse(events(), media_type="text/event-stream")

    @app.get("/v2/models/{model}")
    async def metadata(model: str):
        return {"name": model}

    client = TestClient(app)
    with caplog.at_level(logging.INFO, logger="llm_serving.kserve_requests"):
        assert client.post("/v2/models/ranker/infer", headers={"traceparent": TRACEPARENT}).status_code == 200
        assert client.post("/v2/models/bad/infer").status_code == 400
        assert client.post("/v2/models/demo-tiny/generate_stream",
                           headers={"x-llm-serving-experiment": "chat-temperature=cool"}).text.count("data:") == 3
        client.get("/v2/models/ranker")  # not an inference request: no record
        refused = client.post("/v2/models/ranker/infer", headers={"x-llm-serving-experiment": "Bad Arm"})
    assert refused.status_code == 400 and "header x-llm-serving-experiment" in refused.json()["error"]
    records = [json.loads(r.getMessage()) for r in caplog.records if r.name == "llm_serving.kserve_requests"]
    assert [(r["rpc"], r["model"], r["status"], r["trace_id"], r["experiment"]) for r in records] == [
        ("POST infer", "ranker", "200", "4bf92f3577b34da6a3ce929d0e0e4736", None),
        ("POST infer", "bad", "400", None, None),
        ("POST generate_stream", "demo-tiny", "200", None, "chat-temperature=cool")]
    assert all(0 <= r["first_response_s"] <= r["last_response_s"] <= r["duration_s"] for r in records)
