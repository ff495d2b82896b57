"""vLLM's side of the in-stub engine (docs/architecture.md §2.3): the engine behind the stand-in `vllm` backend
(serving_image/triton_stub/backends/vllm/model.py) and the platform's scoring model, in the Python backend stub's own
process (serving_image/triton_stub/backends/vllm/engine_in_stub.py runs it on a thread of its own, with .venv-serving's
packages after the stub's).

It starts vLLM's AsyncLLM from model.json through the project's adapter (serving_image/engine/async_llm_model.py: the
same engine arguments, KV-cache sizing, structured-output settings and metrics as everywhere; vLLM's metrics go to
$PROMETHEUS_MULTIPROC_DIR, and plugins such as the constraint processor load through their entry points), then
serves the model's requests (`MessageDispatcher`) until the model is unloaded.

`sampling_parameters` is parsed here, as NVIDIA's backend does (`TritonSamplingParams.from_dict`): a JSON object;
`None` values dropped; `structured_outputs` a JSON string for StructuredOutputsParams; `guided_decoding` a string or an
object (its `backend` key refused unless xgrammar/auto); `extra_args` passed through (the platform's `constraint`
rides there and is validated as everywhere else, docs/architecture.md §3.5); every other key must be a SamplingParams
field, converted with int()/float() where the field says so. Unlike that backend, every refusal names the field.
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import math
import typing
from collections.abc import Callable
from pathlib import Path
from typing import Any

from serving_image.engine.vllm_backend_tensors import backend_logprobs
from serving_image.json_text import loads_keeping
from serving_image.served_model import (
    ModelInfo,
    ModelUnavailableError,
    RequestInputError,
    context_window_error,
)

log = logging.getLogger("llm_serving.triton.stub_vllm")

# SamplingParams fields a request may not set: the backend owns how outputs come back.
_BACKEND_OWNED = {"output_kind", "skip_clone", "output_text_buffer_length", "detokenize"}
# sampling_parameters.extra_args.constraint is read by constraint_text, from its text
_KEEP_CONSTRAINT = {"extra_args": {"constraint": None}}
_GUIDED_BACKENDS = ("xgrammar", "xgrammar:no-fallback", "auto", "xgrammar:_auto")
RESERVED_PARAMETERS = frozenset({"sequence_id", "sequence_start", "sequence_end", "priority", "timeout",
                                 "triton_enable_empty_final_response", "headers"})


class ParameterError(ValueError):
    def __init__(self, field: str, message: str):
        super().__init__(message)
        self.field = field


SUBMITTED = "llm_serving_engine_requests_submitted"


@functools.cache
def submitted_counter():
    """Generate requests past their checks and handed to the engine, per model (`<SUBMITTED>_total` on the pod's
    /metrics: this process's metrics go to $PROMETHEUS_MULTIPROC_DIR, which the metrics proxy merges, like vLLM's).
    From that point a cancellation aborts the request in the engine. Created on first use, after start_engine made
    the process's metrics cache their pid (metrics/multiproc.py)."""
    from prometheus_client import Counter

    return Counter(SUBMITTED, "Generate requests past their checks and handed to the engine (from then on a "
                   "cancellation aborts them in the engine)", ["model"])


@functools.cache
def _fields() -> dict[str, Any]:
    """SamplingParams' fields and their types, read once: typing.get_type_hints costs milliseconds, which on every
    request was a third of the stub's CPU under load."""
    from vllm.sampling_params import SamplingParams

    hints = typing.get_type_hints(SamplingParams, include_extras=False)
    return {name: hint for name, hint in hints.items() if not name.startswith("_") and name not in _BACKEND_OWNED}


def _convert(field: str, value: Any, hint: Any) -> Any:
    """int()/float() where the field is a number, as the backend's type mapping does; booleans must be JSON booleans
    (the backend's bool("false") is True, so this refuses rather than guess)."""
    optional_int = hint == (int | None)
    if hint is bool:
        if not isinstance(value, bool):
            raise ParameterError(field, f"{field} must be true or false, got {value!r:.40}")
        return value
    if hint is int or optional_int:
        if isinstance(value, bool):
            raise ParameterError(field, f"{field} must be an integer, got {value!r}")
        try:
            number = int(value) if isinstance(value, int | str) else None
        except ValueError:
            number = None
        if number is None and isinstance(value, float) and value.is_integer():
            number = int(value)
        if number is None:
            raise ParameterError(field, f"{field} must be an integer, got {value!r:.60}")
        return number
    if hint is float:
        if isinstance(value, bool):
            raise ParameterError(field, f"{field} must be a number, got {value!r}")
        try:
            number = float(value) if isinstance(value, int | float | str) else None
        except ValueError:
            number = None
        if number is None or not math.isfinite(number):
            raise ParameterError(field, f"{field} must be a finite number, got {value!r:.60}")
        return number
    if hint is str and not isinstance(value, str):
        raise ParameterError(field, f"{field} must be a string, got {type(value).__name__}")
    return value


def _structured(field: str, value: Any, *, string_only: bool):
    from vllm.sampling_params import StructuredOutputsParams

    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as exc:
            raise ParameterError(field, f"{field} is not valid JSON: {exc}") from None
    elif string_only:
        raise ParameterError(field, f"{field} must be a JSON string (the vLLM backend json.loads it), e.g. "
                             f"\"{{\\\"json\\\": {{...}}}}\"; got {type(value).__name__}")
    if not isinstance(value, dict):
        raise ParameterError(field, f"{field} must hold a JSON object")
    value = dict(value)
    if not string_only and "backend" in value:
        backend = value.pop("backend")
        if backend not in _GUIDED_BACKENDS:
            raise ParameterError(f"{field}.backend", f"{field}.backend is no longer supported request-level. "
                                 f"Provided: {backend}")
    known = set(StructuredOutputsParams.__annotations__) - {n for n in StructuredOutputsParams.__annotations__
                                                            if n.startswith("_")}
    for key in value:
        if key not in known:
            raise ParameterError(f"{field}.{key}", f"{field}.{key} is not a structured-output option; options are "
                                 f"{', '.join(sorted(known))}")
    if isinstance(value.get("json"), str):
        try:
            value["json"] = json.loads(value["json"])
        except json.JSONDecodeError as exc:
            raise ParameterError(f"{field}.json", f"{field}.json is not valid JSON: {exc}") from None
    try:
        return StructuredOutputsParams(**value)
    except (TypeError, ValueError) as exc:
        raise ParameterError(field, f"{field}: {exc}") from None


def sampling_params_from_json(text: str | None, root: str, info: ModelInfo, *, json_control_bias=None):
    """vLLM SamplingParams (output_kind DELTA) from the request's `sampling_parameters` text (or its parameters,
    `root` = "parameters"). Raises ParameterError naming the field."""
    from vllm.sampling_params import RequestOutputKind, SamplingParams

    from serving_image.constraints.spec import ConstraintError, constraint_text, remember_checked

    try:
        # The constraint stays its text, read in one pass by constraint_text: an 8k-id allowed_tokens set is 48 KB
        # of JSON (json_text.py)
        params = loads_keeping(text, _KEEP_CONSTRAINT) if text else {}
    except json.JSONDecodeError as exc:
        raise ParameterError(root, f"{root} is not valid JSON: {exc}") from None
    if not isinstance(params, dict):
        raise ParameterError(root, f"{root} must be a JSON object, got {type(params).__name__}")
    params = {k: v for k, v in params.items() if v is not None}
    if root == "parameters":
        params = {k: v for k, v in params.items() if k not in RESERVED_PARAMETERS}
    fields = _fields()
    values: dict[str, Any] = {}
    structured = None
    if "structured_outputs" in params:
        structured = _structured(f"{root}.structured_outputs", params.pop("structured_outputs"), string_only=True)
    if "guided_decoding" in params:
        guided = _structured(f"{root}.guided_decoding", params.pop("guided_decoding"), string_only=False)
        structured = structured or guided
    if "lora_name" in params:
        raise ParameterError(f"{root}.lora_name", f"{root}.lora_name: LoRA feature is not enabled.")
    if "constraint" in params:
        raise ParameterError(f"{root}.constraint", f"{root}.constraint is not a SamplingParams field: send the "
                             "constraint as extra_args.constraint (SamplingParams.extra_args, where the constraint "
                             "processor reads it)")
    extra = params.pop("extra_args", None)
    if extra is not None:
        if not isinstance(extra, dict):
            raise ParameterError(f"{root}.extra_args", f"{root}.extra_args must be a JSON object")
        extra = dict(extra)
        if extra.get("constraint") is not None:
            where = f"{root}.extra_args.constraint"
            if structured is not None:
                raise ParameterError(where, f"{where} cannot be combined with structured outputs: each one alone "
                                     "decides the allowed tokens")
            try:
                # Handed on as JSON text: vLLM walks, deep-copies and msgpack-encodes every request's extra_args in
                # this process, milliseconds per request for an 8k-token allowed_tokens list as an object (§3.5).
                extra["constraint"] = remember_checked(constraint_text(extra["constraint"], info.vocab_size,
                                                                       info.eos_token_id))
            except ConstraintError as exc:
                field = where + exc.field.removeprefix("constraint")
                raise ParameterError(field, f"{field}: {exc.reason}") from None
    for key, value in params.items():
        field = f"{root}.{key}"
        if key not in fields:
            raise ParameterError(field, f"{field} is not a vLLM SamplingParams field")
        values[key] = _convert(field, value, fields[key])
    if "logit_bias" in values:
        bias = values["logit_bias"]
        if not isinstance(bias, dict):
            raise ParameterError(f"{root}.logit_bias", f"{root}.logit_bias must be an object of token id -> bias")
        values["logit_bias"] = {_convert(f"{root}.logit_bias.{k}", k, int): _convert(f"{root}.logit_bias.{k}", v,
                                                                                      float) for k, v in bias.items()}
    if json_control_bias is not None:
        kind = None
        if structured is not None and (structured.json is not None or structured.json_object):
            kind = "json_schema"
        values["logit_bias"] = json_control_bias(kind, values.get("logit_bias"))
    try:
        # skip_clone: these params are made for this one request (as vLLM's own server makes them), so AsyncLLM
        # need not deep-copy them at admission (130 µs a request on the engine's thread, in place under load)
        return SamplingParams(**values, structured_outputs=structured, extra_args=extra,
                              output_kind=RequestOutputKind.DELTA, skip_clone=True)
    except Exception as exc:  # SamplingParams' own validation (ValueError, vLLM's VLLMValidationError with .parameter)
        message = str(exc)
        named = getattr(exc, "parameter", None)
        if named not in values:
            named = next((k for k in sorted(values, key=len, reverse=True) if k in message), None)
        field = f"{root}.{named}" if named else root
        raise ParameterError(field, f"{field}: {message}") from None


# -- the process ---------------------------------------------------------------------------------------------------


def _engine_args(config: dict) -> tuple[Path, Path, dict]:
    config = dict(config)
    model = Path(config.pop("model"))
    tokenizer = Path(config.pop("tokenizer", model))
    structured = config.get("structured_outputs_config")
    if isinstance(structured, dict):
        from vllm.config import StructuredOutputsConfig

        config["structured_outputs_config"] = StructuredOutputsConfig(**structured)
    return model, tokenizer, config


def error_message(request_id: str, exc: Exception) -> dict:
    """The one error message of a failed request, for generation, embeddings and scores alike: a client error
    (INVALID_ARG, with the field it names), an unavailable engine (UNAVAILABLE), or a bug here, reported as the
    server's error (INTERNAL, logged with its traceback), never as the client's."""
    if isinstance(exc, RequestInputError):
        return {"id": request_id, "error": str(exc), "code": "INVALID_ARG", "field": exc.param}
    if isinstance(exc, ModelUnavailableError):
        return {"id": request_id, "error": str(exc), "code": "UNAVAILABLE"}
    log.error("request %s failed", request_id, exc_info=exc)
    return {"id": request_id, "error": f"{type(exc).__name__}: {exc}", "code": "INTERNAL"}


class MessageDispatcher:
    """Serves one engine's messages (serving_image/triton_stub/backends/vllm/engine_in_stub.py lists them): each request
    runs as a task on the engine's loop, and every answer, delta or error goes to `sink`, on that loop."""

    def __init__(self, engine, sink: Callable[[dict], None]):
        self.engine = engine
        self.send = sink
        self.tasks: dict[str, asyncio.Task] = {}
        self.submitted = submitted_counter().labels(model=engine.info.name)

    def dispatch(self, message: dict) -> None:
        """One message from the model (on the engine's loop)."""
        op = message.get("op")
        if op == "abort":
            task = self.tasks.pop(message["id"], None)
            if task is not None:
                task.cancel()
            return
        work = {"generate": self.generate, "embed": self.embed, "score": self.score}.get(op)
        if work is None:
            self.send({"id": message.get("id"), "error": f"unknown operation {op!r}", "code": "INTERNAL"})
            return
        self.tasks[message["id"]] = asyncio.get_running_loop().create_task(work(message))

    async def stop(self) -> None:
        """Cancel what still runs (the model is unloading: its requests were drained by Triton first)."""
        for task in list(self.tasks.values()):
            task.cancel()
        await asyncio.gather(*self.tasks.values(), return_exceptions=True)

    async def generate(self, message: dict) -> None:
        request_id = message["id"]
        info = self.engine.info
        try:
            try:
                params = sampling_params_from_json(message.get("params"), message.get("root", "sampling_parameters"),
                                                   info, json_control_bias=self.engine.json_control_bias)
            except ParameterError as exc:
                raise RequestInputError(str(exc), exc.field) from None
            if interval := message.get("interval"):  # the model's pacing (model.py SendPacer); a caller's own larger
                params.stream_interval = max(interval, params.stream_interval or 1)  # one is kept, as vLLM clamps
            prompt_ids = self.engine.encode_prompt(message["prompt"], add_special_tokens=True)
            root = message.get("root", "sampling_parameters")
            if error := context_window_error(len(prompt_ids), params.max_tokens, info.max_model_len,
                                             prompt_field="text_input", max_tokens_field=f"{root}.max_tokens"):
                raise error
            # Counted (submitted_counter) and logged at DEBUG (engine_in_stub.STUB_LOG_LEVEL_ENV) once the request is
            # past its checks and on its way into the engine: from here a cancellation aborts it in the engine.
            self.submitted.inc()
            log.debug("request %s (client id %r) submitted to the engine", request_id, message.get("client_id", ""))
            async for output in self.engine.generate_params(request_id, prompt_ids, params):
                # per choice: index, new text, new token count, finish reason, and the new tokens' log-probabilities
                # in the backend's `logprobs` form (None when the request asked for none)
                self.send({"id": request_id, "p": output.prompt_tokens, "done": output.finished,
                           "out": [[c.index, c.text, len(c.token_ids), c.finish_reason,
                                    None if c.logprobs is None else backend_logprobs(c.logprobs)]
                                   for c in output.choices]})
        except asyncio.CancelledError:
            await self.engine.abort(request_id)
            log.info("request %s aborted in the engine (its client cancelled it)", request_id)
            raise
        except Exception as exc:  # noqa: BLE001 - every failure is answered, see error_message
            self.send(error_message(request_id, exc))
        finally:
            self.tasks.pop(request_id, None)

    async def _answer_once(self, request_id: str, work) -> None:
        """Run one embed or score request (`work` returns its one answer) and send the answer or the error, with
        the field an input error names."""
        try:
            self.send({"id": request_id, **await work(), "done": True})
        except asyncio.CancelledError:
            # The stub cancelled it (its client left): vLLM aborts a request whose output stream is closed.
            log.info("request %s aborted in the engine (its client cancelled it)", request_id)
            raise
        except Exception as exc:  # noqa: BLE001 - every failure is answered, see error_message
            self.send(error_message(request_id, exc))
        finally:
            self.tasks.pop(request_id, None)

    async def embed(self, message: dict) -> None:
        """One input's embedding from the pooling engine (the stub has checked the request's shape); the same
        tokenization and pooling as AsyncLlmModel.embed."""
        request_id = message["id"]

        async def work() -> dict:
            value = message["input"]
            if isinstance(value, list):
                vocab = self.engine.info.vocab_size
                if bad := next((t for t in value if not 0 <= t < vocab), None):
                    raise RequestInputError(f"embedding_request.input: token id {bad} is not in 0..{vocab - 1}",
                                           "embedding_request.input")
            try:
                (vector,) = await self.engine.embed([value], request_id)
            except RequestInputError as exc:
                raise RequestInputError(f"embedding_request.input: {exc}", "embedding_request.input") from None
            return {"p": vector.prompt_tokens, "embedding": list(vector.vector)}

        await self._answer_once(request_id, work)

    async def score(self, message: dict) -> None:
        """Prefill-only scoring of each candidate (AsyncLlmModel.score: the prompt logprobs of one prefill)."""
        request_id = message["id"]

        async def work() -> dict:
            scores = await self.engine.score(message["prompt"], message["candidates"], request_id)
            prompt_tokens = len(self.engine.encode_prompt(message["prompt"], add_special_tokens=True))
            return {"p": prompt_tokens, "scores": [[s.logprob, s.tokens] for s in scores]}

        await self._answer_once(request_id, work)

    async def watch(self) -> None:
        """Tell the model once the engine died (vLLM's engine core exited or failed)."""
        while True:
            await asyncio.sleep(0.5)
            if reason := self.engine.dead_reason:
                log.error("engine died: %s", reason)
                self.send({"op": "dead", "error": reason})
                return


async def start_pooling_engine(*, name: str, version: str, model_path: Path, tokenizer_path: Path, args: dict):
    """A pooling engine alone (model.json says `runner: pooling`: the package's embedding model on Triton), behind
    the same adapter as the `openai` mode's embedder, so that embeddings are computed the same way: vLLM runs one
    runner per engine, and this model serves `embed` only."""
    from vllm.v1.engine.async_llm import AsyncLLM

    from serving_image.engine.async_llm_model import AsyncLlmModel, build_engine_args
    from serving_image.engine.shm_ledger import ShmLedger

    shm_ledger = ShmLedger()  # before the engine's processes start: they inherit it
    llm = None
    try:
        llm = AsyncLLM.from_engine_args(build_engine_args(model_path, tokenizer_path, args))
        await llm.check_health()
        config, tokenizer = llm.model_config, llm.get_tokenizer()
        info = ModelInfo(name=name, version=version, max_model_len=config.max_model_len,
                         vocab_size=config.get_vocab_size(), eos_token_id=tokenizer.eos_token_id,
                         embedding_dim=config.get_hidden_size())
    except BaseException:
        if llm is not None:
            llm.shutdown()
        shm_ledger.reclaim()
        raise
    # The pooling engine is both: generate() on it is refused by vLLM, and the stub refuses it first by task.
    return AsyncLlmModel(llm, info, embedder=llm, shm_ledger=shm_ledger)


async def start_engine(model_json: Path, model_name: str, model_version: str) -> tuple[object, tuple[str, ...]]:
    """The engine model.json describes (a generation engine, or a pooling one: `runner: pooling`) and the tasks it
    serves."""
    from serving_image.cpu_placement import restore_engine_cpus
    from serving_image.engine.async_llm_model import AsyncLlmModel
    from serving_image.metrics.multiproc import write_values_with_cached_pid

    # vLLM's processes start from this thread: on the cores the server was given, even when this stub started after
    # the serving processes were placed off the engine's cores (cpu_placement.py)
    restore_engine_cpus()
    write_values_with_cached_pid()  # before vLLM creates its metrics in this process
    model, tokenizer, args = _engine_args(json.loads(model_json.read_text()))
    if args.get("runner") == "pooling":
        engine = await start_pooling_engine(name=model_name, version=model_version, model_path=model,
                                            tokenizer_path=tokenizer, args=args)
        settle_after_start()
        return engine, ("embed",)
    engine = await AsyncLlmModel.start(name=model_name, version=model_version, model_path=model,
                                         tokenizer_path=tokenizer, args=args)
    settle_after_start()
    return engine, ("generate",)


def settle_after_start() -> None:
    """What vLLM's own server does once it is up, here where its front (AsyncLLM) runs: the environment read once
    (vLLM reads its VLLM_* variables through `os.environ` at each use otherwise, several per engine step: 3-4 % of this
    process's CPU under load; its engine core caches them the same way after its startup) and the startup heap frozen
    (gc_heap.py)."""
    from vllm.envs import enable_envs_cache

    from serving_image.gc_heap import freeze_startup_heap

    enable_envs_cache()
    frozen = freeze_startup_heap()
    log.info("engine front settled: vLLM's environment cached, %d startup objects frozen out of the collector", frozen)


def ready_info(engine, tasks: tuple[str, ...]) -> dict:
    """What the model learns of its engine once it is ready."""
    info = engine.info
    return {"max_model_len": info.max_model_len, "vocab_size": info.vocab_size, "embedding_dim": info.embedding_dim,
            "tasks": list(tasks)}
