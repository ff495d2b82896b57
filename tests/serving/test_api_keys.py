"""The pod's own check of a caller's key (docs/architecture.md §3.12) on every serving port.

Fast tests: where the keys come from and that a missing one fails closed (serving_image/openai_api/admission.py), the
KServe HTTP middleware (serving_image/kserve/auth.py) on a real ASGI app, and the KServe gRPC check as the C++
front-end runs it per call (native/triton/kserve_grpc.cpp, through its binding). The slow test starts a server as a
pod starts it (LLM_SERVING_REQUIRE_API_KEYS=1, the keys a Secret volume's directory) and calls its three ports with
the official clients: `openai`, and tritonclient's HTTP and gRPC.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import httpx
import pytest
from fastapi import FastAPI

from llm_serving import pod_contract as pc
from serving_image.kserve.auth import BearerKeyMiddleware
from serving_image.openai_api.admission import APIConfig, load_api_keys

KEYS = ("k-one", "k-two")


def _secret_volume(root: Path, entries: dict[str, str]) -> Path:
    """A directory laid out as the kubelet writes a Secret volume: the data under a timestamped directory, `..data`
    pointing at it, one link per entry."""
    data = root / "..2026_01_01_00_00_00.000000000"
    data.mkdir(parents=True)
    for name, value in entries.items():
        (data / name).write_text(value)
    (root / "..data").symlink_to(data.name)
    for name in entries:
        (root / name).symlink_to(f"..data/{name}")
    return root


def test_a_secret_volume_gives_one_key_per_client(tmp_path):
    volume = _secret_volume(tmp_path / "keys", {"team-a": "k-one\n", "chat-batch-worker": "k-two"})
    keys, required = load_api_keys({pc.ENV_API_KEYS_FILE: str(volume), pc.ENV_REQUIRE_API_KEYS: "1"})
    assert sorted(keys) == sorted(KEYS) and required


@pytest.mark.parametrize("case", ["missing", "empty-file", "empty-dir", "blank-variable"])
def test_a_named_key_file_that_gives_no_key_refuses_the_start(tmp_path, case):
    path = tmp_path / "keys"
    if case == "empty-file":
        path.write_text("# no key yet\n\n")
    elif case == "empty-dir":
        path.mkdir()
    value = "  " if case == "blank-variable" else str(path)
    with pytest.raises(ValueError, match=pc.ENV_API_KEYS_FILE):
        APIConfig.from_env({pc.ENV_API_KEYS_FILE: value})


def test_required_keys_that_nothing_gives_refuse_the_start():
    with pytest.raises(ValueError, match=f"{pc.ENV_REQUIRE_API_KEYS}=1 but no API key"):
        load_api_keys({pc.ENV_REQUIRE_API_KEYS: "1"})
    with pytest.raises(ValueError, match="expected 1 or 0"):
        load_api_keys({pc.ENV_REQUIRE_API_KEYS: "yes", pc.ENV_API_KEYS: "k"})


def test_without_the_flag_a_local_run_may_go_without_keys():
    assert load_api_keys({}) == ((), False)
    assert APIConfig.from_env({pc.ENV_API_KEYS: "a, b"}).api_keys == ("a", "b")


def _kserve_app(keys=KEYS) -> FastAPI:
    app = FastAPI()

    @app.get("/v2/health/ready")
    async def ready():
        return {}

    @app.get("/v2/health/live")
    async def live():
        return {}

    @app.post("/v2/models/{model}/infer")
    async def infer(model: str):
        return {"model_name": model}

    app.add_middleware(BearerKeyMiddleware, api_keys=keys)
    return app


async def _call(app, method, path, headers=None):
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://pod") as client:
        return await client.request(method, path, headers=headers or {})


@pytest.mark.parametrize(("headers", "status", "words"), [
    ({}, 401, "missing API key"),
    ({"Authorization": "Basic k-one"}, 401, "missing API key"),
    ({"Authorization": "Bearer nope"}, 401, "incorrect API key"),
    ({"Authorization": "Bearer k-two"}, 200, "demo"),
    ({"authorization": "bearer k-one"}, 200, "demo"),
])
def test_kserve_http_answers_only_a_caller_with_a_key(headers, status, words):
    answer = asyncio.run(_call(_kserve_app(), "POST", "/v2/models/demo/infer", headers))
    assert answer.status_code == status and words in answer.text, answer.text
    if status == 401:
        assert answer.headers["www-authenticate"] == "Bearer"


@pytest.mark.parametrize("path", [pc.READY_PATH, pc.LIVE_PATH])
def test_kserve_http_probes_need_no_key(path):
    assert asyncio.run(_call(_kserve_app(), "GET", path)).status_code == 200


def test_the_middleware_refuses_to_run_without_keys():
    with pytest.raises(ValueError, match="without a key"):
        BearerKeyMiddleware(FastAPI(), ())


def test_kserve_grpc_checks_the_key_as_the_cpp_front_end_does():
    from serving_image.triton.capi import _response_path

    check = _response_path.KServeGrpc.authorization_error
    assert check(list(KEYS), "Bearer k-two") == ""
    assert check(list(KEYS), "bearer  k-one ") == ""
    assert "missing API key" in check(list(KEYS), None)
    assert "missing API key" in check(list(KEYS), "k-one")
    assert "incorrect API key" in check(list(KEYS), "Bearer k-one-and-more")
    assert check([], None) == ""  # no keys given: the server was started without the check (a local run)


@pytest.mark.slow
def test_a_pod_checks_the_key_on_every_serving_port(demo_model_dir, tmp_path):
    """A server started as a model pod starts (keys required, from a Secret volume): the OpenAI port, KServe HTTP
    and KServe gRPC each refuse a caller without a key and serve one with it; the probes and metrics stay open."""
    import openai
    import tritonclient.grpc as grpcclient
    import tritonclient.http as httpclient
    from tritonclient.utils import InferenceServerException

    from bench.local_server import publish_demo, start_server
    from tests.serving.engine_args import EAGER_ENGINE_ARGS

    volume = _secret_volume(tmp_path / "api-keys", {"client": "pod-key"})
    server = start_server(publish_demo(demo_model_dir, tmp_path, engine_args=EAGER_ENGINE_ARGS), tmp_path / "server",
                          extra_env={pc.ENV_API_KEYS_FILE: str(volume), pc.ENV_REQUIRE_API_KEYS: "1"})
    try:
        ports = server.ports
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=f"{server.url}/v1", api_key="wrong", max_retries=0).models.list()
        assert openai.OpenAI(base_url=f"{server.url}/v1", api_key="pod-key", max_retries=0).models.list().data
        http_url = f"127.0.0.1:{ports['kserve_http']}"
        assert httpx.get(f"http://{http_url}{pc.READY_PATH}").status_code == 200
        assert httpx.get(f"http://{http_url}/v2").status_code == 401
        assert httpclient.InferenceServerClient(http_url).get_server_metadata(
            headers={"Authorization": "Bearer pod-key"})["name"]
        grpc_url = f"127.0.0.1:{ports['kserve_grpc']}"
        grpc = grpcclient.InferenceServerClient(grpc_url)
        assert grpc.is_server_ready()  # health: open
        with pytest.raises(InferenceServerException, match="UNAUTHENTICATED|missing API key"):
            grpc.get_server_metadata()
        with pytest.raises(InferenceServerException, match="UNAUTHENTICATED|incorrect API key"):
            grpc.get_model_metadata("demo-tiny", headers={"authorization": "Bearer wrong"})
        assert grpc.get_model_metadata("demo-tiny", headers={"authorization": "Bearer pod-key"}).name == "demo-tiny"
        assert httpx.get(server.metrics_url).status_code == 200
    finally:
        server.kill()


@pytest.mark.slow
def test_a_pod_whose_key_secret_is_empty_refuses_to_start(demo_model_dir, tmp_path):
    from bench.local_server import publish_demo, start_server
    from tests.serving.engine_args import EAGER_ENGINE_ARGS

    empty = tmp_path / "api-keys"
    empty.mkdir()
    with pytest.raises(AssertionError, match="server exited with 2") as refused:
        start_server(publish_demo(demo_model_dir, tmp_path, engine_args=EAGER_ENGINE_ARGS), tmp_path / "server",
                     extra_env={pc.ENV_API_KEYS_FILE: str(empty), pc.ENV_REQUIRE_API_KEYS: "1"})
    assert "the key directory holds no key file" in str(refused.value)
