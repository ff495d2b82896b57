"""A Python-backend package served as written by real Triton through the startup procedure (standalone mode), and
when Triton opens its ports.

The package's model.py imports a helper module carried beside it in the package and runs with the real
triton_python_backend_utils (the stub's numpy < 2). Its `initialize` blocks until the test releases it: while the
model is held loading, tritonserver (explicit model control, `--load-model`) has bound neither HTTP nor gRPC, so
the gRPC port is closed until the model is ready without anything in front of it. No vLLM here: this server starts
in seconds.
"""

from __future__ import annotations

import re
import signal
import time
from pathlib import Path

import numpy as np
import psutil
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient

from bench.local_server import PORT_NAMES, Server, local_startup_argv
from llm_serving.manifest import Backend, ServingMode
from llm_serving.package import PackageSpec, build_package
from llm_serving.ports import accepts, free_port
from tests.serving.engine_args import EAGER_ENGINE_ARGS

pytestmark = pytest.mark.slow

MODEL_PY = '''
import os
import time

import numpy as np
import triton_python_backend_utils as pb_utils
from shout import shout


class TritonPythonModel:
    def initialize(self, args):
        hold = os.environ["TEST_HOLD_DIR"]
        open(os.path.join(hold, "loading"), "w").close()
        while not os.path.exists(os.path.join(hold, "release")):
            time.sleep(0.05)

    def execute(self, requests):
        responses = []
        for request in requests:
            text = pb_utils.get_input_tensor_by_name(request, "text").as_numpy().reshape(-1)
            out = np.array([shout(v.decode()).encode() for v in text], dtype=np.object_)
            responses.append(pb_utils.InferenceResponse([pb_utils.Tensor("shouted", out),
                                                         pb_utils.Tensor("numpy", np.array([np.__version__.encode()],
                                                                                           dtype=np.object_))]))
        return responses
'''
HELPER_PY = "def shout(text):\n    return text.upper() + '!'\n"
CONFIG = '''
backend: "python"
max_batch_size: 0
input [ { name: "text" data_type: TYPE_STRING dims: [ -1 ] } ]
output [ { name: "shouted" data_type: TYPE_STRING dims: [ -1 ] }, { name: "numpy" data_type: TYPE_STRING dims: [ 1 ] } ]
'''


@pytest.fixture(scope="module")
def held(tmp_path_factory):
    """The startup procedure on the package, its model held in `initialize` until the test creates `release`."""
    import os
    import subprocess

    root = tmp_path_factory.mktemp("python-package")
    source = root / "src"
    source.mkdir()
    (source / "model.py").write_text(MODEL_PY)
    (source / "shout.py").write_text(HELPER_PY)
    (root / "config.pbtxt").write_text(CONFIG)
    package = build_package(PackageSpec(None, "shouter", "1.0.0", backend=Backend.PYTHON, python_model=source,
                                        config_pbtxt=root / "config.pbtxt", serving_mode=ServingMode.STANDALONE),
                            root / "pkg")
    hold = root / "hold"
    hold.mkdir()
    work = root / "work"
    work.mkdir()
    ports = {name: free_port() for name in PORT_NAMES}
    log_path = work / "server.log"
    with open(log_path, "w") as log:
        proc = subprocess.Popen(
            local_startup_argv(package, work / "run", ports),
            stdout=log, stderr=subprocess.STDOUT, env=dict(os.environ, TEST_HOLD_DIR=str(hold),
                                                           LLM_SERVING_DRAIN_DELAY_S="0"),
            start_new_session=True)
    server = Server(proc, log_path, ports, work)
    try:
        yield server, hold
    finally:
        server.kill()


def _wait_for(condition, what: str, server: Server, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert server.proc.poll() is None, f"server exited {server.proc.returncode}:\n{server.log()[-4000:]}"
        assert time.monotonic() < deadline, f"{what} did not happen:\n{server.log()[-4000:]}"
        time.sleep(0.05)


def test_ports_stay_closed_while_the_model_loads(held):
    """ports-after-load: measured on tritonserver 2.51, relied on by the startup procedure (§3.7 step 5)."""
    server, hold = held
    _wait_for(lambda: (hold / "loading").exists(), "the model's initialize", server)
    # The model is held in initialize: Triton is running and loading, and has opened no port.
    triton = [p for p in psutil.Process(server.proc.pid).children() if p.name() == "tritonserver"]
    assert len(triton) == 1 and triton[0].is_running()
    assert not accepts(server.ports["kserve_grpc"]) and not accepts(server.ports["kserve_http"])
    assert "start-engine: done" not in server.log()
    (hold / "release").touch()
    _wait_for(lambda: "startup complete" in server.log(), "startup", server)
    assert accepts(server.ports["kserve_grpc"]) and accepts(server.ports["kserve_http"])
    assert "shouter 1.0.0 (python)" in server.log()


def test_python_package_runs_as_written(held):
    """The package's model.py with its helper module, the real triton_python_backend_utils, the stub's numpy < 2,
    over gRPC and HTTP (a non-decoupled model: unary inference)."""
    server, _hold = held
    grpc = grpcclient.InferenceServerClient(f"127.0.0.1:{server.ports['kserve_grpc']}")
    http = httpclient.InferenceServerClient(f"127.0.0.1:{server.ports['kserve_http']}")
    try:
        for module, client in ((grpcclient, grpc), (httpclient, http)):
            text = module.InferInput("text", [2], "BYTES")
            text.set_data_from_numpy(np.array([b"hello", "gr\u00fc\u00df".encode()], dtype=np.object_))
            result = client.infer("shouter", [text])
            assert [v.decode() for v in result.as_numpy("shouted")] == ["HELLO!", "GR\u00dcSS!"]
            assert result.as_numpy("numpy")[0].decode().startswith("1.")
    finally:
        grpc.close()
        http.close()


def test_sigterm_closes_every_port(held):
    server, _hold = held
    assert server.stop(signal.SIGTERM, timeout=120) == 0, server.log()[-3000:]
    for name in ("kserve_http", "kserve_grpc", "metrics", "triton_metrics"):
        assert not accepts(server.ports[name]), name
    assert Path(server.log_path).exists()


# -- the stand-in vllm backend when its engine dies (vLLM's engine core killed under the standalone tritonserver) -


def test_a_dead_engine_is_unavailable_not_a_client_error_and_startup_exits(demo_model_dir, tmp_path):
    """vLLM's engine core and worker (children of the stub that runs the engine) are killed while a request
    streams: that request and the next get UNAVAILABLE ("Model is unavailable due to unhealthy vLLM engine", never
    a client error), the backend unloads its model as NVIDIA's health check does, and the startup procedure sees the
    model not ready and exits with status 1 so that the container restarts. The engine is held (SIGSTOP) from the
    first response to the kill, and the stream asks for seconds of engine work (1900 tokens), so it cannot finish
    before the hold, however loaded the machine."""
    import asyncio

    import grpc
    import httpx
    import tritonclient.grpc.aio as grpcaio

    from bench.local_server import start_standalone_server
    from tests.serving.engine_hold import EngineProcesses, submitted

    # 1900 tokens: seconds of engine work even on a fast machine, so that the stream cannot finish between its first
    # token leaving the server and this test reading it and holding the engine (the only window the hold leaves; with
    # 50 tokens a loaded CI machine read the first token after the last was made).
    package = build_package(PackageSpec(demo_model_dir, "demo-tiny", "1.0.0", engine_args=EAGER_ENGINE_ARGS,
                                        serving_mode=ServingMode.STANDALONE), tmp_path / "pkg")
    server = start_standalone_server(package, tmp_path / "work", extra_env={"LLM_SERVING_DRAIN_DELAY_S": "0"})
    try:
        grpc_url = f"127.0.0.1:{server.ports['kserve_grpc']}"
        engine = EngineProcesses.of(server.proc.pid, "demo-tiny")

        async def stream_then_kill():
            client = grpcaio.InferenceServerClient(grpc_url)
            text = grpcaio.InferInput("text_input", [1], "BYTES")
            text.set_data_from_numpy(np.array([b"hello"], dtype=np.object_))
            flag = grpcaio.InferInput("stream", [1], "BOOL")
            flag.set_data_from_numpy(np.array([True]))
            params = grpcaio.InferInput("sampling_parameters", [1], "BYTES")
            params.set_data_from_numpy(np.array([b'{"max_tokens": 1900, "ignore_eos": true}'], dtype=np.object_))

            async def requests():
                yield {"model_name": "demo-tiny", "inputs": [text, flag, params], "request_id": "in-flight"}
                await asyncio.sleep(3600)

            submitted_before = submitted(server.metrics_url, "demo-tiny")
            stream = client.stream_infer(requests())
            seen, second = [], None
            try:
                async for result, error in stream:
                    seen.append((result, error))
                    if len(seen) == 1:  # the request runs: hold the engine, let a second request reach it, kill
                        engine.hold()
                        second = asyncio.ensure_future(asyncio.to_thread(
                            httpx.post, generate, json={"text_input": "hello", "parameters": {"max_tokens": 8}},
                            timeout=60))
                        # both requests in the held engine
                        while await asyncio.to_thread(submitted, server.metrics_url, "demo-tiny") < (
                                submitted_before + 2):
                            assert not second.done(), second.result().text
                            await asyncio.sleep(0.05)
                        engine.kill()
                    if error is not None:
                        break
            except grpc.aio.AioRpcError as closed:
                # The backend answers the streamed request with the engine's error, and the startup procedure, once
                # it sees the model not ready, stops tritonserver, whose gRPC front-end then closes the stream: on a
                # loaded machine the close came first (seen once in a fresh clone's make test). Either way the
                # server's failure (UNAVAILABLE), never the client's; the engine's words are checked on the second
                # request below.
                assert closed.code() == grpc.StatusCode.UNAVAILABLE and len(seen) >= 1, closed
                seen.append((None, closed))
            stream.cancel()
            await client.close()
            return seen, await second

        generate = f"http://127.0.0.1:{server.ports['kserve_http']}/v2/models/demo-tiny/generate"
        seen, died = asyncio.run(asyncio.wait_for(stream_then_kill(), timeout=180))
        (first, first_error), (_, error) = seen[0], seen[-1]
        assert first_error is None and first.as_numpy("text_output")[0]
        assert len(seen) < 1900, "the stream finished although its engine was killed"
        # The engine's own error for requests it held (vLLM's EngineDeadError), the backend's health verdict for the
        # rest: both the server's failure, never the client's
        engine_gone = re.compile(r"vLLM engine died|unhealthy vLLM engine")
        assert isinstance(error, grpc.aio.AioRpcError) or engine_gone.search(str(error)), str(error)
        # Triton 2.51's generate endpoint answers 400 for an error response whatever its code (INTERNAL and
        # UNAVAILABLE alike: compat.toml [local.triton] differences); the message says it is the engine
        assert died.status_code == 400 and engine_gone.search(died.json()["error"]), died.text
        assert server.proc.wait(timeout=120) == 1, server.log()[-3000:]
        log = server.log()
        assert "engine died, exiting so the orchestrator restarts the container" in log
        assert "not ready" in log
        for name in ("kserve_http", "kserve_grpc", "metrics"):
            assert not accepts(server.ports[name]), name
    finally:
        server.kill()
