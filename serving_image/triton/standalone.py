"""The `standalone` serving mode: NVIDIA's `tritonserver` alone owns the KServe ports (docs/architecture.md §3.2).

Startup step 4 generates the model repository (serving_image/triton/repository.py) and starts `tritonserver` as a
child process on the public KServe ports (8000 HTTP, 8001 gRPC) and on an internal metrics port (8004, bound to
127.0.0.1; the metrics proxy on 8002 fetches it and merges vLLM's multiprocess files, §3.8). Step 5 then opens only
the metrics proxy: this project's own KServe front-ends and the OpenAI front-end stay off.

- In the image, `tritonserver` is the Triton release's, with its own backends (NVIDIA's vllm_backend).
- Locally (`make up MODE=standalone`, the tests), it is the tritonserver 2.51 from nvidia-pytriton
  (serving_image/triton/local_install.py), with a backend directory in which `vllm` is this project's stand-in
  (serving_image/triton_stub/backends/vllm). Only `--backend-directory` differs.

When the gRPC port opens: in explicit model control mode with `--load-model`, tritonserver loads the models before it
binds HTTP and gRPC (measured on 2.51, and tested: tests/serving/test_triton_python.py holds a model in its
`initialize` and finds both ports closed). Loading the stand-in vllm model is starting its engine, so 8001 accepts
nothing until the engine is ready, without anything else in front of it; step 4 is done when Triton reports every
model ready over that port.

With LLM_SERVING_TRACE_OTLP_URL set, tritonserver also exports its own OpenTelemetry spans under each caller's trace
id (serving_image/triton/tracing.py): in this mode there is no request record of ours to carry it.

The returned `StandaloneTriton` is what the startup procedure watches (the child's exit, or a model that stops being
ready: the stand-in backend unloads its model when its engine dies, as NVIDIA's health check does) and stops (SIGTERM:
Triton drains in-flight requests, unloads the models, whose engines stop, and exits).
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path

from serving_image.served_model import ModelInfo
from serving_image.triton.tracing import TritonTracing

log = logging.getLogger(__name__)

READY_TIMEOUT_S = 1800  # loading a large model from the model cache can take many minutes
# Once the stand-in backend's engine reports ready, Triton finishes loading the model within seconds. tritonserver
# 2.51's Python backend can instead hang for good right there (seen on fresh clones under heavy load: the launcher
# waits for a stub that has answered its initialize and runs on; docs/local-environment.md, "Triton locally").
# Past this delay the load is declared stuck and Triton is started again, once, loudly.
LOAD_AFTER_ENGINE_READY_S = 120
# What the stand-in backend, and the platform's scoring model (serving_image/triton_stub/scoring_model), log when their
# engine is up: the scoring model is a python-backend model and hangs in the same place.
ENGINE_READY_MARKS = ("[vllm] engine ready for ", "[score] engine ready for ")
LOADED_MARK = "successfully loaded '"  # what Triton logs when a model has loaded
STUCK_LOAD_RESTARTS = 1
WATCH_INTERVAL_S = 1.0
STOP_TIMEOUT_S = 90  # Triton's own exit timeout is 30 s, then each model's finalize (its engine's shutdown)


def tritonserver_command(repository: Path, models: str | Sequence[str], *, http_port: int, grpc_port: int,
                         metrics_port: int, binary: str | Path = "tritonserver",
                         backend_directory: Path | None = None, host: str | None = None,
                         tracing: TritonTracing | None = None) -> list[str]:
    models = [models] if isinstance(models, str) else list(models)
    command = [
        str(binary),
        f"--model-repository={repository}",
        "--model-control-mode=explicit",  # load exactly the package's model(s), before the ports open
        *(f"--load-model={m}" for m in models),
        "--exit-on-error=true",
        "--strict-readiness=true",  # /v2/health/ready only when every loaded model is ready
        f"--http-port={http_port}",
        f"--grpc-port={grpc_port}",
        f"--metrics-port={metrics_port}",
        "--metrics-address=127.0.0.1",  # internal: the metrics proxy on 8002 is the public one (§3.8)
        "--allow-metrics=true",
        "--metrics-config=histogram_latencies=true",  # nv_inference_first_response_histogram_ms (§3.8)
        "--log-verbose=0",
    ]
    if host is not None:
        command += [f"--http-address={host}", f"--grpc-address={host}"]
    if backend_directory is not None:
        command.append(f"--backend-directory={backend_directory}")
    if tracing is not None:  # Triton's own OpenTelemetry spans, under the caller's trace id (tracing.py)
        command += tracing.arguments()
    return command


class StandaloneTriton:
    """A running tritonserver child and the models it serves."""

    def __init__(self, process: subprocess.Popen, client, info: ModelInfo, models: tuple[str, ...],
                 server_version: str):
        self.process = process
        self.server_version = server_version
        self.info = info
        self.models = models
        self._client = client
        self._dead: str | None = None
        self._stopping = False
        self._watch = asyncio.get_running_loop().create_task(self._watch_models())

    async def _watch_models(self) -> None:
        misses = 0
        while not self._stopping:
            await asyncio.sleep(WATCH_INTERVAL_S)
            if self.process.poll() is not None or self._stopping:
                return
            try:
                ready = all([await self._client.is_model_ready(m) for m in self.models])
            except Exception:  # a refused or slow probe: count it, do not conclude from one
                ready = False
            misses = 0 if ready else misses + 1
            if misses >= 3 and not self._stopping:
                self._dead = f"Triton reports {', '.join(self.models)} not ready (an engine failed and its model " \
                             "was unloaded)"
                return

    def is_ready(self) -> bool:
        return self.dead_reason is None

    @property
    def dead_reason(self) -> str | None:
        code = self.process.poll()
        if code is not None and not self._stopping:
            return f"tritonserver exited with status {code}"
        return self._dead

    async def shutdown(self) -> None:
        self._stopping = True
        self._watch.cancel()
        try:
            await self._client.close()
        except Exception as exc:  # closing a channel to a server that is going away
            log.debug("closing the Triton client: %r", exc)
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)  # Triton drains in-flight requests, unloads, exits
            try:
                await asyncio.to_thread(self.process.wait, STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                log.warning("tritonserver did not stop in %ss: killing it", STOP_TIMEOUT_S)
                self.process.kill()
                await asyncio.to_thread(self.process.wait)


class StuckLoadError(RuntimeError):
    """Triton did not finish loading a model whose engine was ready (the Python backend's launch hang)."""


class _LogForwarder:
    """Copies tritonserver's output to this process's stdout, as if it wrote there itself, and notes when each model
    settled: loaded, or (the stand-in vllm backend) its engine reported ready."""

    def __init__(self, stream) -> None:
        self.settled_at: dict[str, float] = {}
        self._stream = stream
        self._thread = threading.Thread(target=self._run, name="tritonserver-log", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        out = sys.stdout.buffer if hasattr(sys.stdout, "buffer") else None
        for line in iter(self._stream.readline, b""):
            if out is not None:
                out.write(line)
                out.flush()
            else:
                sys.stdout.write(line.decode("utf-8", "replace"))
            text = line.decode("utf-8", "replace")
            if mark := next((m for m in ENGINE_READY_MARKS if m in text), None):
                self._settled(text.split(mark, 1)[1].split(":", 1)[0].strip())
            elif LOADED_MARK in text:
                self._settled(text.split(LOADED_MARK, 1)[1].split("'", 1)[0])

    def _settled(self, model: str) -> None:
        self.settled_at.setdefault(model, time.monotonic())

    def all_settled_since(self, models: Sequence[str]) -> float | None:
        """When the last of `models` settled, or None while one has not (a model still loading)."""
        times = [self.settled_at.get(m) for m in models]
        return None if None in times else max(times)


def _kill_tree(process: subprocess.Popen) -> None:
    """Kill tritonserver and what it started (the stubs, their engines): a stub whose launcher hung would otherwise
    outlive the server with its engine."""
    import psutil

    try:
        children = psutil.Process(process.pid).children(recursive=True)
    except psutil.Error:
        children = []
    process.kill()
    process.wait()
    for child in children:
        try:
            child.kill()
        except psutil.Error:
            pass
    psutil.wait_procs(children, timeout=30)


def _accepts(host: str, port: int) -> bool:
    with socket.socket() as sock:
        sock.settimeout(1.0)
        return sock.connect_ex((host, port)) == 0


async def start_standalone(*, repository: Path, models: str | Sequence[str], version: str, http_port: int,
                           grpc_port: int, metrics_port: int, binary: str | Path = "tritonserver",
                           backend_directory: Path | None = None, host: str | None = None,
                           env: dict[str, str] | None = None, max_model_len: int = 0,
                           tracing: TritonTracing | None = None, ready_timeout_s: float = READY_TIMEOUT_S,
                           stuck_after_s: float = LOAD_AFTER_ENGINE_READY_S) -> StandaloneTriton:
    """Start tritonserver and wait until every model is ready (its gRPC port opens only then). A load stuck after
    the engines were ready (StuckLoadError) is retried with a fresh tritonserver, STUCK_LOAD_RESTARTS times."""
    models = (models,) if isinstance(models, str) else tuple(models)
    command = tritonserver_command(repository, models, http_port=http_port, grpc_port=grpc_port,
                                   metrics_port=metrics_port, binary=binary, backend_directory=backend_directory,
                                   host=host, tracing=tracing)
    for attempt in range(STUCK_LOAD_RESTARTS + 1):
        try:
            return await _start_once(command, models, version, grpc_port, host, env, max_model_len,
                                     ready_timeout_s, stuck_after_s)
        except StuckLoadError as exc:
            if attempt == STUCK_LOAD_RESTARTS:
                raise
            log.warning("%s: starting tritonserver again (attempt %d of %d)", exc, attempt + 2,
                        STUCK_LOAD_RESTARTS + 1)
    raise AssertionError("unreachable")


async def _start_once(command: list[str], models: tuple[str, ...], version: str, grpc_port: int, host: str | None,
                      env: dict[str, str] | None, max_model_len: int, ready_timeout_s: float,
                      stuck_after_s: float) -> StandaloneTriton:
    import tritonclient.grpc.aio as grpcaio

    log.info("starting %s", " ".join(command))
    process = subprocess.Popen(command, env={**os.environ, **(env or {})}, stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT)
    output = _LogForwarder(process.stdout)
    address = "127.0.0.1" if host in (None, "0.0.0.0", "") else host
    url = f"{address}:{grpc_port}"
    client = None
    deadline = time.monotonic() + ready_timeout_s
    try:
        while True:
            if process.poll() is not None:
                raise RuntimeError(f"tritonserver exited with status {process.returncode} before "
                                   f"{', '.join(models)} {'was' if len(models) == 1 else 'were'} ready (its log above "
                                   "says why)")
            # A gRPC channel opened before the port is bound backs off for up to minutes between reconnections:
            # connect with a plain socket until Triton listens (it binds after loading the models), then use gRPC.
            if client is None and _accepts(address, grpc_port):
                client = grpcaio.InferenceServerClient(url)
            problem = "the gRPC port is not open yet (Triton opens it once the models are loaded)"
            if client is not None:
                try:
                    if all([await client.is_model_ready(m) for m in models]):
                        break
                    problem = "not ready yet"
                except Exception as exc:  # listening, not answering yet
                    problem = str(exc)
            # Every model loaded or with its engine ready, and still no port: the launch hang (with companions,
            # the other models load beside the LLM, and are settled once loaded).
            settled = output.all_settled_since(models)
            if client is None and settled is not None and time.monotonic() - settled > stuck_after_s:
                raise StuckLoadError(f"tritonserver has not finished loading {', '.join(models)} {stuck_after_s:.0f}s "
                                     "after the engine reported ready (the Python backend's launch hang of "
                                     "tritonserver 2.51)")
            if time.monotonic() > deadline:
                raise RuntimeError(f"tritonserver did not report {', '.join(models)} ready in {ready_timeout_s}s: "
                                   f"{problem}")
            await asyncio.sleep(0.5)
        metadata = await client.get_server_metadata()
    except BaseException:
        if client is not None:
            await client.close()
        if process.poll() is None:
            _kill_tree(process)
        raise
    log.info("Triton %s ready on gRPC %s: %s", metadata.version, url, ", ".join(models))
    info = ModelInfo(name=models[0], version=version, max_model_len=max_model_len, vocab_size=0, eos_token_id=None)
    return StandaloneTriton(process, client, info, models, metadata.version)
