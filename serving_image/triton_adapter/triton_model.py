"""The Triton adapter behind the served-model interface: Triton in this process through the C API binding
(serving_image/triton/capi, started by serving_image/triton/embedded.py), the `openai` serving mode, in the image (the
release's libtritonserver and NVIDIA's vllm backend) and locally (nvidia-pytriton's libtritonserver and the stand-in
vllm backend).

`TritonModel` holds what does not depend on how Triton is reached, and `EmbeddedTritonModel` its transport. Here
once: the tokenizer (the front-ends render chat templates and count prompt tokens themselves; Triton's vLLM model
takes text), the request's tensors (the pure translation shared with the in-stub engine,
`serving_image.engine.vllm_backend_tensors`: text prompt, streaming on, prompt excluded, every extra output on),
reading the streamed responses back into `GenerationOutput` deltas, and mapping Triton's errors onto the served model's:

| Triton                                    | served-model error                  | OpenAI / KServe front-end     |
| ----------------------------------------- | ----------------------------------- | ----------------------------- |
| INVALID_ARG, UNSUPPORTED (a bad request)  | RequestInputError naming the field  | 400 / INVALID_ARGUMENT        |
| UNAVAILABLE, INTERNAL, NOT_FOUND (model   | ModelUnavailableError               | 503 / UNAVAILABLE             |
| unloaded), CANCELLED not asked for here   |                                     |                               |

A request this side cancels (`abort`: the client went away) is cancelled in Triton, whose backend aborts it in the
engine; its stream is closed without reading the rest.
"""

from __future__ import annotations

import abc
import asyncio
import dataclasses
import json
import logging
import re
from collections.abc import AsyncIterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from serving_image.engine.vllm_backend_tensors import (
    ClientTranslationError,
    OutputReader,
    Tensor,
    request_tensors,
    triton_prompt,
)
from serving_image.served_model import (
    CandidateScore,
    Embedding,
    GenerationOutput,
    GenerationRequest,
    HFTokenizerMixin,
    ModelInfo,
    ModelUnavailableError,
    RequestInputError,
    ServedModel,
    merge_outputs,
)

if TYPE_CHECKING:
    from llm_serving.package import VerifiedPackage

log = logging.getLogger(__name__)

NUMPY_DTYPES = {"BYTES": np.object_, "BOOL": np.bool_, "UINT32": np.uint32}
ERROR_PREFIX = "Error generating stream: "  # NVIDIA's vllm backend's (and the stand-in's) prefix
# sampling_parameters fields named in Triton's messages -> the OpenAI request's field
_FIELD_NAMES = {"structured_outputs": "response_format", "guided_decoding": "response_format",
                "extra_args": "constraint"}
_FIELD = re.compile(r"sampling_parameters\.([A-Za-z_]+)(?:\.constraint)?")
INPUT_ERROR_CODES = ("INVALID_ARG", "UNSUPPORTED")


def model_vocab_size(model_path: Path, tokenizer) -> int:
    """The model's vocabulary (config.json's vocab_size, what token ids and constraints are checked against), which
    may exceed the tokenizer's; the tokenizer's size when the directory has no model config."""
    try:
        return int(json.loads((Path(model_path) / "config.json").read_text())["vocab_size"])
    except (OSError, KeyError, ValueError, TypeError):
        return len(tokenizer)


def field_from_message(message: str) -> str | None:
    """The request field a Triton error message names, in the generation request's terms (the prompt is `prompt`)."""
    if match := _FIELD.search(message):
        return _FIELD_NAMES.get(match.group(1), match.group(1))
    for name, param in (("return_logprobs", "logprobs"), ("text_input", "prompt"),
                        ("sampling_parameters", "sampling_parameters"),
                        ("exclude_input_in_output", "exclude_input_in_output"), ("stream", "stream")):
        if name in message:
            return param
    return None


def served_model_error(code: str | None, message: str) -> RequestInputError | ModelUnavailableError:
    """Triton's error (its code's name, when known) as the served-model error the front-ends map to a status."""
    text = message[len(ERROR_PREFIX):] if message.startswith(ERROR_PREFIX) else message
    if code in INPUT_ERROR_CODES:
        return RequestInputError(text, field_from_message(text))
    if code is None and field_from_message(text) is not None and "engine" not in text:
        return RequestInputError(text, field_from_message(text))  # gRPC streams carry the message only
    return ModelUnavailableError(f"Triton: {text}")


def tensor_arrays(tensors: list[Tensor]) -> dict[str, np.ndarray]:
    return {t.name: np.array(list(t.values), dtype=NUMPY_DTYPES[t.datatype]).reshape(t.shape) for t in tensors}


def flat_outputs(outputs: Mapping[str, Any]) -> dict[str, list]:
    """Output arrays as name -> flat list (what OutputReader reads)."""
    return {name: [] if array is None else np.asarray(array).reshape(-1).tolist() for name, array in outputs.items()}


class TritonModel(HFTokenizerMixin, ServedModel):
    """The engine interface over Triton's vLLM model; `_stream` is the transport's part."""

    def __init__(self, info: ModelInfo, tokenizer, structured_key: str, model_name: str):
        self.info = info
        self._tokenizer = tokenizer
        self._adds_bos = tokenizer.bos_token_id is not None and tokenizer.encode("a")[:1] == [tokenizer.bos_token_id]
        self._structured_key = structured_key
        self._model_name = model_name

    @staticmethod
    def _load_tokenizer(tokenizer_path: Path):
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(str(tokenizer_path))

    @staticmethod
    def _structured(structured_key: str | None) -> str:
        if structured_key is not None:
            return structured_key
        from serving_image.triton.pins import load_pins

        return load_pins().pinned.structured_outputs_key

    def _decode_with_special(self, token_ids: list[int]) -> str:
        return self._tokenizer.decode(token_ids, skip_special_tokens=False)

    def request_tensors(self, request: GenerationRequest) -> list[Tensor]:
        try:
            return request_tensors(request, self._structured_key, triton_prompt(
                request, self._decode_with_special, self._tokenizer.bos_token, self._adds_bos))
        except ClientTranslationError as exc:
            raise RequestInputError(str(exc), exc.param) from exc

    @abc.abstractmethod
    def _stream(self, request_id: str, tensors: list[Tensor],
                model: str | None = None) -> AsyncIterator[list[tuple[dict[str, list], bool]]]:
        """Send the request (to the LLM, or the named model); yield the responses that have arrived, as a list of
        (flat outputs, final) in order (several when the consumer lagged), then raise the engine's error if one
        came."""

    async def generate(self, request: GenerationRequest) -> AsyncIterator[GenerationOutput]:
        if not self.is_ready():
            raise ModelUnavailableError(self.dead_reason or "Triton is not ready")
        tensors = self.request_tensors(request)
        reader = OutputReader(request.request_id, request.sampling.n, logprobs=request.sampling.logprobs)
        stream = self._stream(request.request_id, tensors)
        try:
            async for batch in stream:
                # What arrived together leaves as one delta: one SSE chunk for several tokens when this side lags.
                output = None
                for outputs, final in batch:
                    if not outputs and not final:
                        continue
                    delta = reader.read(outputs, final=final) if outputs else reader.read({}, final=True)
                    output = delta if output is None else merge_outputs(output, delta)
                if output is None:
                    continue
                yield output
                if output.finished:
                    return
        finally:
            await stream.aclose()


    # -- embeddings and scoring: the package's other Triton models (serving_image/triton/models.py) ---------------

    _embed_model: str | None = None  # the pooling model (NVIDIA's `embedding_request`), when the package embeds
    _score_model: str | None = None  # the platform's scoring model, when the package's tasks hold "score"

    async def serve_tasks(self, *, embed_model: str | None, score_model: str | None) -> None:
        """Route embeddings and scoring to the package's pooling and scoring models. The embedding size is asked of
        the served model itself (one embedding of one token), so /v1/embeddings reports what it will return."""
        self._embed_model, self._score_model = embed_model, score_model
        if embed_model is not None:
            probe = self._tokenizer.encode("a", add_special_tokens=False)[:1] or [0]
            (vector,) = await self.embed([probe], "embedding-size-probe")
            self.info = dataclasses.replace(self.info, embedding_dim=len(vector.vector))

    async def _one_answer(self, request_id: str, tensors: list[Tensor], model: str) -> dict[str, list]:
        """The outputs of a request that gets one answer (an embedding, a score)."""
        outputs: dict[str, list] | None = None
        final = False
        stream = self._stream(request_id, tensors, model=model)
        try:
            async for batch in stream:
                for flat, final in batch:
                    outputs = flat or outputs  # a decoupled model may end with an empty final response
                    if final:
                        break
                if final:
                    break
        finally:
            await stream.aclose()
        if outputs is None:
            raise ModelUnavailableError(f"Triton: model {model} ended request {request_id} without outputs")
        return outputs

    async def embed(self, inputs: list[str | list[int]], request_id: str) -> list[Embedding]:
        """One `embedding_request` per input, as NVIDIA's OpenAI front-end sends them (text, or token ids; the
        backend tokenizes text with special tokens, as the engine in the process does), all at once."""
        if self._embed_model is None:
            return await super().embed(inputs, request_id)
        if not self.is_ready():
            raise ModelUnavailableError(self.dead_reason or "Triton is not ready")

        async def one(index: int, item: str | list[int]) -> Embedding:
            body = {"input": item if isinstance(item, str) else list(item), "pooling_params": {}}
            tensors = [Tensor("embedding_request", "BYTES", (1,), (json.dumps(body).encode("utf-8"),)),
                       Tensor("return_num_input_tokens", "BOOL", (1,), (True,))]
            try:
                outputs = await self._one_answer(f"{request_id}-{index}", tensors, self._embed_model)
            except (RequestInputError, ModelUnavailableError) as exc:
                name = f"input[{index}]" if len(inputs) > 1 else "input"
                raise _as_input_error(exc, _EMBED_FIELD, lambda match, error: name) from exc
            try:
                vector = json.loads(outputs["text_output"][0])
                tokens = int(outputs["num_input_tokens"][0])
            except (KeyError, IndexError, ValueError, TypeError) as exc:
                raise ModelUnavailableError(f"Triton: model {self._embed_model} answered an embedding request "
                                             f"without the vector or its token count ({exc!r})") from exc
            return Embedding(tuple(float(x) for x in vector), tokens)

        return list(await asyncio.gather(*(one(i, item) for i, item in enumerate(inputs))))

    async def score(self, prompt: str, candidates: list[str], request_id: str) -> list[CandidateScore]:
        """The platform's scoring model: one request, every candidate scored from the prompt's prefill."""
        if self._score_model is None:
            raise RequestInputError(f"model {self.info.name} does not serve scoring through Triton: its package's "
                                   "engine.tasks has no 'score' (docs/kserve.md, \"Embeddings and scoring through "
                                   "Triton\")", "model")
        if not self.is_ready():
            raise ModelUnavailableError(self.dead_reason or "Triton is not ready")
        tensors = [Tensor("prompt", "BYTES", (1,), (prompt.encode("utf-8"),)),
                   Tensor("candidates", "BYTES", (len(candidates),), tuple(c.encode("utf-8") for c in candidates))]
        try:
            outputs = await self._one_answer(request_id, tensors, self._score_model)
        except (RequestInputError, ModelUnavailableError) as exc:
            raise _as_input_error(exc, _SCORE_FIELD, _score_param) from exc
        logprobs, counts = outputs.get("logprob", []), outputs.get("num_tokens", [])
        if len(logprobs) != len(candidates) or len(counts) != len(candidates):
            raise ModelUnavailableError(f"Triton: model {self._score_model} answered {len(logprobs)} scores for "
                                         f"{len(candidates)} candidates")
        return [CandidateScore(logprob=float(lp), tokens=int(n)) for lp, n in zip(logprobs, counts, strict=True)]


# What an embedding or scoring model's error names: the stand-in's `embedding_request...` fields, the scoring
# model's inputs ("input 'candidates' element 2", "candidates[2]: ..."), in the OpenAI request's terms.
_EMBED_FIELD = re.compile(r"embedding_request(\.[a-z_.]+)?|does not support 'embed'")
_SCORE_FIELD = re.compile(r"candidates\[(\d+)\]|input 'candidates' element (\d+)|input '(candidates|prompt)'")


def _score_param(match: re.Match | None, error: Exception) -> str | None:
    if match is None:
        return getattr(error, "param", None)
    index = match.group(1) or match.group(2)
    return f"candidates[{index}]" if index is not None else match.group(3)


def _as_input_error(exc: RequestInputError | ModelUnavailableError, pattern: re.Pattern,
                    param) -> RequestInputError | ModelUnavailableError:
    """The model's refusal as an input error naming the OpenAI field. gRPC streams carry no status code, so a
    refusal arriving over one (an UNAVAILABLE here) is recognized by the field its message names; the backends'
    unavailable messages name the engine, never a field."""
    text = str(exc)
    match = pattern.search(text)
    if isinstance(exc, RequestInputError) or (match and "engine" not in text):
        return RequestInputError(text.removeprefix("Triton: "), param(match, exc))
    return exc


class EmbeddedTritonModel(TritonModel):
    """Triton in this process (serving_image/triton/embedded.py), through the C API binding."""

    def __init__(self, triton, info: ModelInfo, tokenizer, structured_key: str):
        super().__init__(info, tokenizer, structured_key, info.name)
        self.triton = triton  # EmbeddedTriton
        self._inflight: dict[str, Any] = {}
        self._stopped = False

    @classmethod
    def over(cls, triton, *, model_name: str, version: str, tokenizer_path: Path, max_model_len: int,
             structured_key: str | None = None) -> EmbeddedTritonModel:
        tokenizer = cls._load_tokenizer(tokenizer_path)
        info = ModelInfo(name=model_name, version=version, max_model_len=max_model_len,
                         vocab_size=model_vocab_size(tokenizer_path, tokenizer), eos_token_id=tokenizer.eos_token_id)
        return cls(triton, info, tokenizer, cls._structured(structured_key))

    def is_ready(self) -> bool:
        return self.dead_reason is None

    @property
    def dead_reason(self) -> str | None:
        if self._stopped:
            return "Triton stopped"
        return self.triton.dead_reason

    async def _stream(self, request_id: str, tensors: list[Tensor],
                      model: str | None = None) -> AsyncIterator[list[tuple[dict[str, list], bool]]]:
        from serving_image.triton.capi import TritonError
        from serving_image.triton.capi.inference import Input, infer

        inputs = [Input.from_values(t.name, t.datatype, t.shape, t.values) for t in tensors]
        try:
            stream = infer(self.triton.server, model or self._model_name, inputs, request_id=request_id)
        except TritonError as exc:
            raise served_model_error(exc.code.name, exc.message) from exc
        self._inflight[request_id] = stream
        try:
            async for response in stream:
                batch = []
                for item in (response, *stream.ready()):
                    if item.error is not None:
                        if batch:
                            yield batch
                        raise served_model_error(item.error.code.name, item.error.message)
                    batch.append((item.flat(), item.final))
                yield batch
        finally:
            self._inflight.pop(request_id, None)
            if not stream.finished:
                stream.cancel()  # the consumer stopped early (client gone): the backend aborts it in the engine

    async def abort(self, request_id: str) -> None:
        stream = self._inflight.pop(request_id, None)
        if stream is not None:
            stream.cancel()

    async def shutdown(self) -> None:
        """Cancel nothing: stopping the server lets in-flight requests finish (up to its exit timeout)."""
        self._stopped = True
        await self.triton.stop()


async def start_embedded_triton_model(package: VerifiedPackage, workdir: Path, max_model_len: int,
                              engine_overrides: dict | None = None,
                              companions: list[VerifiedPackage] = ()) -> EmbeddedTritonModel:
    """`openai` mode over Triton (startup step 4): start Triton in this process on the repository of the package
    and its companions (serving_image/triton/runtime.py `start_embedded_triton`) and return the served model over
    the main package's LLM, its pooling and scoring models serving embeddings and scores."""
    from serving_image.triton.models import package_models
    from serving_image.triton.pins import load_pins
    from serving_image.triton.runtime import start_embedded_triton

    manifest = package.manifest
    triton, max_model_len = await start_embedded_triton(package, workdir, max_model_len, engine_overrides,
                                                        companions)
    models = package_models(manifest)  # the LLM, and its pooling and scoring models when its tasks say so
    try:
        tokenizer = package.root / (manifest.engine.tokenizer or manifest.engine.model)
        engine = EmbeddedTritonModel.over(triton, model_name=manifest.model.id, version=manifest.model.version,
                                           tokenizer_path=tokenizer, max_model_len=max_model_len,
                                           structured_key=load_pins().pinned.structured_outputs_key)
        await engine.serve_tasks(embed_model=models.embed, score_model=models.score)
        return engine
    except BaseException:
        await triton.stop()
        raise
