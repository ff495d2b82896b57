"""Triton remote: a standalone Triton (or this project's local KServe server) over KServe v2 gRPC, behind the engine
interface, so the OpenAI front-end can sit in front of it.

Every request is one `ModelStreamInfer` request (the vLLM model is decoupled) built by the shared pure translation
(`serving_image.kserve.translate`): text prompt, streaming on, prompt excluded, every extra output switched on. The
tokenizer is loaded locally from the model package (the front-end renders chat templates and counts prompt tokens
itself; Triton's API carries text only).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from pathlib import Path

import numpy as np

from serving_image.engine.base import (
    Engine,
    EngineInputError,
    EngineOutput,
    EngineRequest,
    EngineUnavailableError,
    HFTokenizerMixin,
    ModelInfo,
)
from serving_image.kserve.tensors import Tensor
from serving_image.kserve.translate import ClientTranslationError, OutputReader, request_tensors, triton_prompt

log = logging.getLogger(__name__)

_NUMPY = {"BYTES": np.object_, "BOOL": np.bool_, "UINT32": np.uint32}


def to_infer_inputs(module, tensors: list[Tensor]) -> list:
    """tritonclient InferInput objects (module: tritonclient.grpc or tritonclient.grpc.aio) from Tensors."""
    inputs = []
    for tensor in tensors:
        item = module.InferInput(tensor.name, list(tensor.shape), tensor.datatype)
        item.set_data_from_numpy(np.array(list(tensor.values), dtype=_NUMPY[tensor.datatype]).reshape(tensor.shape))
        inputs.append(item)
    return inputs


def result_outputs(result) -> dict[str, list]:
    """A tritonclient InferResult's outputs as name -> flat list (what OutputReader reads)."""
    outputs = {}
    for output in result.get_response().outputs:
        array = result.as_numpy(output.name)
        outputs[output.name] = [] if array is None else array.reshape(-1).tolist()
    return outputs


def model_vocab_size(model_path: Path, tokenizer) -> int:
    """The model's vocabulary (config.json's vocab_size, what token ids and constraints are checked against), which
    may exceed the tokenizer's; the tokenizer's size when the directory has no model config."""
    import json

    try:
        return int(json.loads((Path(model_path) / "config.json").read_text())["vocab_size"])
    except (OSError, KeyError, ValueError, TypeError):
        return len(tokenizer)


def _input_error_from_message(message: str) -> EngineInputError:
    """Triton's stream errors carry text only; the local server and the backend both name the field in it."""
    field = None
    for name in ("sampling_parameters", "text_input", "exclude_input_in_output", "stream"):
        if name in message:
            field = name
            break
    return EngineInputError(message, {"text_input": "prompt"}.get(field or "", field))


class TritonRemoteEngine(HFTokenizerMixin, Engine):
    def __init__(self, client, info: ModelInfo, tokenizer, structured_key: str, model_name: str):
        self._client = client
        self.info = info
        self._tokenizer = tokenizer
        self._adds_bos = tokenizer.bos_token_id is not None and tokenizer.encode("a")[:1] == [tokenizer.bos_token_id]
        self._structured_key = structured_key
        self._model_name = model_name
        self._ready = True
        self._dead: str | None = None
        self._inflight: dict[str, asyncio.Task] = {}

    @classmethod
    async def connect(cls, *, url: str, model_name: str, version: str, tokenizer_path: Path,
                      structured_key: str | None = None, max_model_len: int | None = None) -> TritonRemoteEngine:
        import tritonclient.grpc.aio as grpcaio
        from transformers import AutoTokenizer

        if structured_key is None:
            from serving_image.triton.pins import load_pins

            structured_key = load_pins().pinned.structured_outputs_key
        client = grpcaio.InferenceServerClient(url)
        try:
            if not await client.is_model_ready(model_name):
                raise EngineUnavailableError(f"model {model_name} is not ready on Triton at {url}")
            await client.get_model_metadata(model_name)
        except Exception:
            await client.close()
            raise
        tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_path))
        config_len = getattr(tokenizer, "model_max_length", None)
        info = ModelInfo(name=model_name, version=version,
                         max_model_len=max_model_len or (config_len if config_len and config_len < 10**7 else 4096),
                         vocab_size=model_vocab_size(tokenizer_path, tokenizer), eos_token_id=tokenizer.eos_token_id)
        return cls(client, info, tokenizer, structured_key, model_name)

    def is_ready(self) -> bool:
        return self._ready and self._dead is None

    @property
    def dead_reason(self) -> str | None:
        return self._dead

    def _decode_with_special(self, token_ids: list[int]) -> str:
        return self._tokenizer.decode(token_ids, skip_special_tokens=False)

    async def generate(self, request: EngineRequest) -> AsyncIterator[EngineOutput]:
        import grpc
        import tritonclient.grpc.aio as grpcaio
        from tritonclient.utils import InferenceServerException

        if not self.is_ready():
            raise EngineUnavailableError(self._dead or "Triton engine not ready")
        try:
            tensors = request_tensors(request, self._structured_key, triton_prompt(
                request, self._decode_with_special, self._tokenizer.bos_token, self._adds_bos))
        except ClientTranslationError as exc:
            raise EngineInputError(str(exc), exc.param) from exc
        inputs = to_infer_inputs(grpcaio, tensors)
        reader = OutputReader(request.request_id, request.sampling.n)
        done = asyncio.Event()

        async def requests():
            yield {"model_name": self._model_name, "inputs": inputs, "request_id": request.request_id}
            await done.wait()  # keep the request side open until the last response arrived

        stream = self._client.stream_infer(requests())
        try:
            async for result, error in stream:
                if error is not None:
                    # An error on the stream is about this request (Triton sends it as the stream's error_message)
                    message = error.message() if isinstance(error, InferenceServerException) else str(error)
                    raise _input_error_from_message(message)
                response = result.get_response()
                # The last response says so (triton_final_response); with return_finish_reason on, every choice
                # having a finish reason says the same, which does not depend on that parameter.
                final = response.parameters["triton_final_response"].bool_param
                output = reader.read(result_outputs(result), final=final) if response.outputs else \
                    reader.read({}, final=True) if final else None
                if output is not None:
                    yield output
                    if output.finished:
                        return
        except grpc.aio.AioRpcError as exc:
            raise EngineUnavailableError(f"Triton stream failed: {exc.code().name}: {exc.details()}") from exc
        finally:
            done.set()
            if hasattr(stream, "cancel"):
                stream.cancel()

    async def abort(self, request_id: str) -> None:
        # Closing the stream (generate's finally) cancels the request on the server; nothing else to do here.
        return None

    async def shutdown(self) -> None:
        self._ready = False
        await self._client.close()
