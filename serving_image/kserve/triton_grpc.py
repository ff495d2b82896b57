"""KServe v2 gRPC (port 8001) fronting Triton embedded in this process (serving_image/triton/embedded.py): the role
NVIDIA's `tritonfrontend` plays, with this project's grpc.aio server and tritonclient's servicer stubs. Each RPC is
answered by Triton itself through the C API binding (serving_image/triton/capi), so tritonclient reaches the very
instance the OpenAI front-end uses and sees Triton's own behaviour: its metadata, model configuration (after the
backend's auto-complete), repository index, statistics, readiness, its refusal of unary inference on a decoupled
model, its error messages, and every model of the repository (not only the LLM).

- ModelStreamInfer: any number of requests on one stream, answered as Triton's responses arrive; an error is sent
  as the stream's `error_message` (the stream carries on); every response carries `triton_final_response`, and
  `triton_enable_empty_final_response` is honoured, as Triton's gRPC front-end does. A client that closes its
  stream cancels its requests in Triton (the backend aborts them in the engine).
- ModelInfer: forwarded for models that are not decoupled; a decoupled one gets UNIMPLEMENTED with Triton's words.
- Tensors: inputs as raw contents or typed contents, any Triton datatype; outputs as raw contents.
- While the procedure drains (after SIGTERM), ServerReady and ModelReady say false.
- Every ModelInfer, and every request of a ModelStreamInfer, writes one record (kserve/request_log.py) with the
  caller's trace id and experiment arm from the gRPC metadata.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import struct
from collections.abc import Callable, Mapping
from typing import Any

import grpc
import numpy as np
from google.protobuf import json_format
from tritonclient.grpc import service_pb2, service_pb2_grpc

from llm_serving.kserve_stream import FINAL_PARAMETER
from serving_image.kserve.request_log import KServeRecord, metadata_dict
from serving_image.kserve.stream_fan_in import fan_in
from serving_image.triton.capi import ErrorCode, TritonError
from serving_image.triton.capi.inference import NUMPY_DTYPES, Input, infer

log = logging.getLogger(__name__)

# Triton's gRPC front-end's answer to a unary ModelInfer on a decoupled model, word for word (the vLLM backend sets
# `model_transaction_policy { decoupled: true }`; the C API itself has no such check: front-ends make it).
DECOUPLED_GRPC_MESSAGE = "ModelInfer RPC doesn't support models with decoupled transaction policy"
# Larger messages are refused by gRPC itself (RESOURCE_EXHAUSTED) before any of this code runs.
MAX_MESSAGE_BYTES = 64 * 1024 * 1024

GRPC_CODES = {ErrorCode.INVALID_ARG: grpc.StatusCode.INVALID_ARGUMENT, ErrorCode.NOT_FOUND: grpc.StatusCode.NOT_FOUND,
              ErrorCode.UNAVAILABLE: grpc.StatusCode.UNAVAILABLE, ErrorCode.UNSUPPORTED: grpc.StatusCode.UNIMPLEMENTED,
              ErrorCode.ALREADY_EXISTS: grpc.StatusCode.ALREADY_EXISTS, ErrorCode.CANCELLED: grpc.StatusCode.CANCELLED,
              ErrorCode.INTERNAL: grpc.StatusCode.INTERNAL, ErrorCode.UNKNOWN: grpc.StatusCode.UNKNOWN}
# Parameters Triton's gRPC front-end consumes itself instead of passing them to the request.
FRONTEND_PARAMETERS = frozenset({"sequence_id", "sequence_start", "sequence_end", "priority", "timeout",
                                 "triton_enable_empty_final_response", "headers", "binary_data_output"})
_CONTENTS = {"BOOL": "bool_contents", "INT8": "int_contents", "INT16": "int_contents", "INT32": "int_contents",
             "INT64": "int64_contents", "UINT8": "uint_contents", "UINT16": "uint_contents",
             "UINT32": "uint_contents", "UINT64": "uint64_contents", "FP32": "fp32_contents",
             "FP64": "fp64_contents", "BYTES": "bytes_contents"}


class RequestError(ValueError):
    """A request the front-end cannot pass on (malformed tensor contents): INVALID_ARGUMENT."""


def _parameter_value(param: service_pb2.InferParameter):
    which = param.WhichOneof("parameter_choice")
    return None if which is None else getattr(param, which)


def request_inputs(request: service_pb2.ModelInferRequest) -> list[Input]:
    raw = list(request.raw_input_contents)
    if raw and len(raw) != len(request.inputs):
        raise RequestError(f"raw_input_contents has {len(raw)} entries for {len(request.inputs)} inputs")
    inputs = []
    for index, tensor in enumerate(request.inputs):
        shape = tuple(int(d) for d in tensor.shape)
        if raw:
            inputs.append(Input(tensor.name, tensor.datatype, shape, raw[index]))
            continue
        field = _CONTENTS.get(tensor.datatype)
        if field is None:
            raise RequestError(f"input '{tensor.name}': datatype {tensor.datatype} has no typed contents; send it as "
                               "raw_input_contents")
        values = list(getattr(tensor.contents, field))
        if tensor.datatype == "BYTES":
            inputs.append(Input.from_bytes(tensor.name, values, shape))
        else:
            array = np.array(values, dtype=NUMPY_DTYPES[tensor.datatype])
            inputs.append(Input(tensor.name, tensor.datatype, shape, array.tobytes()))
    return inputs


# Bytes per element of each fixed-size datatype, to count a raw output's elements.
_ITEM_BYTES = {"BOOL": 1, "UINT8": 1, "UINT16": 2, "UINT32": 4, "UINT64": 8, "INT8": 1, "INT16": 2, "INT32": 4,
               "INT64": 8, "FP16": 2, "FP32": 4, "FP64": 8, "BF16": 2}


def infer_response(model: str, version: str, request_id: str, raw: Mapping[str, tuple[str, tuple[int, ...], Any]],
                   final: bool | None) -> service_pb2.ModelInferResponse:
    """A KServe response from outputs as the C API binding copies them out (`Response.raw`: name -> (datatype, shape,
    payload)). Triton's bytes go out as they came, without numpy: its BYTES layout (4-byte little-endian length,
    then the element) is KServe's raw_output_contents layout. An output whose shape does not hold its elements goes
    out flat, with its element count as the shape."""
    return _fill_infer_response(service_pb2.ModelInferResponse(), model, version, request_id, raw, final)


def stream_response(model: str, version: str, request_id: str, raw: Mapping[str, tuple[str, tuple[int, ...], Any]],
                    final: bool) -> service_pb2.ModelStreamInferResponse:
    """A ModelStreamInfer message holding `infer_response(...)`, filled in place (a response passed to the
    message's constructor would be copied into it)."""
    message = service_pb2.ModelStreamInferResponse()
    _fill_infer_response(message.infer_response, model, version, request_id, raw, final)
    return message


def _fill_infer_response(response: service_pb2.ModelInferResponse, model: str, version: str, request_id: str,
                        raw: Mapping[str, tuple[str, tuple[int, ...], Any]], final: bool | None):
    response.model_name, response.model_version, response.id = model, version or "1", request_id
    for name, (datatype, shape, payload) in raw.items():
        if datatype == "BYTES":
            content, count = b"".join(struct.pack("<I", len(v)) + v for v in payload), len(payload)
        elif datatype in _ITEM_BYTES:
            content = bytes(payload)
            count = len(content) // _ITEM_BYTES[datatype]
        else:
            raise TritonError(ErrorCode.UNSUPPORTED, f"output '{name}': datatype {datatype} is not sent by this "
                                                     "front-end")
        response.outputs.add(name=name, datatype=datatype,
                             shape=list(shape) if shape and math.prod(shape) == count else [count])
        response.raw_output_contents.append(content)
    if final is not None:
        response.parameters[FINAL_PARAMETER].bool_param = final
    return response


def _version(text: str) -> int:
    try:
        return int(text) if text else -1
    except ValueError:
        raise TritonError(ErrorCode.INVALID_ARG, f"model version '{text}' is not a number") from None


class TritonServicer(service_pb2_grpc.GRPCInferenceServiceServicer):
    """GRPCInferenceService over an EmbeddedTriton."""

    def __init__(self, triton, is_draining: Callable[[], bool] = lambda: False):
        self.triton = triton
        self.server = triton.server
        self.is_draining = is_draining

    async def _abort(self, context, exc: TritonError):
        await context.abort(GRPC_CODES.get(exc.code, grpc.StatusCode.UNKNOWN), exc.message)

    async def ServerLive(self, request, context):
        return service_pb2.ServerLiveResponse(live=self.server.live())

    async def ServerReady(self, request, context):
        return service_pb2.ServerReadyResponse(ready=not self.is_draining() and self.server.ready())

    async def ModelReady(self, request, context):
        try:
            ready = self.server.model_ready(request.name, _version(request.version))
        except TritonError:
            ready = False
        return service_pb2.ModelReadyResponse(ready=ready and not self.is_draining())

    async def ServerMetadata(self, request, context):
        meta = self.server.metadata()
        return service_pb2.ServerMetadataResponse(name=meta.get("name", ""), version=meta.get("version", ""),
                                                  extensions=meta.get("extensions", []))

    async def ModelMetadata(self, request, context):
        try:
            meta = self.server.model_metadata(request.name, _version(request.version))
        except TritonError as exc:
            await self._abort(context, exc)
        return json_format.ParseDict(meta, service_pb2.ModelMetadataResponse(), ignore_unknown_fields=True)

    async def ModelConfig(self, request, context):
        try:
            config = self.server.model_config(request.name, _version(request.version))
        except TritonError as exc:
            await self._abort(context, exc)
        response = service_pb2.ModelConfigResponse()
        json_format.ParseDict(config, response.config, ignore_unknown_fields=True)
        return response

    async def ModelStatistics(self, request, context):
        try:
            stats = self.server.model_statistics(request.name, _version(request.version))
        except TritonError as exc:
            await self._abort(context, exc)
        return json_format.ParseDict(stats, service_pb2.ModelStatisticsResponse(), ignore_unknown_fields=True)

    async def RepositoryIndex(self, request, context):
        response = service_pb2.RepositoryIndexResponse()
        for model in self.server.model_index(ready_only=request.ready):
            response.models.add(name=model.get("name", ""), version=model.get("version", ""),
                                state=model.get("state", ""), reason=model.get("reason", ""))
        return response

    def _send(self, request: service_pb2.ModelInferRequest):
        parameters = {k: _parameter_value(v) for k, v in request.parameters.items() if k not in FRONTEND_PARAMETERS}
        return infer(self.server, request.model_name, request_inputs(request), request_id=request.id,
                     version=_version(request.model_version), parameters=parameters,
                     outputs=[o.name for o in request.outputs])

    async def ModelInfer(self, request, context):
        try:
            record = KServeRecord.open("ModelInfer", request, metadata_dict(context.invocation_metadata()))
        except ValueError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        try:
            return await self._model_infer(request, context, record)
        except asyncio.CancelledError:
            record.status = "CANCELLED"
            raise
        except BaseException:
            code = context.code()  # what an abort set; an exception of ours answers UNKNOWN
            record.status = code.name if isinstance(code, grpc.StatusCode) else "UNKNOWN"
            raise
        finally:
            record.close()

    async def _model_infer(self, request, context, record: KServeRecord):
        try:
            if self.server.model_is_decoupled(request.model_name, _version(request.model_version)):
                await context.abort(grpc.StatusCode.UNIMPLEMENTED, DECOUPLED_GRPC_MESSAGE)
            stream = self._send(request)
        except TritonError as exc:
            await self._abort(context, exc)
        except RequestError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        try:
            answer = None
            async for response in stream:
                if response.error is not None:
                    await self._abort(context, response.error)
                if response.raw:
                    record.response_left()
                    answer = infer_response(request.model_name, request.model_version, request.id,
                                            response.raw, None)
        finally:
            stream.cancel()  # no-op once finished; a client gone mid-call cancels the request
        return answer or infer_response(request.model_name, request.model_version, request.id, {}, None)

    async def ModelStreamInfer(self, request_iterator, context):
        metadata = metadata_dict(context.invocation_metadata())

        async def one(request: service_pb2.ModelInferRequest, emit) -> None:
            request_id = request.id
            empty_final = _parameter_value(request.parameters["triton_enable_empty_final_response"]) is True \
                if "triton_enable_empty_final_response" in request.parameters else False
            try:
                record = KServeRecord.open("ModelStreamInfer", request, metadata)
            except ValueError as exc:
                emit(_error(request_id, str(exc)))
                return
            try:
                try:
                    stream = self._send(request)
                except (TritonError, RequestError) as exc:
                    record.status = "ERROR"
                    emit(_error(request_id, str(exc)))
                    return
                try:
                    async for response in stream:
                        if response.error is not None:
                            record.status = "ERROR"
                            emit(_error(request_id, response.error.message))
                            continue
                        if response.raw or response.final and empty_final:
                            record.response_left()
                            emit(stream_response(request.model_name, request.model_version, request_id,
                                                 response.raw, response.final))
                finally:
                    stream.cancel()  # the stream went away before the request finished: Triton cancels it
            except asyncio.CancelledError:
                record.status = "CANCELLED"
                raise
            finally:
                record.close()

        async with contextlib.aclosing(fan_in(request_iterator, one)) as responses:
            async for response in responses:
                yield response


def _error(request_id: str, message: str) -> service_pb2.ModelStreamInferResponse:
    return service_pb2.ModelStreamInferResponse(error_message=message)


async def start_triton_grpc(triton, host: str, port: int,
                            is_draining: Callable[[], bool] = lambda: False) -> tuple[grpc.aio.Server, int]:
    """Bind and start KServe gRPC over the embedded Triton; returns the server and the bound port."""
    server = grpc.aio.server(options=[("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
                                      ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
                                      ("grpc.so_reuseport", 0)])
    service_pb2_grpc.add_GRPCInferenceServiceServicer_to_server(TritonServicer(triton, is_draining), server)
    bound = server.add_insecure_port(f"{host}:{port}")
    if bound == 0:
        raise RuntimeError(f"KServe gRPC: cannot bind {host}:{port}")
    await server.start()
    log.info("KServe gRPC over the embedded Triton listening on %s:%d", host, bound)
    return server, bound
