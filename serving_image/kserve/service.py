"""The KServe v2 model service over the engine interface, shared by the gRPC (8001) and HTTP (8000) front-ends.

It owns what both protocols mean: model lookup, readiness, metadata (the §3.3 contract), running one generate call
against the engine and recording it in the Triton-named front-end metrics. The wire formats live in `grpc_server`
and `http_app`.
"""

from __future__ import annotations

import importlib.metadata
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

from llm_serving.tensor_contract import VLLM_INPUTS, VLLM_OUTPUTS, TensorSpec
from serving_image.engine.base import Engine, EngineInputError, EngineUnavailableError, context_window_error
from serving_image.kserve.tensors import Tensor
from serving_image.kserve.translate import GenerateCall, KServeInputError, ResponseBuilder, parse_generate
from serving_image.metrics.frontend import FrontendMetrics

# Triton's answer to a unary call on a decoupled model (grpc ModelInfer and HTTP /infer), word for word: the
# vLLM backend sets `model_transaction_policy { decoupled: true }`, and Triton's front-ends refuse such models with
# TRITONSERVER_ERROR_UNSUPPORTED (gRPC UNIMPLEMENTED, HTTP 501 in current releases). See docs/kserve.md.
DECOUPLED_GRPC_MESSAGE = "ModelInfer RPC doesn't support models with decoupled transaction policy"
DECOUPLED_HTTP_MESSAGE = "HTTP end point doesn't support models with decoupled transaction policy"
# The version directory of the generated Triton repository (serving_image/triton/repository.py).
TRITON_MODEL_VERSION = "1"
SERVER_NAME = "llm-serving"
EXTENSIONS = ("generate", "model_configuration")


class ModelNotFound(LookupError):
    pass


class NotReady(RuntimeError):
    pass


def _server_version() -> str:
    try:
        return importlib.metadata.version("llm-serving")
    except importlib.metadata.PackageNotFoundError:
        return "0"


@dataclass(frozen=True)
class Result:
    """One response of a generate call: its tensors and whether it is the last one."""

    tensors: list[Tensor]
    final: bool


class KServeModelService:
    def __init__(self, engine: Engine, metrics: FrontendMetrics | None, structured_key: str,
                 is_draining: Callable[[], bool] = lambda: False):
        self.engine = engine
        self.info = engine.info
        self.metrics = metrics
        self.structured_key = structured_key
        self.is_draining = is_draining
        self.server_version = _server_version()
        if metrics is not None:
            metrics.register_model(self.info.name, self.info.version)

    # -- health and metadata ---------------------------------------------------------------------------------------

    def live(self) -> bool:
        return True

    def ready(self) -> bool:
        return not self.is_draining() and self.engine.is_ready()

    def check_model(self, name: str, version: str = "") -> None:
        if name != self.info.name or version not in ("", TRITON_MODEL_VERSION, self.info.version):
            what = f"'{name}'" + (f" version {version}" if version else "")
            raise ModelNotFound(f"Request for unknown model: {what} is not found")

    def model_ready(self, name: str, version: str = "") -> bool:
        try:
            self.check_model(name, version)
        except ModelNotFound:
            return False
        return self.ready()

    def model_metadata(self) -> dict:
        def spec(t: TensorSpec) -> dict:
            return {"name": t.name, "datatype": t.datatype, "shape": list(t.shape)}

        return {"name": self.info.name, "versions": [TRITON_MODEL_VERSION], "platform": "vllm",
                "inputs": [spec(t) for t in VLLM_INPUTS], "outputs": [spec(t) for t in VLLM_OUTPUTS]}

    def server_metadata(self) -> dict:
        return {"name": SERVER_NAME, "version": self.server_version, "extensions": list(EXTENSIONS)}

    # -- inference -------------------------------------------------------------------------------------------------

    def parse(self, tensors: list[Tensor], parameters: dict, outputs: list[str], request_id: str) -> GenerateCall:
        return parse_generate(tensors, parameters, info=self.info, request_id=request_id or f"kserve-{uuid.uuid4()}",
                              structured_key=self.structured_key, output_names=outputs)

    def check_fits(self, call: GenerateCall) -> None:
        """What the engine would refuse about the request's size, found without running it (for the unary calls,
        which never reach the engine): the prompt and max_tokens against the context window."""
        prompt = call.request.prompt
        tokens = len(prompt) if isinstance(prompt, list) else len(
            self.engine.encode_prompt(prompt, add_special_tokens=call.request.add_special_tokens))
        if error := context_window_error(tokens, call.request.sampling.max_tokens, self.info.max_model_len,
                                         prompt_field="text_input",
                                         max_tokens_field="sampling_parameters.max_tokens"):
            raise KServeInputError(error.param, str(error))

    def observe_rejected(self) -> None:
        if self.metrics is not None:
            self.metrics.observe(self.info.name, self.info.version, success=False, duration_s=0.0,
                                 failure_reason="REJECTED")

    async def run(self, call: GenerateCall) -> AsyncIterator[Result]:
        """Run one call against the engine. Raises KServeInputError (refused before any output) or
        EngineUnavailableError; a client that goes away aborts the engine request."""
        started = time.perf_counter()
        builder = ResponseBuilder(call)
        status, first = "CANCELED", None  # until it ends otherwise: the consumer stopped or was cancelled
        engine_request = call.request
        pending = self.metrics.pending(self.info.name, self.info.version) if self.metrics else None
        if pending is not None:
            pending.__enter__()
        finished = False
        try:
            if not self.ready():
                status = "BACKEND"
                raise EngineUnavailableError(self.engine.dead_reason or "the server is not ready (draining)")
            try:
                async for output in self.engine.generate(engine_request):
                    if first is None:
                        first = time.perf_counter() - started
                    tensors = builder.add(output)
                    if tensors is not None:
                        yield Result(tensors, final=output.finished)
                    if output.finished:
                        break
            except EngineInputError as exc:
                status = "REJECTED"
                raise _input_error(exc) from exc
            except EngineUnavailableError:
                status = "BACKEND"
                raise
            if not call.stream:
                yield Result(builder.final(), final=True)
            finished = True
            status = "OK"
        finally:
            if not finished:
                await self.engine.abort(engine_request.request_id)
            if pending is not None:
                pending.__exit__(None, None, None)
            if self.metrics is not None:
                self.metrics.observe(self.info.name, self.info.version, success=status == "OK",
                                     duration_s=time.perf_counter() - started,
                                     failure_reason="OTHER" if status == "OK" else status,
                                     first_response_s=first if status == "OK" else None)


def _input_error(exc: EngineInputError) -> KServeInputError:
    """The engine's refusal, named in KServe terms (the prompt is the text_input tensor)."""
    param = exc.param or "sampling_parameters"
    if param in ("prompt", "messages"):
        return KServeInputError("text_input", f"input 'text_input': {exc}")
    return KServeInputError(f"sampling_parameters.{param}", f"sampling_parameters.{param}: {exc}")
