"""The client library against the shared `openai`-mode server (tests/serving/conftest.py `openai_server`: the demo LLM
with its embed and score tasks on the OpenAI port, the ranker and its pipeline on KServe gRPC 8001): every kind of
call answers as the same call through the bare SDKs does, errors name the model, version and field, an experiment's
arm reaches the request, and one trace id joins the caller's record to the server's request record."""

from __future__ import annotations

import json
import logging
import os
import re
import subprocess
import sys
import time

import httpx
import numpy as np
import openai
import pytest
import tritonclient.grpc as grpcclient
from tritonclient.utils import InferenceServerException

from examples import kserve_client
from llm_serving.stack_outputs import parse_stack_outputs
from llm_serving_client import Client, InvalidRequest, LocalEndpoints
from tests.serving.client_outputs import FEATURES, LLM, PIPELINE, RANKER, document
from tests.serving.conftest import OPENAI_KEY

pytestmark = pytest.mark.slow

MESSAGES = [{"role": "user", "content": "Say hello"}]


@pytest.fixture(scope="module")
def lib(openai_server):
    client = Client(parse_stack_outputs(document()), api_key=OPENAI_KEY, timeout_s=120,
                    local=LocalEndpoints(f"{openai_server.url}/v1",
                                         f"127.0.0.1:{openai_server.ports['kserve_grpc']}"))
    yield client
    client.close()


@pytest.fixture(scope="module")
def grpc(openai_server):
    channel = grpcclient.InferenceServerClient(f"127.0.0.1:{openai_server.ports['kserve_grpc']}")
    yield channel
    channel.close()


def server_records(server) -> list[dict]:
    return [json.loads(line.split("llm_serving.requests: ", 1)[1]) for line in server.log().splitlines()
            if "llm_serving.requests: " in line]


def test_tensor_inference_answers_as_tritonclient_does(lib, grpc):
    rows = kserve_client.feature_rows(5)
    scores = lib.infer(RANKER, {"features": rows}, version="1.0.0")
    assert list(scores) == ["score"]
    np.testing.assert_array_equal(scores["score"], kserve_client.rank(grpc, rows))
    pipeline = lib.infer(PIPELINE, {"raw": rows})
    direct = kserve_client.pipeline(grpc, rows)
    assert sorted(pipeline) == sorted(direct)
    for name in direct:
        np.testing.assert_array_equal(pipeline[name], direct[name])


def test_a_wrong_tensor_is_named_from_the_models_own_metadata(lib):
    with pytest.raises(InvalidRequest) as info:
        lib.infer(RANKER, {"features": np.zeros((2, 8), np.float64)}, version="1.0.0")
    assert (info.value.model, info.value.version, info.value.field) == (RANKER, "1.0.0", "features")
    assert "is FP64 (float64); the model takes FP32" in str(info.value)
    with pytest.raises(InvalidRequest, match="field 'rank': is not an output of the model"):
        lib.infer(RANKER, {"features": np.zeros((2, 8), np.float32)}, version="1.0.0", outputs=["rank"])


def test_generation_streamed_and_not_agree(lib):
    whole = lib.chat(LLM, MESSAGES, max_tokens=8, temperature=0)
    assert whole.completion_tokens == 8 and whole.finish_reason == "length" and whole.text
    stream = lib.chat(LLM, MESSAGES, max_tokens=8, temperature=0, stream=True)
    deltas = list(stream)
    assert len(deltas) > 1 and "".join(deltas) == stream.text == whole.text
    assert stream.finish_reason == "length"


def test_response_format_and_the_constraint_extension_reach_the_server(lib):
    out = lib.chat(LLM, MESSAGES, max_tokens=120, response_format={
        "type": "json_schema", "json_schema": {"name": "hello", "schema": {
            "type": "object", "properties": {"greeting": {"type": "string", "maxLength": 12}},
            "required": ["greeting"], "additionalProperties": False}}})
    assert set(json.loads(out.text)) == {"greeting"}
    # A constraint the server validates: a malformed one is refused naming the field, before the engine.
    with pytest.raises(InvalidRequest) as info:
        lib.chat(LLM, MESSAGES, max_tokens=4, constraint={"kind": "allowed_tokens", "tokens": "five"})
    assert info.value.model == LLM and "constraint" in str(info.value)
    allowed = lib.chat(LLM, MESSAGES, max_tokens=4, constraint={"kind": "allowed_tokens", "tokens": [5, 7, 9]})
    assert 1 <= allowed.completion_tokens <= 4


def test_a_refused_field_is_named(lib):
    with pytest.raises(InvalidRequest) as info:
        lib.chat(LLM, MESSAGES, max_tokens=4, n=0)
    assert info.value.model == LLM and info.value.field == "n"


def test_embeddings_and_scores(lib, openai_client):
    vectors = lib.embed(LLM, ["the platform", "a ranker"])
    direct = openai_client.embeddings.create(model=LLM, input=["the platform", "a ranker"])
    assert vectors == [d.embedding for d in direct.data]
    scores = lib.score(LLM, "The capital of France is", [" Paris", " a banana"])
    assert len(scores) == 2 and all(s <= 0 for s in scores)


def test_one_trace_id_joins_the_callers_stages_and_the_servers_record(lib, openai_server, caplog):
    with caplog.at_level(logging.INFO, logger="llm_serving_client.calls"):
        result = lib.chat(LLM, MESSAGES, max_tokens=4)
    caller = json.loads(caplog.records[-1].getMessage())
    assert caller["trace_id"] == result.trace_id and {"network", "postprocess"} <= set(caller["stages"])
    record = wait_for(server_records, openai_server, result.trace_id)
    assert (record["model"], record["status"], record["completion_tokens"]) == (LLM, 200, 4)


def test_an_experiments_arm_sets_its_parameters_and_is_counted(lib):
    units = {lib.experiments.assign("chat-temperature", f"user-{i}", "s").arm.name: f"user-{i}" for i in range(40)}
    before = {arm: s.calls for arm, s in lib.experiment_stats("chat-temperature").items()}
    for arm, unit in sorted(units.items()):
        out = lib.chat(experiment="chat-temperature", unit=unit, messages=MESSAGES, max_tokens=4)
        assert out.arm == arm and out.completion_tokens == 4
    stats = lib.experiment_stats("chat-temperature")
    assert {arm: s.calls - before[arm] for arm, s in stats.items()} == {"control": 1, "cool": 1}
    assert all(s.errors == 0 and s.quantile(0.99) is not None for s in stats.values())
    # A unit keeps its arm: the same unit, again, the same arm.
    again = lib.chat(experiment="chat-temperature", unit=units["cool"], messages=MESSAGES, max_tokens=2)
    assert again.arm == "cool"


def kserve_records(server) -> list[dict]:
    return [json.loads(line.split("llm_serving.kserve_requests: ", 1)[1]) for line in server.log().splitlines()
            if "llm_serving.kserve_requests: " in line]


def wait_for(records, server, trace_id: str) -> dict:
    deadline = time.monotonic() + 30  # a record is written when its request ends, after the answer left
    while True:
        found = [r for r in records(server) if r["trace_id"] == trace_id]
        if found:
            return found[0]
        assert time.monotonic() < deadline, f"no server record carries trace id {trace_id}"
        time.sleep(0.1)


def experiment_count(server, **labels: str) -> float:
    body = httpx.get(server.metrics_url, timeout=10).text
    total = 0.0
    for match in re.finditer(r"^llm_serving_experiment_requests_total\{([^}]*)\} (\S+)$", body, re.M):
        series = dict(re.findall(r'(\w+)="([^"]*)"', match.group(1)))
        if all(series.get(k) == v for k, v in labels.items()):
            total += float(match.group(2))
    return total


def test_one_trace_id_joins_a_kserve_call_to_the_kserve_record(lib, openai_server, caplog):
    with caplog.at_level(logging.INFO, logger="llm_serving_client.calls"):
        lib.infer(RANKER, {"features": kserve_client.feature_rows(3)}, version="1.0.0")
    caller = json.loads(caplog.records[-1].getMessage())
    assert {"preprocess", "serialise", "network", "postprocess"} <= set(caller["stages"])
    record = wait_for(kserve_records, openai_server, caller["trace_id"])
    assert (record["rpc"], record["model"], record["status"], record["experiment"]) == ("ModelInfer", RANKER, "OK",
                                                                                         None)
    assert 0 <= record["first_response_s"] <= record["last_response_s"] <= record["duration_s"]


def test_the_arm_reaches_the_servers_records_and_metrics(lib, openai_server, caplog):
    unit = next(f"user-{i}" for i in range(100)
                if lib.experiments.assign("chat-temperature", f"user-{i}", "s").arm.name == "cool")
    labels = {"experiment": "chat-temperature", "arm": "cool", "protocol": "openai", "status": "200"}
    before = experiment_count(openai_server, **labels)
    out = lib.chat(experiment="chat-temperature", unit=unit, messages=MESSAGES, max_tokens=2)
    assert wait_for(server_records, openai_server, out.trace_id)["experiment"] == "chat-temperature=cool"
    assert experiment_count(openai_server, **labels) == before + 1
    # Over KServe: the arm that calls the ranker at its pinned version.
    unit = next(f"req-{i}" for i in range(100)
                if lib.experiments.assign("ranking", f"req-{i}", "s").arm.name == "booster")
    with caplog.at_level(logging.INFO, logger="llm_serving_client.calls"):
        lib.infer(experiment="ranking", unit=unit, inputs={"features": kserve_client.feature_rows(2)})
    caller = json.loads(caplog.records[-1].getMessage())
    assert (caller["arm"], caller["model"], caller["version"]) == ("booster", RANKER, "1.0.0")
    assert wait_for(kserve_records, openai_server, caller["trace_id"])["experiment"] == "ranking=booster"
    assert experiment_count(openai_server, experiment="ranking", arm="booster", protocol="kserve_grpc",
                            status="OK") >= 1


def test_a_malformed_arm_header_is_refused_naming_it(openai_client, grpc):
    with pytest.raises(openai.BadRequestError) as info:
        openai_client.chat.completions.create(model=LLM, messages=MESSAGES, max_tokens=1,
                                              extra_headers={"x-llm-serving-experiment": "Chat Temperature"})
    assert "header x-llm-serving-experiment: 'Chat Temperature' is not '<experiment>=<arm>'" in str(info.value)
    features = grpcclient.InferInput("features", [1, 8], "FP32")
    features.set_data_from_numpy(kserve_client.feature_rows(1))
    with pytest.raises(InferenceServerException) as error:
        grpc.infer(RANKER, [features], headers={"x-llm-serving-experiment": "no-arm"})
    assert "INVALID_ARGUMENT" in str(error.value.status()) and "x-llm-serving-experiment" in error.value.message()


def test_in_process_and_remote_answers_are_the_same(openai_server):
    """The pipeline's first step, a Python-backend model the document marks inProcess: loaded here from the very
    package the shared server serves, it answers as the server's Triton does, bit for bit."""
    from llm_serving.package import open_package

    package = next(p for p in openai_server.companions if open_package(p).manifest.model.id == FEATURES)
    outputs = parse_stack_outputs(document())
    local = LocalEndpoints(f"{openai_server.url}/v1", f"127.0.0.1:{openai_server.ports['kserve_grpc']}")
    remote, here = Client(outputs, api_key=OPENAI_KEY, local=local), Client(outputs, api_key=OPENAI_KEY, local=local)
    here.load_in_process(FEATURES, "1.0.0", package)
    try:
        rng = np.random.default_rng(7)
        for rows in (1, 5, 64):
            raw = rng.gamma(2.0, 30.0, size=(rows, 8)).astype(np.float32)
            expected = remote.infer(FEATURES, {"raw": raw})["features"]
            np.testing.assert_array_equal(here.infer(FEATURES, {"raw": raw})["features"], expected)
    finally:
        remote.close()
        here.close()


def test_the_xgboost_ranker_in_process_equals_remote(openai_server):
    """The ranker itself (xgboost 3.0.5 and scipy, the package's declared dependencies, which the Makefile installs
    into .venv-serving as the stub gets them), marked inProcess: loaded from the package the shared server serves,
    its scores equal the server's, bit for bit (the same booster and xgboost; this process's numpy is vLLM's, the
    stub's is 1.26.4)."""
    from llm_serving.package import open_package

    package = next(p for p in openai_server.companions if open_package(p).manifest.model.id == RANKER)
    raw = document()
    raw["models"][RANKER]["inProcess"] = {"versions": {"1.0.0": {
        "package": "s3://acme-llm-dev-us-east-1/models/model-cache/ranker/1.0.0/",
        "ioFingerprint": open_package(package).manifest.model.io_fingerprint}}}
    outputs = parse_stack_outputs(raw)
    local = LocalEndpoints(f"{openai_server.url}/v1", f"127.0.0.1:{openai_server.ports['kserve_grpc']}")
    remote, here = Client(outputs, api_key=OPENAI_KEY, local=local), Client(outputs, api_key=OPENAI_KEY, local=local)
    here.load_in_process(RANKER, "1.0.0", package)
    try:
        rng = np.random.default_rng(11)
        for rows in (1, 5, 64):
            features = rng.normal(size=(rows, 8)).astype(np.float32)
            expected = remote.infer(RANKER, {"features": features}, version="1.0.0")["score"]
            got = here.infer(RANKER, {"features": features}, version="1.0.0")["score"]
            assert got.dtype == expected.dtype == np.float32 and got.shape == (rows, 1)
            np.testing.assert_array_equal(got, expected)
    finally:
        remote.close()
        here.close()


def test_the_consumer_service_runs_end_to_end(openai_server, tmp_path, capsys):
    """examples/consumer/service.py, the example client service, as a user runs it against a local server: streamed
    and JSON generation, the ranker remotely, the pipeline's step in-process and remotely, an experiment."""
    from examples.consumer import service
    from llm_serving.package import open_package

    outputs = tmp_path / "stack-outputs.json"
    outputs.write_text(json.dumps(document()))
    package = next(p for p in openai_server.companions if open_package(p).manifest.model.id == FEATURES)
    summary = service.main(["--outputs", str(outputs), "--api-key", OPENAI_KEY,
                            "--local-openai", f"{openai_server.url}/v1",
                            "--local-grpc", f"127.0.0.1:{openai_server.ports['kserve_grpc']}",
                            "--llm", LLM, "--ranker", RANKER, "--ranker-version", "1.0.0",
                            "--in-process", f"{FEATURES}=1.0.0={package}", "--experiment", "chat-temperature",
                            "--units", "6"])
    assert summary["streamed"]["deltas"] > 1 and summary["streamed"]["finish_reason"] == "length"
    assert set(summary["json"]) == {"greeting"}
    assert len(summary["ranker"]) == 4
    assert summary["in_process"][FEATURES] == {"equal": True, "outputs": ["features"]}
    assert sum(arm["calls"] for arm in summary["experiment"].values()) == 6
    assert all(arm["errors"] == 0 for arm in summary["experiment"].values())
    assert json.loads(capsys.readouterr().out) == summary


def test_one_trace_id_joins_a_kserve_http_call_to_its_record(openai_server):
    import tritonclient.http as httpclient

    trace_id = "0af7651916cd43dd8448eb211c80319c"
    http = httpclient.InferenceServerClient(f"127.0.0.1:{openai_server.ports['kserve_http']}")
    try:
        features = httpclient.InferInput("features", [2, 8], "FP32")
        features.set_data_from_numpy(kserve_client.feature_rows(2))
        http.infer(RANKER, [features], headers={"traceparent": f"00-{trace_id}-b7ad6b7169203331-01",
                                                 "x-llm-serving-experiment": "ranking=booster"})
    finally:
        http.close()
    record = wait_for(kserve_records, openai_server, trace_id)
    assert (record["rpc"], record["model"], record["status"], record["experiment"]) == (
        "POST infer", RANKER, "200", "ranking=booster")


def test_the_consumer_service_discovers_a_local_server(openai_server, tmp_path, capsys):
    """Where no stack exists (`make up`), the service asks the server for its document
    (llm_serving_client.local): the LLM the OpenAI port lists at the version its front-end names, the ranker and the
    pipeline with their kinds, the in-process models (the XGBoost ranker and the pipeline's first step), the demo
    experiment on the LLM and the batch block. With --read-cache it runs a batch through the Batch API (a worker
    runs beside the server, as make up's does) and reads its answers back from the server's batch store."""
    from examples.consumer import service
    from llm_serving.package import open_package
    from llm_serving.pod_contract import ENV_BATCH_WORKER_API_KEY
    from llm_serving_client.local import describe_local_server

    grpc_target = f"127.0.0.1:{openai_server.ports['kserve_grpc']}"
    described = parse_stack_outputs(describe_local_server(f"{openai_server.url}/v1", grpc_target,
                                                          api_key=OPENAI_KEY, demo_experiment_on=LLM))
    assert {m: o.kind for m, o in described.models.items()} == {
        LLM: "vllm", RANKER: "python", PIPELINE: "ensemble", FEATURES: "python", "ranker-relevance": "python"}
    ready = httpx.get(f"{openai_server.url}/health/ready", timeout=10).json()
    assert described.models[LLM].active_version == ready["version"]  # what the batch worker caches under
    assert described.batch is not None
    packages = {open_package(p).manifest.model.id: p for p in openai_server.companions}
    log = (tmp_path / "batch-worker.log").open("w")
    worker = subprocess.Popen([sys.executable, "-m", "serving_image.batch.worker", "--store",
                               str(openai_server.batch_store), "--endpoint", openai_server.url, "--poll-s", "0.2"],
                              env=dict(os.environ, **{ENV_BATCH_WORKER_API_KEY: OPENAI_KEY}), stdout=log,
                              stderr=subprocess.STDOUT)
    try:
        summary = service.main(["--api-key", OPENAI_KEY, "--local-openai", f"{openai_server.url}/v1",
                                "--local-grpc", grpc_target, "--discover-local", "--llm", LLM, "--ranker", RANKER,
                                "--in-process", f"{RANKER}={packages[RANKER]}",
                                "--in-process", f"{FEATURES}={packages[FEATURES]}",
                                "--experiment", "demo-temperature", "--units", "4",
                                "--read-cache", "--local-batch-store", str(openai_server.batch_store)])
    finally:
        worker.terminate()
        worker.wait(timeout=60)
        log.close()
    assert summary["stack"] == "local"
    assert summary["in_process"] == {RANKER: {"equal": True, "outputs": ["score"]},
                                     FEATURES: {"equal": True, "outputs": ["features"]}}
    assert sum(arm["calls"] for arm in summary["experiment"].values()) == 4 and len(summary["ranker"]) == 4
    cached = summary["cached"]
    assert [(a["hit"], a["equal"]) for a in cached["answers"]] == [(True, True)] * len(service.BATCH_PROMPTS)
    assert all(a["text"] for a in cached["answers"]) and cached["miss"]["hit"] is False
    capsys.readouterr()
