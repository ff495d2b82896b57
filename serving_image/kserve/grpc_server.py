"""KServe v2 gRPC (`inference.GRPCInferenceService`, port 8001) on grpc.aio, with the servicer stubs tritonclient
ships. Behaves as Triton does for its vLLM model, a decoupled model (docs/kserve.md):

- ModelStreamInfer is the way to infer: any number of requests on one stream, answered as they arrive; an error
  in one request is sent on the stream as `error_message` (the stream and the server carry on), exactly as Triton's
  stream handler does. Every response carries the `triton_final_response` parameter.
- ModelInfer answers UNIMPLEMENTED with Triton's own message. One difference, documented: the request is checked
  first, so a malformed one gets INVALID_ARGUMENT naming the tensor or field (Triton would answer UNIMPLEMENTED
  to it too).
"""

from __future__ import annotations

import contextlib
import logging

import grpc
from tritonclient.grpc import service_pb2, service_pb2_grpc

from serving_image.engine.base import EngineUnavailableError
from serving_image.kserve.service import (
    DECOUPLED_GRPC_MESSAGE,
    TRITON_MODEL_VERSION,
    KServeModelService,
    ModelNotFound,
)
from serving_image.kserve.stream_fan_in import fan_in
from serving_image.kserve.tensors import Tensor, TensorError, decode_grpc_input, to_grpc_output
from serving_image.kserve.translate import GenerateCall, KServeInputError

log = logging.getLogger(__name__)

# Larger messages are refused by gRPC itself (RESOURCE_EXHAUSTED) before any of this code runs; anything below is
# checked element by element (tensors.MAX_BYTES_ELEMENT) and refused as INVALID_ARGUMENT naming the tensor.
MAX_MESSAGE_BYTES = 64 * 1024 * 1024


def _parameter_value(param: service_pb2.InferParameter):
    which = param.WhichOneof("parameter_choice")
    return None if which is None else getattr(param, which)


def decode_request(request: service_pb2.ModelInferRequest) -> tuple[list[Tensor], dict, list[str]]:
    raw = list(request.raw_input_contents)
    if raw and len(raw) != len(request.inputs):
        raise KServeInputError("raw_input_contents", f"raw_input_contents has {len(raw)} entries for "
                               f"{len(request.inputs)} inputs: give every input's content raw, or none")
    tensors = []
    for i, tensor in enumerate(request.inputs):
        try:
            tensors.append(decode_grpc_input(tensor, raw[i] if raw else None))
        except TensorError as exc:
            raise KServeInputError(exc.field, str(exc)) from exc
    parameters = {k: _parameter_value(v) for k, v in request.parameters.items()}
    return tensors, parameters, [o.name for o in request.outputs]


def encode_response(call: GenerateCall, tensors: list[Tensor], final: bool, model_name: str,
                    request_id: str) -> service_pb2.ModelInferResponse:
    response = service_pb2.ModelInferResponse(model_name=model_name, model_version=TRITON_MODEL_VERSION,
                                              id=request_id)
    for tensor in tensors:
        response.raw_output_contents.append(to_grpc_output(tensor, response.outputs.add()))
    response.parameters["triton_final_response"].bool_param = final
    return response


class KServeServicer(service_pb2_grpc.GRPCInferenceServiceServicer):
    def __init__(self, service: KServeModelService):
        self.service = service

    async def ServerLive(self, request, context):
        return service_pb2.ServerLiveResponse(live=self.service.live())

    async def ServerReady(self, request, context):
        return service_pb2.ServerReadyResponse(ready=self.service.ready())

    async def ModelReady(self, request, context):
        return service_pb2.ModelReadyResponse(ready=self.service.model_ready(request.name, request.version))

    async def ServerMetadata(self, request, context):
        meta = self.service.server_metadata()
        return service_pb2.ServerMetadataResponse(name=meta["name"], version=meta["version"],
                                                  extensions=meta["extensions"])

    async def ModelMetadata(self, request, context):
        try:
            self.service.check_model(request.name, request.version)
        except ModelNotFound as exc:
            await context.abort(grpc.StatusCode.NOT_FOUND, str(exc))
        meta = self.service.model_metadata()
        response = service_pb2.ModelMetadataResponse(name=meta["name"], versions=meta["versions"],
                                                     platform=meta["platform"])
        for kind in ("inputs", "outputs"):
            for spec in meta[kind]:
                getattr(response, kind).add(name=spec["name"], datatype=spec["datatype"], shape=spec["shape"])
        return response

    async def ModelConfig(self, request, context):
        try:
            self.service.check_model(request.name, request.version)
        except ModelNotFound as exc:
            await context.abort(grpc.StatusCode.NOT_FOUND, str(exc))
        from serving_image.triton.repository import vllm_model_config

        config = vllm_model_config(self.service.info.name)
        response = service_pb2.ModelConfigResponse()
        response.config.CopyFrom(config)
        return response

    async def ModelInfer(self, request, context):
        try:
            self.service.check_model(request.model_name, request.model_version)
            tensors, parameters, outputs = decode_request(request)
            self.service.check_fits(self.service.parse(tensors, parameters, outputs, request.id))
        except ModelNotFound as exc:
            await context.abort(grpc.StatusCode.NOT_FOUND, str(exc))
        except KServeInputError as exc:
            self.service.observe_rejected()
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        await context.abort(grpc.StatusCode.UNIMPLEMENTED, DECOUPLED_GRPC_MESSAGE)

    async def ModelStreamInfer(self, request_iterator, context):
        async def one(request: service_pb2.ModelInferRequest, emit) -> None:
            request_id = request.id
            try:
                self.service.check_model(request.model_name, request.model_version)
                tensors, parameters, outputs = decode_request(request)
                call = self.service.parse(tensors, parameters, outputs, request_id)
            except ModelNotFound as exc:
                await emit(_error(request_id, str(exc)))
                return
            except KServeInputError as exc:
                self.service.observe_rejected()
                await emit(_error(request_id, str(exc)))
                return
            empty_final = _parameter_value(request.parameters["triton_enable_empty_final_response"]) is True \
                if "triton_enable_empty_final_response" in request.parameters else False
            results = self.service.run(call)
            try:
                async for result in results:
                    final = result.final and not empty_final
                    await emit(service_pb2.ModelStreamInferResponse(infer_response=encode_response(
                        call, result.tensors, final, request.model_name, request_id)))
                if empty_final:
                    response = service_pb2.ModelInferResponse(model_name=request.model_name,
                                                              model_version=TRITON_MODEL_VERSION, id=request_id)
                    response.parameters["triton_final_response"].bool_param = True
                    await emit(service_pb2.ModelStreamInferResponse(infer_response=response))
            except (KServeInputError, EngineUnavailableError) as exc:
                await emit(_error(request_id, str(exc)))
            except Exception as exc:  # anything else still ends this request with an answer, never a silent hang
                log.exception("request %s failed", request_id)
                await emit(_error(request_id, f"internal error: {type(exc).__name__}: {exc}"))
            finally:
                await results.aclose()

        async with contextlib.aclosing(fan_in(request_iterator, one)) as responses:
            async for response in responses:
                yield response


def _error(request_id: str, message: str) -> service_pb2.ModelStreamInferResponse:
    # Triton's core prefixes request errors the same way; the id ties the error to the request on a shared stream.
    return service_pb2.ModelStreamInferResponse(error_message=f"[request id: {request_id or '<id_unknown>'}] {message}")


async def start_grpc_server(service: KServeModelService, host: str, port: int) -> tuple[grpc.aio.Server, int]:
    """Bind and start; returns the server and the bound port (port 0 picks a free one)."""
    server = grpc.aio.server(options=[("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
                                      ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
                                      ("grpc.so_reuseport", 0)])
    service_pb2_grpc.add_GRPCInferenceServiceServicer_to_server(KServeServicer(service), server)
    bound = server.add_insecure_port(f"{host}:{port}")
    if bound == 0:
        raise RuntimeError(f"KServe gRPC: cannot bind {host}:{port}")
    await server.start()
    log.info("KServe gRPC listening on %s:%d", host, bound)
    return server, bound
