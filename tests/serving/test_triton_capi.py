"""The project's ctypes binding over Triton's C API (serving_image/triton/capi), against the real libtritonserver
(nvidia-pytriton's 2.51) in this very process, with the stand-in `vllm` backend and its engine process serving the
demo model: what the embedded `openai` mode is built on.

One server for the module (starting it starts a vLLM engine); the test that unloads the model is the last to use it.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import psutil
import pytest
import pytest_asyncio

from serving_image.triton import capi
from serving_image.triton.capi import inference
from serving_image.triton.capi.inference import Input, infer
from tests.serving.engine_hold import EngineProcesses, engine_stub

pytestmark = [pytest.mark.slow, pytest.mark.asyncio(loop_scope="module")]

MODEL = "demo-tiny"
# float32: see docs/local-environment.md (this VM SIGILLs in vLLM's bf16 AMX attention kernel); eager:
# no graph compilation at start (it dominates the engine's start on 2 cores, and make test's total time).
ENGINE_ARGS = {"max_model_len": 512, "kv_cache_memory_bytes": 128 * 1024 * 1024, "dtype": "float32",
               "enforce_eager": True}
FLAGS = ("return_finish_reason", "return_num_input_tokens", "return_num_output_tokens")



def in_flight() -> int:
    """The leak check: requests sent and not yet both released and finished, as the response path's queues of every
    event loop count them (the binding's own per-loop state; the product never needs the total)."""
    with inference._deliveries_lock:
        return sum(delivery.queue.in_flight() for delivery in inference._deliveries.values())


class Embedded:
    def __init__(self, server: capi.Server, log_file: Path):
        self.server = server
        self.log_file = log_file

    def log(self) -> str:
        return self.log_file.read_text(errors="replace") if self.log_file.exists() else ""


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def triton(demo_model_dir, tmp_path_factory):
    from llm_serving.package import PackageSpec, build_package, open_package
    from serving_image.triton.local_install import locate
    from serving_image.triton.pins import load_pins
    from serving_image.triton.repository import generate_repository
    from serving_image.triton_stub.backends.vllm.engine_in_stub import ENGINE_PYTHON_ENV

    root = tmp_path_factory.mktemp("triton-capi")
    package = open_package(build_package(PackageSpec(demo_model_dir, MODEL, "1.0.0", engine_args=ENGINE_ARGS),
                                         root / "package"), root / "unpacked")
    repository = root / "repository"
    generate_repository(package.manifest, package.root, repository, load_pins().pinned)
    backends = locate().backend_directory(root / "backends")
    # The stub inherits this process's environment (the startup procedure sets it so): set for this module's
    # server only, and restored after it, so that no later test sees it set by accident.
    previous = os.environ.get(ENGINE_PYTHON_ENV)
    os.environ[ENGINE_PYTHON_ENV] = sys.executable
    log_file = root / "triton.log"
    options = capi.ServerOptions(model_repository=repository, backend_directory=backends, startup_models=(MODEL,),
                                 log_file=log_file, exit_timeout_s=10)
    try:
        server = await asyncio.to_thread(capi.Server.start, options)
        try:
            yield Embedded(server, log_file)
        finally:
            await asyncio.to_thread(server.stop)
    finally:
        if previous is None:
            os.environ.pop(ENGINE_PYTHON_ENV, None)
        else:
            os.environ[ENGINE_PYTHON_ENV] = previous


def _inputs(prompt: str, *, params: dict | None = None, stream: bool = True, flags=FLAGS) -> list[Input]:
    inputs = [Input.from_bytes("text_input", [prompt]), Input.from_numpy("stream", np.array([stream]))]
    if params is not None:
        inputs.append(Input.from_bytes("sampling_parameters", [json.dumps(params)]))
    inputs += [Input.from_numpy(flag, np.array([True])) for flag in flags]
    return inputs


async def _collect(stream) -> list[capi.Response]:
    """Every response, then until Triton released the request (after which the binding holds nothing of it)."""
    responses = [response async for response in stream]
    await asyncio.wait_for(stream.wait_released(), timeout=60)
    return responses


async def test_server_health_metadata_and_model_index(triton):
    server = triton.server
    assert server.live() and server.ready() and server.model_ready(MODEL)
    assert server.model_is_decoupled(MODEL)
    assert server.metadata()["version"] == "2.51.0"
    assert server.model_index() == [{"name": MODEL, "version": "1", "state": "READY"}]
    metadata = server.model_metadata(MODEL)
    assert metadata["name"] == MODEL and metadata["versions"] == ["1"]
    assert {"text_input", "sampling_parameters"} <= {i["name"] for i in metadata["inputs"]}
    config = server.model_config(MODEL)
    assert config["backend"] == "vllm" and config["model_transaction_policy"]["decoupled"] is True
    assert server.lib.api_version[0] == 1 and server.lib.api_version[1] >= 17


async def test_streaming_request_with_bytes_and_typed_inputs(triton):
    responses = await _collect(infer(triton.server, MODEL, _inputs("Hello there", params={"max_tokens": 6,
                                                                                         "temperature": 0}),
                                     request_id="stream-1"))
    assert responses[-1].final and not any(r.final for r in responses[:-1])
    assert all(r.error is None for r in responses)
    data = [r for r in responses if r.outputs]
    assert sum(int(r.outputs["num_output_tokens"].reshape(-1)[0]) for r in data) == 6
    assert data[-1].outputs["finish_reason"].tolist() == [b"length"]
    assert data[0].outputs["num_input_tokens"].dtype == np.uint32 and int(data[0].outputs["num_input_tokens"][0]) > 0
    assert all(isinstance(r.outputs["text_output"].reshape(-1)[0], bytes) for r in data)
    assert in_flight() == 0  # every request released and finished is deleted


async def test_request_parameters_instead_of_sampling_parameters(triton):
    """Without the sampling_parameters tensor the backend reads the request's parameters (int, float, bool)."""
    responses = await _collect(infer(triton.server, MODEL, _inputs("Hello", stream=False),
                                     parameters={"max_tokens": 3, "temperature": 0.0, "ignore_eos": True}))
    data = [r for r in responses if r.outputs]
    assert len(data) == 1 and responses[-1].final
    assert int(data[0].outputs["num_output_tokens"].reshape(-1)[0]) == 3


async def test_errors_carry_triton_codes_and_messages(triton):
    with pytest.raises(capi.TritonError) as unknown:
        infer(triton.server, "no-such-model", _inputs("x"))
    assert unknown.value.code is capi.ErrorCode.NOT_FOUND and "no-such-model" in unknown.value.message
    with pytest.raises(capi.TritonError) as datatype:
        infer(triton.server, MODEL, [Input.from_numpy("text_input", np.array([1], dtype=np.int32))])
    assert datatype.value.code is capi.ErrorCode.INVALID_ARG and "text_input" in datatype.value.message
    responses = await _collect(infer(triton.server, MODEL, _inputs("x", params={"max_tokens": "many"})))
    assert len(responses) == 1 and responses[0].final
    assert responses[0].error.code is capi.ErrorCode.INVALID_ARG
    assert "sampling_parameters.max_tokens" in responses[0].error.message
    assert triton.server.ready()  # a bad request leaves the server and the model ready
    assert in_flight() == 0


def _engine_stub(triton) -> psutil.Process:
    """The Python backend stub that runs this module's Triton's engine: the one whose model is in its repository
    (another module's server may run a stub of the same model under this process too)."""
    return engine_stub(os.getpid(), MODEL, repository=str(triton.log_file.parent / "repository"))


def _engine_processes(triton) -> EngineProcesses:
    """vLLM's processes under the stub (the stub itself keeps running: it answers Triton)."""
    pids = []
    for child in _engine_stub(triton).children(recursive=True):
        try:
            if "resource_tracker" not in " ".join(child.cmdline()):
                pids.append(child.pid)
        except psutil.Error:
            continue
    return EngineProcesses(tuple(pids))


def _executions(server: capi.Server) -> int:
    stats = server.model_statistics(MODEL)["model_stats"][0]
    return int(stats["execution_count"])


async def test_cancelling_a_request_in_a_held_engine(triton):
    """The request reaches the backend (Triton counts its execution) while vLLM is held, so it is still running
    when it is cancelled, whatever the machine's speed; the backend notices and ends it with CANCELLED.
    This proves the stand-in's behaviour: its watcher asks Triton about every request in flight, outputs or not.
    NVIDIA's backend asks only after an output, so there a held or queued request is noticed at its first output
    (docs/kserve.md, "Side by side")."""
    server = triton.server
    engine = _engine_processes(triton)
    executions = _executions(server)
    noticed = triton.log().count("[vllm] Cancelling the request")
    with engine.held():
        stream = infer(server, MODEL, _inputs("long", params={"max_tokens": 400, "ignore_eos": True}),
                       request_id="cancel-me")
        deadline = time.monotonic() + 60
        while _executions(server) == executions:
            assert time.monotonic() < deadline, "the request never reached the backend"
            await asyncio.sleep(0.02)
        assert not stream.finished
        assert stream.cancel()
        responses = await asyncio.wait_for(_collect(stream), timeout=60)
    assert responses[-1].final
    errors = [r.error for r in responses if r.error is not None]
    assert errors and errors[-1].code is capi.ErrorCode.CANCELLED, responses
    # The stub's log line reaches Triton's log file over its own channel, not with the response: wait for it (seen
    # on a loaded machine: the CANCELLED response was read before the line was written).
    deadline = time.monotonic() + 30
    while triton.log().count("[vllm] Cancelling the request") == noticed:
        assert time.monotonic() < deadline, "the backend never logged the cancellation"
        await asyncio.sleep(0.05)
    assert not stream.cancel()  # finished: nothing left to cancel
    assert in_flight() == 0
    # the model is still serving
    after = await _collect(infer(server, MODEL, _inputs("again", params={"max_tokens": 2})))
    assert after[-1].final and all(r.error is None for r in after)


async def test_prometheus_metrics_text_counts_requests(triton):
    def count() -> float:
        for line in triton.server.metrics().splitlines():
            if line.startswith("nv_inference_count{") and f'model="{MODEL}"' in line:
                return float(line.rsplit(" ", 1)[1])
        return 0.0

    before = count()
    await _collect(infer(triton.server, MODEL, _inputs("count me", params={"max_tokens": 2})))
    assert count() == before + 1
    text = triton.server.metrics()
    assert "# TYPE nv_inference_request_success counter" in text
    assert "# TYPE nv_inference_request_duration_us counter" in text


async def test_coexists_with_grpcio_protobuf_and_torch_in_one_process(triton):
    """libtritonserver carries its own gRPC and protobuf (hidden symbols): grpcio's server and client, protobuf
    messages and torch keep working beside it in this process, and so does Triton."""
    import grpc
    import torch
    from tritonclient.grpc import service_pb2

    maps = Path("/proc/self/maps").read_text()
    assert "libtritonserver" in maps and "cygrpc" in maps
    server = grpc.aio.server()
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(
        "probe.Echo", {"Echo": grpc.unary_unary_rpc_method_handler(lambda request, context: request[::-1])}),))
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            assert await channel.unary_unary("/probe.Echo/Echo")(b"abc", timeout=30) == b"cba"
    finally:
        await server.stop(0)
    message = service_pb2.ModelInferRequest(model_name=MODEL, id="x")
    assert service_pb2.ModelInferRequest.FromString(message.SerializeToString()).model_name == MODEL
    assert float(torch.ones(3) @ torch.ones(3)) == 3.0
    responses = await _collect(infer(triton.server, MODEL, _inputs("still here", params={"max_tokens": 2})))
    assert responses[-1].final and all(r.error is None for r in responses)


async def test_missing_dependency_folder_is_a_clear_error(tmp_path):
    """Without its dependency folder on the loader's path (and not in the folder given), loading names the missing
    library and what to do."""
    from serving_image.triton.local_install import locate

    library = locate().library
    lonely = tmp_path / "lib"
    lonely.mkdir()
    (lonely / library.name).symlink_to(library)
    script = ("from pathlib import Path\n"
              "from serving_image.triton.capi.library import LibraryLocation, TritonLibraryError, load_library\n"
              f"try:\n    load_library(LibraryLocation(Path({str(lonely / library.name)!r}), Path({str(lonely)!r})))\n"
              "except TritonLibraryError as exc:\n    print(exc)\n")
    env = {k: v for k, v in os.environ.items() if k != "LD_LIBRARY_PATH"}
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=60)
    assert "is not in" in result.stdout and "LD_LIBRARY_PATH=" in result.stdout, result.stdout + result.stderr


async def test_unloading_the_model_stops_its_engine(triton):
    """Last: model unload (the backend finalizes, its engine stops) and readiness with strict readiness on; the
    embedded server's health check (what the startup procedure watches) reports the model gone, so the process
    exits non-zero as after an engine death (the stand-in unloads its model when its engine dies)."""
    from serving_image.triton.embedded import EmbeddedTriton

    server = triton.server
    embedded = EmbeddedTriton(server, (MODEL,), "2.51.0", 0.0)
    assert embedded.dead_reason is None
    engine = _engine_processes(triton)
    server.unload_model(MODEL)
    deadline = time.monotonic() + 120
    while server.model_ready(MODEL) or any(psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE
                                             for p in engine.pids):
        assert time.monotonic() < deadline, "the model did not unload"
        await asyncio.sleep(0.2)
    assert not server.ready()  # strict readiness: a loaded model is not ready
    assert server.live()
    assert "not ready" in embedded.dead_reason
    with pytest.raises(capi.TritonError):
        infer(server, MODEL, _inputs("gone"))


async def test_startup_reexecutes_with_the_dependency_folder_on_the_loader_path():
    """What the entrypoint does first on the embedded path: replace the process (same pid) by one started with
    libtritonserver's dependency folder on LD_LIBRARY_PATH; once there, nothing more."""
    from serving_image.triton.local_install import locate

    script = ("import os, sys\n"
              "from serving_image.triton.embedded import reexec_with_loader_path\n"
              "print('before', os.getpid(), flush=True)\n"
              "reexec_with_loader_path(['-c', 'import os; print(\"after\", os.getpid(), "
              "os.environ[\"LD_LIBRARY_PATH\"])'])\n"
              "print('not replaced')\n")
    env = {k: v for k, v in os.environ.items() if k not in ("LD_LIBRARY_PATH", "LLM_SERVING_TRITON_REEXEC")}
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=60)
    lines = result.stdout.split("\n")
    before, after = lines[0].split(), lines[1].split()
    assert before[1] == after[1] and after[2].split(":")[0] == str(locate().library_dir), result.stdout
    assert "not replaced" not in result.stdout and "re-executing" in result.stderr
