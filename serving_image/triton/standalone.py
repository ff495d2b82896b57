"""The `standalone` serving mode in the image: Triton alone, with its own KServe front-ends.

Startup step 4 generates the model repository and starts `tritonserver` as a child process on the public KServe
ports (8000 HTTP, 8001 gRPC) and on the internal metrics port (8004, which the metrics proxy on 8002 already fetches
as its upstream, docs/architecture.md §3.8). The step is done when Triton reports the model ready over its own gRPC API;
the returned engine is the Triton-remote adapter on that API, with the child process's liveness added, so the
startup procedure's watch (exit when the engine dies) and shutdown work unchanged. Step 5 then opens only the
metrics proxy: this project's KServe and OpenAI front-ends stay off.

`tritonserver` exists only in the Triton image; the command line is tested here, the process is not.
"""

from __future__ import annotations

import asyncio
import logging
import subprocess
import time
from pathlib import Path

from serving_image.engine.triton_remote import TritonRemoteEngine

log = logging.getLogger(__name__)

READY_TIMEOUT_S = 1800  # loading a large model from the model cache can take many minutes


def tritonserver_command(repository: Path, model_id: str, *, http_port: int, grpc_port: int,
                         metrics_port: int) -> list[str]:
    return [
        "tritonserver",
        f"--model-repository={repository}",
        "--model-control-mode=explicit",  # load exactly the package's model
        f"--load-model={model_id}",
        "--exit-on-error=true",
        "--strict-readiness=true",  # /v2/health/ready only when every loaded model is ready
        f"--http-port={http_port}",
        f"--grpc-port={grpc_port}",
        f"--metrics-port={metrics_port}",
        "--allow-metrics=true",
        "--metrics-config=histogram_latencies=true",  # nv_inference_first_response_histogram_ms (§3.8)
        "--log-verbose=0",
    ]


class TritonStandaloneEngine(TritonRemoteEngine):
    """The Triton-remote adapter bound to the tritonserver child it started (set right after connecting)."""

    process: subprocess.Popen

    @property
    def dead_reason(self) -> str | None:
        code = self.process.poll()
        if code is not None:
            return f"tritonserver exited with status {code}"
        return super().dead_reason

    def is_ready(self) -> bool:
        return self.process.poll() is None and super().is_ready()

    async def shutdown(self) -> None:
        await super().shutdown()
        if self.process.poll() is None:
            self.process.terminate()  # Triton drains in-flight requests on SIGTERM
            try:
                await asyncio.to_thread(self.process.wait, 60)
            except subprocess.TimeoutExpired:
                self.process.kill()


async def start_standalone(*, repository: Path, model_id: str, version: str, tokenizer_path: Path,
                           max_model_len: int, http_port: int, grpc_port: int, metrics_port: int,
                           structured_key: str) -> TritonStandaloneEngine:
    command = tritonserver_command(repository, model_id, http_port=http_port, grpc_port=grpc_port,
                                   metrics_port=metrics_port)
    log.info("starting %s", " ".join(command))
    process = subprocess.Popen(command)
    deadline = time.monotonic() + READY_TIMEOUT_S
    try:
        while True:
            if process.poll() is not None:
                raise RuntimeError(f"tritonserver exited with status {process.returncode} before {model_id} was "
                                   "ready (its log above says why)")
            try:
                engine = await TritonStandaloneEngine.connect(url=f"127.0.0.1:{grpc_port}", model_name=model_id,
                                                          version=version, tokenizer_path=tokenizer_path,
                                                          structured_key=structured_key, max_model_len=max_model_len)
                break
            except Exception as exc:  # not up yet: refused connection or model still loading
                if time.monotonic() > deadline:
                    raise RuntimeError(f"tritonserver did not report {model_id} ready in {READY_TIMEOUT_S}s: "
                                       f"{exc}") from exc
                await asyncio.sleep(1.0)
    except BaseException:
        process.kill()
        raise
    engine.process = process
    return engine
