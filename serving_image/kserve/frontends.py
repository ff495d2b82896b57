"""Start and stop both KServe front-ends (HTTP 8000, gRPC 8001) over the Triton embedded in this process: what the
startup procedure's step 5 and the tests call. Every answer comes from Triton itself (triton_grpc.py, triton_http.py);
nothing here imitates it."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass

log = logging.getLogger(__name__)

GRACE_S = 30


@dataclass
class RunningKServe:
    grpc_server: object  # kserve/triton_grpc.py TritonGrpcServer (C++)
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


async def start_kserve(triton, *, host: str, grpc_port: int, http_port: int,
                       is_draining: Callable[[], bool] = lambda: False,
                       api_keys: tuple[str, ...] = ()) -> RunningKServe:
    """`triton`: an EmbeddedTriton (serving_image/triton/embedded.py). Port 0 picks a free port for gRPC.
    `api_keys`: not empty, both ports answer only a caller that presents one of them (`Authorization: Bearer <key>`,
    the HTTP header or the gRPC metadata), health excepted (llm_serving/pod_contract.py)."""
    from serving_image.http_server import uvicorn_server
    from serving_image.kserve.triton_grpc import start_triton_grpc
    from serving_image.kserve.triton_http import create_triton_http_app

    grpc_server, bound = await start_triton_grpc(triton, host, grpc_port, is_draining, api_keys=api_keys)
    http_server = uvicorn_server(create_triton_http_app(triton, is_draining, api_keys=api_keys), host, http_port,
                                 grace_s=GRACE_S)
    task = asyncio.create_task(http_server.serve(), name="kserve-http")
    while not http_server.started:
        if task.done():
            await grpc_server.stop(0)
            task.result()  # raises the bind error
            raise RuntimeError(f"KServe HTTP stopped before listening on {http_port}")
        await asyncio.sleep(0.02)
    return RunningKServe(grpc_server, bound, http_server, task)
