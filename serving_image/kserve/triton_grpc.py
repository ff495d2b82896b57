"""KServe v2 gRPC (port 8001) fronting Triton embedded in this process (serving_image/triton/embedded.py): the role
NVIDIA's `tritonfrontend` plays. The server is C++ (native/triton/kserve_grpc.cpp, grpc++'s callback API, in the
`_response_path` module beside the response path it reads); this module is its Python side. Each RPC is answered by
Triton itself through the C API, so tritonclient reaches the very instance the OpenAI front-end uses and sees
Triton's own behaviour: its metadata, model configuration (after the backend's auto-complete), repository index,
statistics, readiness, its refusal of unary inference on a decoupled model, its error messages, and every model of
the repository (not only the LLM).

Where each part runs (docs/kserve.md, "A C++ KServe front-end for the embedded 8001"):
- C++, no Python per request or response: ModelStreamInfer (any number of requests on one stream, answered as
  Triton's responses arrive; an error is the stream's `error_message` and the stream carries on; every response
  carries `triton_final_response`; `triton_enable_empty_final_response` is honoured; a client that closes its stream
  cancels its requests in Triton, which aborts them in the engine) and ModelInfer (forwarded for models that are not
  decoupled; a decoupled one gets UNIMPLEMENTED with Triton's words). Inputs as raw or typed contents, any Triton
  datatype; outputs as raw contents.
- Python, here (`ControlRpcs`): ServerLive, ServerReady, ModelReady, ServerMetadata, ModelMetadata, ModelConfig,
  ModelStatistics, RepositoryIndex: Triton's JSON messages mapped onto the protobuf responses. While the procedure
  drains (after SIGTERM), ServerReady and ModelReady say false.
- Python, once per call (`open_call`): the caller's trace id and experiment arm from the gRPC metadata (a malformed
  arm refuses the call, INVALID_ARGUMENT, or each request of the stream); and once per finished request, the record
  of every ModelInfer and every request of a ModelStreamInfer (kserve/request_log.py), drained from the C++ side on
  this loop.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

import grpc
from google.protobuf import json_format
from tritonclient.grpc import service_pb2

from serving_image.kserve.request_log import KServeRecord, metadata_dict
from serving_image.request_context import EXPERIMENT_HEADER, experiment_from, trace_id_from
from serving_image.triton.capi import ErrorCode, TritonError

log = logging.getLogger(__name__)

# Larger messages are refused by gRPC itself (RESOURCE_EXHAUSTED) before any of this code runs; the C++ server's
# limit (kserve_grpc.cpp), named here for the tests and the docs.
MAX_MESSAGE_BYTES = 64 * 1024 * 1024
# How many Triton responses wait for the front-end's dispatcher before Triton's response thread waits for it.
QUEUE_CAPACITY = 1 << 16

GRPC_CODES = {ErrorCode.INVALID_ARG: grpc.StatusCode.INVALID_ARGUMENT, ErrorCode.NOT_FOUND: grpc.StatusCode.NOT_FOUND,
              ErrorCode.UNAVAILABLE: grpc.StatusCode.UNAVAILABLE, ErrorCode.UNSUPPORTED: grpc.StatusCode.UNIMPLEMENTED,
              ErrorCode.ALREADY_EXISTS: grpc.StatusCode.ALREADY_EXISTS, ErrorCode.CANCELLED: grpc.StatusCode.CANCELLED,
              ErrorCode.INTERNAL: grpc.StatusCode.INTERNAL, ErrorCode.UNKNOWN: grpc.StatusCode.UNKNOWN}


def _version(text: str) -> int:
    try:
        return int(text) if text else -1
    except ValueError:
        raise TritonError(ErrorCode.INVALID_ARG, f"model version '{text}' is not a number") from None


class ControlRpcs:
    """The RPCs that are not inference, answered from the embedded Triton's JSON messages. `answer` is the C++
    server's hook: (method, serialized request) -> (gRPC status code, message, serialized response)."""

    REQUESTS = {"ServerLive": service_pb2.ServerLiveRequest, "ServerReady": service_pb2.ServerReadyRequest,
                "ModelReady": service_pb2.ModelReadyRequest, "ServerMetadata": service_pb2.ServerMetadataRequest,
                "ModelMetadata": service_pb2.ModelMetadataRequest, "ModelConfig": service_pb2.ModelConfigRequest,
                "ModelStatistics": service_pb2.ModelStatisticsRequest,
                "RepositoryIndex": service_pb2.RepositoryIndexRequest}

    def __init__(self, triton, is_draining: Callable[[], bool] = lambda: False):
        self.server = triton.server
        self.is_draining = is_draining

    def answer(self, method: str, request: bytes) -> tuple[int, str, bytes]:
        parse = self.REQUESTS.get(method)
        if parse is None:
            return grpc.StatusCode.UNIMPLEMENTED.value[0], f"{method} is not served here", b""
        try:
            response = getattr(self, method)(parse.FromString(request))
        except TritonError as exc:
            return GRPC_CODES.get(exc.code, grpc.StatusCode.UNKNOWN).value[0], exc.message, b""
        return 0, "", response.SerializeToString()

    def ServerLive(self, request):
        return service_pb2.ServerLiveResponse(live=self.server.live())

    def ServerReady(self, request):
        return service_pb2.ServerReadyResponse(ready=not self.is_draining() and self.server.ready())

    def ModelReady(self, request):
        try:
            ready = self.server.model_ready(request.name, _version(request.version))
        except TritonError:
            ready = False
        return service_pb2.ModelReadyResponse(ready=ready and not self.is_draining())

    def ServerMetadata(self, request):
        meta = self.server.metadata()
        return service_pb2.ServerMetadataResponse(name=meta.get("name", ""), version=meta.get("version", ""),
                                                  extensions=meta.get("extensions", []))

    def ModelMetadata(self, request):
        meta = self.server.model_metadata(request.name, _version(request.version))
        return json_format.ParseDict(meta, service_pb2.ModelMetadataResponse(), ignore_unknown_fields=True)

    def ModelConfig(self, request):
        config = self.server.model_config(request.name, _version(request.version))
        response = service_pb2.ModelConfigResponse()
        json_format.ParseDict(config, response.config, ignore_unknown_fields=True)
        return response

    def ModelStatistics(self, request):
        stats = self.server.model_statistics(request.name, _version(request.version))
        return json_format.ParseDict(stats, service_pb2.ModelStatisticsResponse(), ignore_unknown_fields=True)

    def RepositoryIndex(self, request):
        response = service_pb2.RepositoryIndexResponse()
        for model in self.server.model_index(ready_only=request.ready):
            response.models.add(name=model.get("name", ""), version=model.get("version", ""),
                                state=model.get("state", ""), reason=model.get("reason", ""))
        return response


def open_call(metadata: list[tuple[str, bytes]]) -> tuple[str | None, str | None]:
    """A call's trace id and experiment arm, from its gRPC metadata (the C++ server's hook). Raises ValueError naming
    the header for a malformed arm: the call (ModelInfer), or each request of the stream, is refused with its text."""
    fields = metadata_dict(metadata)
    return trace_id_from(fields.get("traceparent")), experiment_from(fields.get(EXPERIMENT_HEADER))


def write_records(records: list[tuple]) -> None:
    """The C++ server's finished requests, as request records (kserve/request_log.py)."""
    for (rpc, request_id, model, version, trace_id, experiment, status, duration_s, first_s, last_s) in records:
        KServeRecord(rpc, request_id, model, version, trace_id, experiment, status=status, duration_s=duration_s,
                     first_response_s=first_s, last_response_s=last_s).write()


class TritonGrpcServer:
    """The running C++ server: its port, its records drained on this loop, and a graceful stop."""

    def __init__(self, native, loop: asyncio.AbstractEventLoop):
        self._native = native
        self._loop = loop
        self.port = native.port
        loop.add_reader(native.records_fd, self._drain)

    def _drain(self) -> None:
        write_records(self._native.drain_records())

    async def stop(self, grace_s: float) -> None:
        """Stop accepting; calls in flight get `grace_s` to finish, then are cancelled."""
        if self._native is None:
            return
        native, self._native = self._native, None
        await asyncio.to_thread(native.shutdown, grace_s)
        self._loop.remove_reader(native.records_fd)
        write_records(native.drain_records())


async def start_triton_grpc(triton, host: str, port: int, is_draining: Callable[[], bool] = lambda: False, *,
                            api_keys: tuple[str, ...] = ()) -> tuple[TritonGrpcServer, int]:
    """Bind and start KServe gRPC over the embedded Triton; returns the server and the bound port. `api_keys`: not
    empty, every RPC but ServerLive and ServerReady needs `authorization: Bearer <key>` metadata with one of them
    (UNAUTHENTICATED otherwise), checked in C++ before the call reaches Python or Triton."""
    from serving_image.triton.capi import _response_path
    from serving_image.triton.capi.inference import native_library

    control = ControlRpcs(triton, is_draining)
    try:
        native = await asyncio.to_thread(
            _response_path.KServeGrpc, native_library(triton.server.lib), triton.server.handle.value,
            f"{host}:{port}", open_call, control.answer, QUEUE_CAPACITY, list(api_keys))
    except RuntimeError as exc:
        raise RuntimeError(f"KServe gRPC: cannot bind {host}:{port} ({exc})") from None
    server = TritonGrpcServer(native, asyncio.get_running_loop())
    log.info("KServe gRPC over the embedded Triton listening on %s:%d", host, server.port)
    return server, server.port
