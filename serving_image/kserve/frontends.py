"""Start and stop both KServe front-ends (HTTP 8000, gRPC 8001) on one engine: what the startup procedure's step 5
and the tests call."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass

from serving_image.engine.base import Engine
from serving_image.kserve.grpc_server import start_grpc_server
from serving_image.kserve.http_app import create_kserve_app
from serving_image.kserve.service import KServeModelService
from serving_image.metrics.frontend import FrontendMetrics

log = logging.getLogger(__name__)

KSERVE_HTTP_PORT = 8000
KSERVE_GRPC_PORT = 8001
GRACE_S = 30


@dataclass
class RunningKServe:
    service: KServeModelService
    grpc_server: object
    grpc_port: int
    http_server: object
    http_task: asyncio.Task

    async def stop(self) -> None:
        """Stop accepting, let in-flight calls finish (up to the grace period), then close."""
        self.http_server.should_exit = True
        await self.grpc_server.stop(GRACE_S)
        try:
            await asyncio.wait_for(self.http_task, timeout=GRACE_S + 5)
        except Exception as exc:  # shutting down: report, carry on
            log.warning("KServe HTTP did not stop cleanly: %r", exc)


def _uvicorn_server(app, host: str, port: int):
    from serving_image.http_server import uvicorn_server

    return uvicorn_server(app, host, port, grace_s=GRACE_S)


async def start_kserve(engine: Engine, metrics: FrontendMetrics | None, *, host: str, grpc_port: int,
                       http_port: int, is_draining: Callable[[], bool] = lambda: False,
                       structured_key: str | None = None, triton=None) -> RunningKServe:
    """`triton` (an EmbeddedTriton, serving_image/triton/embedded.py): both front-ends answer from that in-process
    Triton directly (serving_image/kserve/triton_grpc.py, triton_http.py) instead of the engine interface."""
    if structured_key is None:
        from serving_image.triton.pins import load_pins

        structured_key = load_pins().pinned.structured_outputs_key
    service = KServeModelService(engine, metrics, structured_key, is_draining)
    if triton is not None:
        from serving_image.kserve.triton_grpc import start_triton_grpc

        grpc_server, bound = await start_triton_grpc(triton, host, grpc_port, is_draining)
    else:
        grpc_server, bound = await start_grpc_server(service, host, grpc_port)
    if triton is not None:
        from serving_image.kserve.triton_http import create_triton_http_app

        http_app = create_triton_http_app(triton, is_draining)
    else:
        http_app = create_kserve_app(service)
    http_server = _uvicorn_server(http_app, host, http_port)
    task = asyncio.create_task(http_server.serve(), name="kserve-http")
    while not http_server.started:
        if task.done():
            await grpc_server.stop(0)
            task.result()  # raises the bind error
            raise RuntimeError(f"KServe HTTP stopped before listening on {http_port}")
        await asyncio.sleep(0.02)
    return RunningKServe(service, grpc_server, bound, http_server, task)
