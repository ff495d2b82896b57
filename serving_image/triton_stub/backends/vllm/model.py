"""This project's stand-in for NVIDIA's `vllm` backend, as a python-based Triton backend (docs/kserve.md,
docs/local-environment.md "Triton locally"); Triton requires this file's name, `model.py`, of such a backend.

Real Triton (the local tritonserver 2.51) loads the same model repository as production (`config.pbtxt` with
`backend: "vllm"` and `1/model.json`, serving_image/triton/repository.py) with a backend directory in which `vllm`
is this directory. For clients it behaves as NVIDIA's backend (triton-inference-server/vllm_backend, src/model.py and
src/utils/request.py of the release compat.toml pins):

- `auto_complete_config` declares the same inputs and outputs (names, types, dims, optional flags), decoupled, no
  Triton batching;
- at most one response per engine step when `stream` is true (fewer under load, `SendPacer`), one final response
  otherwise; `text_output` carries the prompt in front unless `exclude_input_in_output` (default: true when
  streaming, false otherwise; false while streaming is refused); `finish_reason`, `num_input_tokens` and
  `num_output_tokens` only when their `return_*` input is true;
- `sampling_parameters` (a JSON string, or the request's parameters without it) is parsed as the backend does, by
  the engine's side (serving_image/triton_stub/stub_vllm.py: it needs vLLM's SamplingParams);
- a cancelled request (client gone, stream cancelled) is aborted in the engine and ends with a CANCELLED error;
- errors are error responses (`Error generating stream: ...`) and the model stays ready.

Where it differs (named in the error codes and messages), it is stricter: errors name the field, a client error is
INVALID_ARG and an engine failure UNAVAILABLE (NVIDIA's backend sends INTERNAL for both).

Where vLLM runs: in this stub's process, as in NVIDIA's backend (engine_in_stub.py: .venv-serving's packages after
the stub's own numpy < 2, the engine on a thread and asyncio loop of its own; serving_image/triton_stub/stub_vllm.py
parses `sampling_parameters` and drives vLLM's AsyncLLM through the project's adapter,
serving_image/engine/async_llm_model.py). Loading the model is starting the engine, unloading it stops the engine, as in
NVIDIA's backend; the engine's death unloads the model.
"""

from __future__ import annotations

import json
import os
import threading
import time
import uuid

import numpy as np
import triton_python_backend_utils as pb_utils

try:  # loaded by Triton as a top-level module from this directory; imported as a package by the tests
    from . import engine_in_stub as stub
except ImportError:
    import engine_in_stub as stub

# NVIDIA's backend's auto_complete_config, input by input (vllm_backend src/model.py).
INPUTS = (
    {"name": "text_input", "data_type": "TYPE_STRING", "dims": [1]},
    {"name": "image", "data_type": "TYPE_STRING", "dims": [-1], "optional": True},
    {"name": "stream", "data_type": "TYPE_BOOL", "dims": [1], "optional": True},
    {"name": "sampling_parameters", "data_type": "TYPE_STRING", "dims": [1], "optional": True},
    {"name": "exclude_input_in_output", "data_type": "TYPE_BOOL", "dims": [1], "optional": True},
    {"name": "return_finish_reason", "data_type": "TYPE_BOOL", "dims": [1], "optional": True},
    {"name": "return_cumulative_logprob", "data_type": "TYPE_BOOL", "dims": [1], "optional": True},
    {"name": "return_logprobs", "data_type": "TYPE_BOOL", "dims": [1], "optional": True},
    {"name": "return_num_input_tokens", "data_type": "TYPE_BOOL", "dims": [1], "optional": True},
    {"name": "return_num_output_tokens", "data_type": "TYPE_BOOL", "dims": [1], "optional": True},
    {"name": "embedding_request", "data_type": "TYPE_STRING", "dims": [1], "optional": True},
)
OUTPUTS = (
    {"name": "text_output", "data_type": "TYPE_STRING", "dims": [-1]},
    {"name": "finish_reason", "data_type": "TYPE_STRING", "dims": [-1]},
    {"name": "cumulative_logprob", "data_type": "TYPE_FP32", "dims": [-1]},
    {"name": "logprobs", "data_type": "TYPE_STRING", "dims": [-1]},
    {"name": "num_input_tokens", "data_type": "TYPE_UINT32", "dims": [1]},
    {"name": "num_output_tokens", "data_type": "TYPE_UINT32", "dims": [-1]},
)
RETURN_FLAGS = ("return_finish_reason", "return_num_input_tokens", "return_num_output_tokens", "return_logprobs")
# Inputs NVIDIA's backend serves that this stand-in refuses by name (docs/kserve.md).
REFUSED_INPUTS = {
    "image": "this model takes text only",
    "return_cumulative_logprob": "cumulative log probabilities are not produced by the local stand-in backend",
}
ERROR_PREFIX = "Error generating stream: "  # NVIDIA's backend's prefix for a failed request
# Every request in flight is checked for cancellation this often, by one watcher thread, whether it is producing
# tokens or not (queued behind others, in a long prefill, its engine held). Asking is a round trip to the Triton
# process: asked on the response path (NVIDIA's backend asks after every response) it was a quarter of the stub's
# CPU under load. A cancelled request therefore runs on in the engine for at most this long.
CANCEL_WATCH_S = 0.25
# A request that is not streamed gets one response: vLLM needs to hand the stub only its first and its last delta
NOT_STREAMED_INTERVAL = 1 << 30


class RequestError(ValueError):
    """A request the stand-in refuses before it reaches the engine (INVALID_ARG)."""


def input_tensors(request) -> dict:
    """The request's input tensors by name. One call into the stub: `pb_utils.get_input_tensor_by_name` asks the
    stub for the list of every input (a Python object for each) at each call, and a request was read with ten of
    them, on the stub's main thread, which admits requests one at a time."""
    return {tensor.name(): tensor for tensor in request.inputs()}


def _flag(inputs: dict, name: str) -> bool | None:
    tensor = inputs.get(name)
    return None if tensor is None else bool(tensor.as_numpy().reshape(-1)[0])


def read_request(request, inputs: dict, model_name: str) -> dict:
    """The request's inputs (`inputs`: input_tensors(request)) as NVIDIA's backend reads them
    (GenerateRequest._get_input_tensors). An `embedding_request` never gets here (execute sends it to
    read_embed_request, or refuses it by task)."""
    for name, reason in REFUSED_INPUTS.items():
        tensor = inputs.get(name)
        if tensor is not None and (name == "image" or bool(tensor.as_numpy().reshape(-1)[0])):
            raise RequestError(f"input '{name}': {reason}")
    tensor = inputs.get("text_input")
    if tensor is None:  # Triton 2.51 passes a request without a required input on to a python-based backend
        raise RequestError(f"input 'text_input' is required by model '{model_name}' and is missing")
    raw = tensor.as_numpy().reshape(-1)[0]
    try:
        prompt = raw.decode("utf-8") if isinstance(raw, bytes) else str(raw)
    except UnicodeDecodeError as exc:
        raise RequestError(f"input 'text_input' is not valid UTF-8: {exc}") from None
    if not prompt:
        raise RequestError("input 'text_input' is empty")
    stream = bool(_flag(inputs, "stream"))
    exclude = _flag(inputs, "exclude_input_in_output")
    prepend = (not exclude) if exclude is not None else not stream
    if prepend and stream:
        raise RequestError("input 'exclude_input_in_output': when streaming, `exclude_input_in_output` = False is "
                           "not allowed.")
    tensor = inputs.get("sampling_parameters")
    if tensor is not None:
        raw_params = tensor.as_numpy().reshape(-1)[0]
        try:
            params = raw_params.decode("utf-8") if isinstance(raw_params, bytes) else str(raw_params)
        except UnicodeDecodeError:
            raise RequestError("input 'sampling_parameters' is not valid UTF-8") from None
        root = "sampling_parameters"
    else:
        params, root = request.parameters(), "parameters"
    return {"prompt": prompt, "stream": stream, "prepend": prepend, "params": params, "root": root,
            "flags": {name: bool(_flag(inputs, name)) for name in RETURN_FLAGS}}


EMBED_FLAGS = ("return_num_input_tokens", "return_num_output_tokens")


def read_embed_request(inputs: dict, info: dict) -> dict:
    """An `embedding_request` as NVIDIA's backend reads it (EmbedRequest._get_input_tensors): a JSON object whose
    `input` is a string or one list of token ids (one input per request), and whose `pooling_params` may hold
    `dimensions` as a one-element list `[d]` (NVIDIA's OpenAI front-end sends it so, and the backend reads
    `dimensions[0]`). `text_input` and the sampling inputs are not read, as there. Stricter than NVIDIA's: every
    refusal names the field, and keys it would ignore are refused."""
    values = inputs["embedding_request"].as_numpy().reshape(-1)
    if values.size != 1:
        raise RequestError(f"input 'embedding_request' holds {values.size} elements; it takes one JSON object")
    raw = values[0]
    try:
        body = json.loads(raw.decode("utf-8") if isinstance(raw, bytes) else str(raw))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise RequestError(f"input 'embedding_request' is not valid UTF-8 JSON: {exc}") from None
    if not isinstance(body, dict):
        raise RequestError(f"input 'embedding_request' must hold a JSON object, got {type(body).__name__}")
    for key in body:
        if key not in ("input", "pooling_params"):
            raise RequestError(f"embedding_request.{key} is not read by the vllm backend (it reads input and "
                               "pooling_params)")
    value = body.get("input")
    is_ids = isinstance(value, list) and bool(value) and all(isinstance(t, int) and not isinstance(t, bool)
                                                               for t in value)
    if not (isinstance(value, str) and value) and not is_ids:
        raise RequestError("embedding_request.input must be a non-empty string or one non-empty list of token ids "
                           f"(one input per request), got {json.dumps(value)[:60]}")
    pooling = body.get("pooling_params", {})
    if not isinstance(pooling, dict):
        raise RequestError("embedding_request.pooling_params must be a JSON object")
    for key, dims in pooling.items():
        field = f"embedding_request.pooling_params.{key}"
        if key != "dimensions":
            raise RequestError(f"{field} is not read by the vllm backend (it reads dimensions only)")
        if not (isinstance(dims, list) and len(dims) == 1 and isinstance(dims[0], int)
                and not isinstance(dims[0], bool)):
            raise RequestError(f"{field} must be a one-element list [d] (the vllm backend reads dimensions[0]), "
                               f"got {json.dumps(dims)[:40]}")
        if dims[0] != info.get("embedding_dim"):
            raise RequestError(f"{field} {dims[0]}: this model's embeddings have {info.get('embedding_dim')} "
                               "dimensions and are not truncated")
    return {"input": value, "flags": {name: bool(_flag(inputs, name)) for name in EMBED_FLAGS}}


class _Request:
    """One request in flight: its sender, what the client asked for, and (when not streaming) the totals so far."""

    __slots__ = ("sender", "stream", "prepend", "prompt", "flags", "texts", "tokens", "finish", "prompt_tokens",
                 "logprobs", "pending", "last_sent", "shown")

    def __init__(self, sender, parsed: dict):
        self.sender = sender
        self.stream = parsed["stream"]
        self.prepend = parsed["prepend"]
        self.prompt = parsed["prompt"]
        self.flags = parsed["flags"]
        self.texts: list[str] = []
        self.tokens: list[int] = []
        self.finish: list[str | None] = []
        # per choice, the log-probability positions so far (None: the request asked for none, the JSON null)
        self.logprobs: list[list | None] = []
        self.prompt_tokens = 0
        # What the engine produced since the last response, per choice (text, token count, log-probabilities):
        # one step's delta, or several merged while the request was held back (SendPacer)
        self.pending: tuple[list[str], list[int], list[list | None]] = ([], [], [])
        self.last_sent = 0.0  # time.monotonic() of the last response
        self.shown = False  # whether a response with text went out: until then no delta is held

    def add(self, message: dict) -> None:
        """Fold one engine delta into the totals and into what is pending for the next response."""
        self.prompt_tokens = message["p"] or self.prompt_tokens
        texts, tokens, logprobs = self.pending
        for index, text, count, finish, new_logprobs in message["out"]:
            while len(self.texts) <= index:
                self.texts.append("")
                self.tokens.append(0)
                self.finish.append(None)
                self.logprobs.append(None)
            while len(texts) <= index:
                texts.append("")
                tokens.append(0)
                logprobs.append(None if self.logprobs[len(logprobs)] is None else [])
            self.texts[index] += text
            self.tokens[index] += count
            texts[index] += text
            tokens[index] += count
            if new_logprobs is not None:
                self.logprobs[index] = (self.logprobs[index] or []) + new_logprobs
                logprobs[index] = (logprobs[index] or []) + new_logprobs
            if finish is not None:
                self.finish[index] = finish

    def take_pending(self) -> tuple[list[str], list[int], list[list | None]]:
        """What the next response carries (every choice seen so far, empty where a choice has nothing new), and
        nothing pending after it."""
        texts, tokens, logprobs = self.pending
        width = len(self.texts)
        texts += [""] * (width - len(texts))
        tokens += [0] * (width - len(tokens))
        logprobs += [None if lp is None else [] for lp in self.logprobs[len(logprobs):]]
        self.pending = ([], [], [])
        return texts, tokens, logprobs

    def response(self, texts: list[str], tokens: list[int], logprobs: list[list | None], prefix: str = ""):
        outputs = [pb_utils.Tensor("text_output", np.array([(prefix + t).encode("utf-8") for t in texts] or [b""],
                                                           dtype=np.object_))]
        if self.flags["return_finish_reason"]:
            outputs.append(pb_utils.Tensor("finish_reason", np.array([str(f).encode() for f in self.finish] or
                                                                     [b"None"], dtype=np.object_)))
        if self.flags["return_logprobs"]:  # one JSON string per choice, as NVIDIA's backend writes it
            outputs.append(pb_utils.Tensor("logprobs", np.array([json.dumps(lp).encode() for lp in logprobs] or
                                                                [b"null"], dtype=np.object_)))
        if self.flags["return_num_input_tokens"]:
            outputs.append(pb_utils.Tensor("num_input_tokens", np.array([self.prompt_tokens], dtype=np.uint32)))
        if self.flags["return_num_output_tokens"]:
            outputs.append(pb_utils.Tensor("num_output_tokens", np.array(tokens or [0], dtype=np.uint32)))
        return pb_utils.InferenceResponse(output_tensors=outputs)


class SendPacer:
    """How often a streamed request gets a response: at most one per engine step, fewer under load.

    A response costs a round trip to the Triton process (the stub's `send` returns once Triton took it), on the
    engine's own thread: while it sends, vLLM neither takes new requests nor hands out the next step. With one
    response per request per step, N streaming requests cost N round trips a step, and at concurrency 32 on two
    cores those sends were a large part of the stub's CPU and of each step's wall time. So the stub keeps its sends
    to a share of the time (SEND_SHARE): a request's pacing interval is `in flight x send cost / SEND_SHARE`.

    Two mechanisms keep to it. vLLM merges about one interval's worth of a request's tokens before the stub sees a
    delta (`stream_interval`, SamplingParams.stream_interval, fixed when the request is admitted, from the measured
    tokens per second of a stream): a delta merged in vLLM costs the stub nothing, where a delta merged here costs
    its wake-up, vLLM's RequestOutput and its Python objects on the engine's thread. And the stub holds a delta
    that comes sooner than HOLD_SHARE of the interval since the request's last response (`due`), for what vLLM's
    merging cannot know: a request admitted when fewer were in flight, or steps faster than measured. A held delta
    is merged into the request's next response (the same text, token counts and log-probabilities, in fewer
    pieces), as vLLM's output collector merges a lagging consumer's deltas.

    Ordering rules: the first token and the final one are never merged in vLLM, and nothing is held here until a
    response with text went out (the first token's delta may carry no text yet: vLLM's detokenizer holds back an
    incomplete character), and the final response is never held (time to first token, and the end of the stream, go
    out at once); every request has its own clock, so none waits on another; with few requests in flight the
    interval is below a step or two and every step is sent. The send cost and the tokens per second are moving
    averages of measured sends, so the pacing follows the machine: a GPU node's fast steps and idle cores give short
    intervals. A held delta waits for the request's next one (or its end), so a request the engine stops stepping
    (preempted) shows its last tokens when it runs again.
    """

    # Measured on 2 cores (vLLM's serving benchmark at concurrency 32, single runs): every step sent 65 req/s,
    # 0.25 98, 0.1 86-124, 0.05 101-113, vLLM's own server 89-126 in the same runs; 0.1 keeps streams smoother
    # than 0.05 (at a 0.2 ms send, a chunk every 64 ms at concurrency 32) at no measurable cost.
    SEND_SHARE = 0.1
    SMOOTHING = 0.05  # weight of the newest send (and the newest rate) in the moving averages
    # Below 1, so that a delta vLLM merged to about one interval is sent, not held for another.
    HOLD_SHARE = 0.5

    def __init__(self) -> None:
        self.cost_s = 0.0
        self.tokens_per_s = 0.0  # one streamed request's tokens per second, between two of its responses

    def interval_s(self, in_flight: int) -> float:
        return in_flight * self.cost_s / self.SEND_SHARE

    def due(self, last_sent: float, now: float, in_flight: int) -> bool:
        return now - last_sent >= self.HOLD_SHARE * self.interval_s(in_flight)

    def sent(self, seconds: float) -> None:
        self.cost_s = seconds if not self.cost_s else self.cost_s + (seconds - self.cost_s) * self.SMOOTHING

    def streamed(self, tokens: int, seconds: float) -> None:
        """A streamed request's response carried `tokens` made in the `seconds` since its previous response."""
        if tokens > 0 and seconds > 0:
            rate = tokens / seconds
            self.tokens_per_s = rate if not self.tokens_per_s else \
                self.tokens_per_s + (rate - self.tokens_per_s) * self.SMOOTHING

    def stream_interval(self, in_flight: int) -> int:
        """vLLM's `stream_interval` for a streamed request admitted with `in_flight` in flight (itself too): the
        tokens a stream makes in one pacing interval, at least 1 (every step)."""
        return max(1, round(self.tokens_per_s * self.interval_s(in_flight)))


class _EmbedRequest:
    """An embedding request in flight: one answer, no deltas (NVIDIA's EmbedRequest.create_response)."""

    __slots__ = ("sender", "flags")

    def __init__(self, sender, flags: dict):
        self.sender = sender
        self.flags = flags

    def response(self, message: dict):
        # The vector as JSON text, as NVIDIA's backend sends it (json.dumps of the floats: they read back exactly).
        outputs = [pb_utils.Tensor("text_output", np.array([json.dumps(message["embedding"]).encode("utf-8")],
                                                           dtype=np.object_))]
        if self.flags["return_num_input_tokens"]:
            outputs.append(pb_utils.Tensor("num_input_tokens", np.array([message["p"]], dtype=np.uint32)))
        if self.flags["return_num_output_tokens"]:  # nothing is generated
            outputs.append(pb_utils.Tensor("num_output_tokens", np.array([0], dtype=np.uint32)))
        return pb_utils.InferenceResponse(output_tensors=outputs)


class TritonPythonModel:
    @classmethod
    def auto_complete_config(cls, auto_complete_model_config):
        config = auto_complete_model_config.as_dict()
        have_in = {i["name"] for i in config["input"]}
        have_out = {o["name"] for o in config["output"]}
        for spec in INPUTS:
            if spec["name"] not in have_in:
                auto_complete_model_config.add_input(dict(spec))
        for spec in OUTPUTS:
            if spec["name"] not in have_out:
                auto_complete_model_config.add_output(dict(spec))
        auto_complete_model_config.set_model_transaction_policy(dict(decoupled=True))
        auto_complete_model_config.set_max_batch_size(0)
        return auto_complete_model_config

    # -- lifecycle ---------------------------------------------------------------------------------------------

    def initialize(self, args):
        self.logger = pb_utils.Logger
        self.model_config = json.loads(args["model_config"])
        self.model_name = args["model_name"]
        if not pb_utils.using_decoupled_model_transaction_policy(self.model_config):
            raise pb_utils.TritonModelException("vLLM Triton backend must be configured to use decoupled model "
                                                "transaction policy")
        model_json = os.path.join(pb_utils.get_model_dir(), "model.json")
        if not os.path.isfile(model_json):
            raise pb_utils.TritonModelException(f"'model.json' containing vllm engine args must be provided in "
                                                f"'{pb_utils.get_model_dir()}'")
        python = os.environ.get(stub.ENGINE_PYTHON_ENV)
        if not python:
            raise pb_utils.TritonModelException(
                f"${stub.ENGINE_PYTHON_ENV} is not set: the stand-in vllm backend imports vLLM from the "
                ".venv-serving interpreter it names (the startup procedure sets it; see "
                "docs/local-environment.md, \"Triton locally\")")
        try:
            self._engine = stub.InStubEngine(python, model_json, self.model_name, str(args["model_version"]))
        except stub.StubEnvironmentError as exc:
            raise pb_utils.TritonModelException(f"[vllm] Failed to start engine: {exc}") from None
        self._lock = threading.Lock()
        self._requests: dict[str, _Request] = {}
        self._pacer = SendPacer()
        self._dead: str | None = None
        self._closing = False
        failure = self._engine.start_failure()
        if failure is not None:
            raise pb_utils.TritonModelException(f"[vllm] Failed to start engine: {failure}")
        first = self._engine.first
        self.info = first["info"]
        # What the engine serves: ["generate"], or ["embed"] for a pooling model (model.json `runner: pooling`).
        self.tasks = tuple(self.info.get("tasks", ("generate",)))
        self.logger.log_info(f"[vllm] engine ready for {self.model_name}: {self.info} (pid {self._engine.pid})")
        # Held by whoever answers a request (the reader thread, the cancellation watcher), so that nothing is sent
        # to a sender after its final response.
        self._respond_lock = threading.Lock()
        self._stopped = threading.Event()
        self._engine.start_reading(self._on_message, self._engine_died, name="vllm-stand-in-reader")
        self._watcher = threading.Thread(target=self._watch_cancellations, name="vllm-stand-in-cancel", daemon=True)
        self._watcher.start()

    def finalize(self):
        self.logger.log_info("[vllm] Issuing finalize to vllm backend")
        self._closing = True
        self._stopped.set()
        self._engine.close()
        self._watcher.join(timeout=10)

    # -- requests ----------------------------------------------------------------------------------------------

    def _send(self, message: dict) -> None:
        self._engine.send(message)

    @staticmethod
    def _error(sender, message: str, code) -> None:
        sender.send(pb_utils.InferenceResponse(error=pb_utils.TritonError(message=ERROR_PREFIX + message, code=code)),
                    flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)

    def execute(self, requests):
        for request in requests:
            sender = request.get_response_sender()
            if self._dead is not None:
                self._error(sender, f"Model is unavailable due to unhealthy vLLM engine: {self._dead}",
                            pb_utils.TritonError.UNAVAILABLE)
                continue
            inputs = input_tensors(request)
            embedding = "embedding_request" in inputs
            task = "embed" if embedding else "generate"
            if task not in self.tasks:  # NVIDIA's backend's words (_validate_request_task_name)
                self._error(sender, f"Model {self.model_name} does not support '{task}' request",
                            pb_utils.TritonError.INVALID_ARG)
                continue
            if embedding:
                self._submit_embed(inputs, sender)
                continue
            try:
                parsed = read_request(request, inputs, self.model_name)
            except RequestError as exc:
                self._error(sender, str(exc), pb_utils.TritonError.INVALID_ARG)
                continue
            except Exception as exc:  # a bug here fails this request as the server's error, never the batch
                self.logger.log_error(f"[vllm] reading a request failed: {exc!r}")
                self._error(sender, f"{type(exc).__name__}: {exc}", pb_utils.TritonError.INTERNAL)
                continue
            request_id = uuid.uuid4().hex
            with self._lock:
                self._requests[request_id] = _Request(sender, parsed)
            try:
                self._send({"op": "generate", "id": request_id, "client_id": request.request_id(),
                            "prompt": parsed["prompt"], "params": parsed["params"], "root": parsed["root"],
                            # the tokens vLLM merges per delta: not streamed, only the first and the last matter
                            "interval": (self._pacer.stream_interval(len(self._requests)) if parsed["stream"]
                                         else NOT_STREAMED_INTERVAL)})
            except OSError as exc:
                with self._lock:
                    self._requests.pop(request_id, None)
                self._error(sender, f"the engine is gone: {exc}", pb_utils.TritonError.UNAVAILABLE)
        return None

    def _submit_embed(self, inputs: dict, sender) -> None:
        try:
            parsed = read_embed_request(inputs, self.info)
        except RequestError as exc:
            self._error(sender, str(exc), pb_utils.TritonError.INVALID_ARG)
            return
        except Exception as exc:  # a bug here fails this request as the server's error, never the batch
            self.logger.log_error(f"[vllm] reading an embedding request failed: {exc!r}")
            self._error(sender, f"{type(exc).__name__}: {exc}", pb_utils.TritonError.INTERNAL)
            return
        request_id = uuid.uuid4().hex
        with self._lock:
            self._requests[request_id] = _EmbedRequest(sender, parsed["flags"])
        try:
            self._send({"op": "embed", "id": request_id, "input": parsed["input"]})
        except OSError as exc:
            with self._lock:
                self._requests.pop(request_id, None)
            self._error(sender, f"the engine is gone: {exc}", pb_utils.TritonError.UNAVAILABLE)

    def _on_message(self, message: dict) -> None:
        with self._respond_lock:
            self._answer(message)

    def _answer(self, message: dict) -> None:
        request_id = message["id"]
        with self._lock:
            state = self._requests.get(request_id)
        if state is None:
            return  # cancelled or failed already
        if "error" in message:
            self._drop(request_id)
            text, code = stub.error_answer(message)
            self._error(state.sender, text, getattr(pb_utils.TritonError, code))
            return
        if isinstance(state, _EmbedRequest):
            self._drop(request_id)
            state.sender.send(state.response(message), flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
            return
        state.add(message)
        done = bool(message["done"])
        if done:
            self._drop(request_id)
        if state.stream:
            now = time.monotonic()
            if not done and state.shown and not self._pacer.due(state.last_sent, now, len(self._requests)):
                return  # held back: merged into this request's next response
            texts, tokens, logprobs = state.take_pending()
            if state.shown and not done:  # a response between two others: the engine's pace for this request
                self._pacer.streamed(sum(tokens), now - state.last_sent)
            state.last_sent = now
            state.shown = state.shown or any(texts)
            response = state.response(texts, tokens, logprobs)
            state.sender.send(response, flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL if done else 0)
            self._pacer.sent(time.monotonic() - now)
        elif done:
            state.sender.send(state.response(state.texts, state.tokens, state.logprobs,
                                             state.prompt if state.prepend else ""),
                              flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)

    def _cancel(self, request_id: str, state: _Request) -> None:
        """Abort a request its client cancelled, in the engine too, and end it with CANCELLED (as NVIDIA's backend
        does). Called with the respond lock held."""
        self._drop(request_id)
        try:
            self._send({"op": "abort", "id": request_id})
        except OSError:
            pass
        self.logger.log_info("[vllm] Cancelling the request")
        state.sender.send(pb_utils.InferenceResponse(error=pb_utils.TritonError(
            message="Request was cancelled", code=pb_utils.TritonError.CANCELLED)),
            flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)

    def _watch_cancellations(self) -> None:
        """Every CANCEL_WATCH_S, ask Triton whether each request in flight was cancelled, and abort those that were.
        The respond lock is held around each question: a sender is never asked after its final response (Triton
        frees the request's response factory then)."""
        while not self._stopped.wait(CANCEL_WATCH_S):
            with self._lock:
                live = list(self._requests.items())
            for request_id, state in live:
                with self._respond_lock:
                    with self._lock:
                        if self._requests.get(request_id) is not state:
                            continue  # answered meanwhile
                    try:
                        if state.sender.is_cancelled():
                            self._cancel(request_id, state)
                    except Exception as exc:  # one sender failing must not stop the watch of the others
                        self.logger.log_warn(f"[vllm] checking request {request_id} for cancellation failed: {exc}")

    def _drop(self, request_id: str) -> None:
        with self._lock:
            self._requests.pop(request_id, None)

    def _engine_died(self, reason: str) -> None:
        """As NVIDIA's health check does: every caller gets UNAVAILABLE and the model is unloaded (not ready)."""
        if self._dead is not None or self._closing:
            return
        self._dead = reason
        self.logger.log_error(f"[vllm] Engine is not healthy and model will be unloaded: {reason}")
        with self._lock:
            pending, self._requests = list(self._requests.values()), {}
        for state in pending:
            try:
                self._error(state.sender, f"Model is unavailable due to unhealthy vLLM engine: {reason}",
                            pb_utils.TritonError.UNAVAILABLE)
            except Exception as exc:  # a sender whose client is gone: nothing more to tell it
                self.logger.log_warn(f"[vllm] could not fail a request: {exc}")
        try:
            pb_utils.unload_model(self.model_name)
        except Exception as exc:  # not in explicit model control mode: the model stays, answering UNAVAILABLE
            self.logger.log_warn(f"[vllm] could not unload {self.model_name}: {exc}")
