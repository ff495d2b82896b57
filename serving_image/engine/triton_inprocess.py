"""Triton in-process: Triton's Python API (`tritonserver`, shipped in the Triton image) behind the engine interface,
as the OpenAI front-end uses it inside the image in the `openai` serving mode (docs/architecture.md §3.4).

Triton loads the generated model repository (serving_image/triton/repository.py) in this process, in explicit model
control mode, and every request goes to the decoupled vLLM model through `Model.async_infer`, with the same tensors
the KServe clients send (the shared pure translation in `serving_image.kserve.translate`). The `tritonserver` module
only exists inside the Triton image: it is imported when an engine is started, never at module import, so the rest
of this module (the tensor conversion) is importable and tested everywhere.

Written against Triton's documented Python API (triton-inference-server/core, python/tritonserver):
`tritonserver.Server(model_repository=..., model_control_mode=ModelControlMode.EXPLICIT)`, `server.start(
wait_until_ready=True)`, `server.load(name) -> Model`, `Model.async_infer(inputs=..., request_id=...)` yielding
responses with `.outputs` (name -> Tensor; BYTES via `to_string_array()`, numbers via DLPack), `.error`, `.final`,
and `.cancel()` on the response iterator.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Mapping
from pathlib import Path
from typing import Any

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


def inprocess_inputs(tensors: list[Tensor]) -> dict[str, np.ndarray]:
    """The `inputs` mapping Model.async_infer takes: numpy arrays of the contract's dtypes and shapes."""
    return {t.name: np.array(list(t.values), dtype=_NUMPY[t.datatype]).reshape(t.shape) for t in tensors}


def inprocess_outputs(outputs: Mapping[str, Any]) -> dict[str, list]:
    """A response's output tensors as name -> flat list, for OutputReader. BYTES tensors are read with
    `to_string_array()` (DLPack has no string type); numeric ones through DLPack."""
    flat: dict[str, list] = {}
    for name, tensor in outputs.items():
        if name in ("text_output", "finish_reason"):
            flat[name] = [str(v) for v in np.asarray(tensor.to_string_array()).reshape(-1)]
        else:
            flat[name] = np.from_dlpack(tensor).reshape(-1).tolist()
    return flat


class TritonInProcessEngine(HFTokenizerMixin, Engine):
    def __init__(self, server, model, info: ModelInfo, tokenizer, structured_key: str):
        self._server = server
        self._model = model
        self.info = info
        self._tokenizer = tokenizer
        self._adds_bos = tokenizer.bos_token_id is not None and tokenizer.encode("a")[:1] == [tokenizer.bos_token_id]
        self._structured_key = structured_key
        self._inflight: dict[str, Any] = {}
        self._stopped = False

    @classmethod
    async def start(cls, *, repository: Path, model_name: str, version: str, tokenizer_path: Path,
                    max_model_len: int, structured_key: str | None = None) -> TritonInProcessEngine:
        import tritonserver  # only inside the Triton image
        from transformers import AutoTokenizer

        if structured_key is None:
            from serving_image.triton.pins import load_pins

            structured_key = load_pins().pinned.structured_outputs_key
        server = tritonserver.Server(model_repository=str(repository),
                                     model_control_mode=tritonserver.ModelControlMode.EXPLICIT)
        # Starting Triton and loading the vLLM model block for minutes: keep the event loop free meanwhile.
        await asyncio.to_thread(server.start, wait_until_ready=True)
        try:
            model = await asyncio.to_thread(server.load, model_name)
            if not model.ready():
                raise EngineUnavailableError(f"Triton loaded {model_name} but reports it not ready")
            tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_path))
        except BaseException:
            server.stop()
            raise
        from serving_image.engine.triton_remote import model_vocab_size

        info = ModelInfo(name=model_name, version=version, max_model_len=max_model_len,
                         vocab_size=model_vocab_size(tokenizer_path, tokenizer), eos_token_id=tokenizer.eos_token_id)
        return cls(server, model, info, tokenizer, structured_key)

    def is_ready(self) -> bool:
        return not self._stopped and self._server.ready() and self._model.ready()

    @property
    def dead_reason(self) -> str | None:
        if self._stopped:
            return "Triton stopped"
        if not self._server.live():
            return "Triton server is not live"
        if not self._model.ready():
            return f"Triton reports model {self.info.name} not ready"
        return None

    def _decode_with_special(self, token_ids: list[int]) -> str:
        return self._tokenizer.decode(token_ids, skip_special_tokens=False)

    async def generate(self, request: EngineRequest) -> AsyncIterator[EngineOutput]:
        if not self.is_ready():
            raise EngineUnavailableError(self.dead_reason or "Triton not ready")
        try:
            inputs = inprocess_inputs(request_tensors(request, self._structured_key, triton_prompt(
                request, self._decode_with_special, self._tokenizer.bos_token, self._adds_bos)))
        except ClientTranslationError as exc:
            raise EngineInputError(str(exc), exc.param) from exc
        reader = OutputReader(request.request_id, request.sampling.n)
        responses = self._model.async_infer(inputs=inputs, request_id=request.request_id)
        self._inflight[request.request_id] = responses
        try:
            async for response in responses:
                if response.error is not None:
                    raise EngineInputError(str(response.error))
                if response.outputs:
                    output = reader.read(inprocess_outputs(response.outputs), final=bool(response.final))
                elif response.final:
                    output = reader.read({}, final=True)
                else:
                    continue
                yield output
                if output.finished:
                    return
        finally:
            self._inflight.pop(request.request_id, None)

    async def abort(self, request_id: str) -> None:
        responses = self._inflight.pop(request_id, None)
        if responses is not None:
            responses.cancel()

    async def shutdown(self) -> None:
        self._stopped = True
        for responses in list(self._inflight.values()):
            responses.cancel()
        await asyncio.to_thread(self._server.stop)
