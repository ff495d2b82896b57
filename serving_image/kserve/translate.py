"""KServe v2 tensors <-> the engine interface: the pure translation both directions share.

Server side (the local KServe front-end): the §3.3 input tensors and the `sampling_parameters` JSON become an
`EngineRequest`; `EngineOutput` deltas become response tensors, the way the pinned Triton vLLM backend
(vllm_backend `src/utils/request.py`, `vllm_backend_utils.py`) builds them:
- `text_output` is the new text of each choice when streaming, else the whole text with the prompt in front unless
  `exclude_input_in_output` is true; streaming with `exclude_input_in_output` false is refused, as the backend does;
- `sampling_parameters` holds vLLM `SamplingParams` fields; numbers may be sent as strings (the backend converts
  them with int()/float()); the structured-outputs key of the pinned release (compat.toml) carries a JSON *string*;
  without the tensor, the request's parameters are the sampling parameters (also as the backend does).

Client side (the Triton engine adapters): an `EngineRequest` becomes the same tensors, and response tensors become
`EngineOutput` deltas. Nothing here does I/O.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from llm_serving.tensor_contract import VLLM_INPUTS, VLLM_OUTPUTS
from serving_image.constraints.spec import ConstraintError, spec_to_json, validate_constraint
from serving_image.engine.base import (
    ChoiceDelta,
    EngineOutput,
    EngineRequest,
    ModelInfo,
    OutputTotals,
    SamplingSpec,
    StructuredOutput,
    TokenLogprob,
    TopLogprob,
    raise_if_cut_short,
)
from serving_image.kserve.tensors import Tensor

# The vllm_backend's optional flags that switch on the outputs beyond text_output. Accepted here so that one client
# works against both servers; see docs/kserve.md for how the local server treats them.
RETURN_FLAGS = {
    "return_finish_reason": "finish_reason",
    "return_num_input_tokens": "num_input_tokens",
    "return_num_output_tokens": "num_output_tokens",
}
UNSUPPORTED_INPUTS = {
    "return_cumulative_logprob": "cumulative_logprob is not produced by this server",
    "return_logprobs": "logprobs are not produced by this server (use the OpenAI API's logprobs)",
    "image": "this model takes text only",
    "embedding_request": "this model does not serve embeddings over KServe (use the OpenAI API's /v1/embeddings)",
}
# Outputs of the contract this server never produces (they need log probabilities, see UNSUPPORTED_INPUTS).
UNPRODUCED_OUTPUTS = ("cumulative_logprob", "logprobs")
INPUT_TYPES = {t.name: t.datatype for t in VLLM_INPUTS} | {name: "BOOL" for name in RETURN_FLAGS}
REQUIRED_INPUTS = tuple(t.name for t in VLLM_INPUTS if not t.optional)
OUTPUT_NAMES = tuple(t.name for t in VLLM_OUTPUTS if t.name not in UNPRODUCED_OUTPUTS)
# Request parameters Triton itself consumes; they never reach the model as sampling parameters.
RESERVED_PARAMETERS = frozenset({"sequence_id", "sequence_start", "sequence_end", "priority", "timeout",
                                 "triton_enable_empty_final_response", "headers"})
# vLLM's SamplingParams default (the backend builds SamplingParams from the JSON, so this is what Triton does).
DEFAULT_MAX_TOKENS = 16
MAX_N = 16
STRUCTURED_KINDS = {"json": "json_schema", "json_object": "json_object", "regex": "regex", "choice": "choice",
                    "grammar": "grammar"}
ALL_STRUCTURED_KEYS = ("structured_outputs", "guided_decoding")


class KServeInputError(ValueError):
    """A request that cannot run as given (gRPC INVALID_ARGUMENT / HTTP 400); `field` names the tensor or field."""

    def __init__(self, field: str, message: str):
        super().__init__(message)
        self.field = field


@dataclass(frozen=True)
class GenerateCall:
    """One decoded KServe request for the LLM model."""

    request: EngineRequest
    stream: bool
    prepend_input: bool
    outputs: tuple[str, ...]  # the output tensors to send, in contract order


def _single(tensor: Tensor) -> Any:
    expected = INPUT_TYPES[tensor.name]
    if tensor.datatype != expected:
        raise KServeInputError(tensor.name, f"input '{tensor.name}': datatype is {tensor.datatype}, the model "
                               f"expects {expected}")
    if tensor.shape != (1,):
        raise KServeInputError(tensor.name, f"input '{tensor.name}': shape is {list(tensor.shape)}, the model "
                               "expects [1]")
    return tensor.values[0]


def requested_outputs(names: list[str] | tuple[str, ...], flags: Mapping[str, bool]) -> tuple[str, ...]:
    """Which outputs a response carries: the ones the request names, else all four of the contract except those a
    `return_*` flag explicitly switched off."""
    for name in names:
        if name in UNPRODUCED_OUTPUTS:
            raise KServeInputError(f"outputs.{name}", f"output '{name}' is not produced by this server (log "
                                   "probabilities are not returned over KServe here)")
        if name not in OUTPUT_NAMES:
            raise KServeInputError(f"outputs.{name}", f"output '{name}' is not an output of this model; outputs are "
                                   f"{', '.join(OUTPUT_NAMES)}")
    if names:
        return tuple(n for n in OUTPUT_NAMES if n in names)
    off = {RETURN_FLAGS[f] for f, v in flags.items() if v is False}
    return tuple(n for n in OUTPUT_NAMES if n not in off)


def parse_generate(tensors: list[Tensor], parameters: Mapping[str, Any], *, info: ModelInfo, request_id: str,
                   structured_key: str, output_names: list[str] | tuple[str, ...] = ()) -> GenerateCall:
    """Decode one request. Raises KServeInputError naming the tensor or the sampling_parameters field."""
    by_name: dict[str, Tensor] = {}
    for tensor in tensors:
        if tensor.name in UNSUPPORTED_INPUTS:
            raise KServeInputError(tensor.name, f"input '{tensor.name}': {UNSUPPORTED_INPUTS[tensor.name]}")
        if tensor.name not in INPUT_TYPES:
            raise KServeInputError(tensor.name, f"input '{tensor.name}' is not an input of model '{info.name}'; "
                                   f"inputs are {', '.join(t.name for t in VLLM_INPUTS)}")
        if tensor.name in by_name:
            raise KServeInputError(tensor.name, f"input '{tensor.name}' is given twice")
        by_name[tensor.name] = tensor
    missing = [name for name in REQUIRED_INPUTS if name not in by_name]
    if missing:
        raise KServeInputError(missing[0], f"input '{missing[0]}' is required by model '{info.name}' and is missing")
    raw_text = _single(by_name["text_input"])
    try:
        prompt = raw_text.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise KServeInputError("text_input", f"input 'text_input' is not valid UTF-8: {exc}") from exc
    if not prompt:
        raise KServeInputError("text_input", "input 'text_input' is empty")
    stream = bool(_single(by_name["stream"])) if "stream" in by_name else False
    if "exclude_input_in_output" in by_name:
        prepend = not _single(by_name["exclude_input_in_output"])
    else:
        prepend = not stream
    if prepend and stream:
        raise KServeInputError("exclude_input_in_output", "input 'exclude_input_in_output': false is not allowed "
                               "when streaming (as in Triton's vLLM backend)")
    flags = {name: bool(_single(by_name[name])) for name in RETURN_FLAGS if name in by_name}
    outputs = requested_outputs(tuple(output_names), flags)
    if "sampling_parameters" in by_name:
        raw = _single(by_name["sampling_parameters"])
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise KServeInputError("sampling_parameters", "input 'sampling_parameters' is not valid UTF-8") from exc
        sampling = sampling_spec_from_json(text, info, structured_key)
    else:
        params = {k: v for k, v in parameters.items() if k not in RESERVED_PARAMETERS}
        sampling = sampling_spec_from_dict(params, info, structured_key, root="parameters")
    return GenerateCall(EngineRequest(request_id, prompt, sampling), stream, prepend, outputs)


# -- sampling_parameters -------------------------------------------------------------------------------------------

_INT_FIELDS = ("max_tokens", "top_k", "n", "seed", "logprobs", "min_tokens")
_FLOAT_FIELDS = ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty")
_BOOL_FIELDS = ("ignore_eos",)
_KNOWN = set(_INT_FIELDS) | set(_FLOAT_FIELDS) | set(_BOOL_FIELDS) | {
    "stop", "stop_token_ids", "logit_bias", "constraint", "extra_args", *ALL_STRUCTURED_KEYS}


def sampling_spec_from_json(text: str, info: ModelInfo, structured_key: str) -> SamplingSpec:
    try:
        params = json.loads(text)
    except json.JSONDecodeError as exc:
        raise KServeInputError("sampling_parameters", f"input 'sampling_parameters' is not valid JSON: {exc}") from exc
    if not isinstance(params, dict):
        raise KServeInputError("sampling_parameters", "input 'sampling_parameters' must be a JSON object, got "
                               f"{type(params).__name__}")
    return sampling_spec_from_dict(params, info, structured_key, root="sampling_parameters")


def _int(root: str, key: str, value: Any) -> int:
    # The backend applies int() to these fields: "64" works there, so it works here; 1.5 or "x" do not.
    if isinstance(value, bool):
        raise KServeInputError(f"{root}.{key}", f"{root}.{key} must be an integer, got {value!r}")
    if isinstance(value, int):
        return value
    if isinstance(value, str):
        try:
            return int(value)
        except ValueError:
            pass
    if isinstance(value, float) and value.is_integer():
        return int(value)
    raise KServeInputError(f"{root}.{key}", f"{root}.{key} must be an integer, got {value!r:.60}")


def _float(root: str, key: str, value: Any) -> float:
    if isinstance(value, bool):
        raise KServeInputError(f"{root}.{key}", f"{root}.{key} must be a number, got {value!r}")
    try:
        number = float(value) if isinstance(value, int | float | str) else None
    except ValueError:
        number = None
    if number is None or not math.isfinite(number):
        raise KServeInputError(f"{root}.{key}", f"{root}.{key} must be a finite number, got {value!r:.60}")
    return number


def _structured(root: str, key: str, value: Any, structured_key: str) -> StructuredOutput:
    field_name = f"{root}.{key}"
    if key != structured_key:
        raise KServeInputError(field_name, f"{field_name}: the pinned Triton release reads structured outputs from "
                               f"'{structured_key}' ('{key}' is the name other releases use)")
    if not isinstance(value, str):
        raise KServeInputError(field_name, f"{field_name} must be a JSON string (the vLLM backend json.loads it), "
                               f"e.g. \"{{\\\"json\\\": {{...}}}}\"; got {type(value).__name__}")
    try:
        spec = json.loads(value)
    except json.JSONDecodeError as exc:
        raise KServeInputError(field_name, f"{field_name} is not valid JSON: {exc}") from exc
    if not isinstance(spec, dict):
        raise KServeInputError(field_name, f"{field_name} must hold a JSON object")
    given = [k for k in spec if spec[k] not in (None, False)]
    unknown = [k for k in given if k not in STRUCTURED_KINDS]
    if unknown:
        raise KServeInputError(f"{field_name}.{unknown[0]}", f"{field_name}.{unknown[0]} is not supported; use one "
                               f"of {', '.join(STRUCTURED_KINDS)}")
    if len(given) != 1:
        raise KServeInputError(field_name, f"{field_name} must set exactly one of {', '.join(STRUCTURED_KINDS)}, "
                               f"got {given or 'none'}")
    kind = given[0]
    v = spec[kind]
    if kind == "json":
        if isinstance(v, str):
            try:
                v = json.loads(v)
            except json.JSONDecodeError as exc:
                raise KServeInputError(f"{field_name}.json", f"{field_name}.json is not valid JSON: {exc}") from exc
        if not isinstance(v, dict):
            raise KServeInputError(f"{field_name}.json", f"{field_name}.json must be a JSON schema object")
        return StructuredOutput("json_schema", v)
    if kind == "json_object":
        return StructuredOutput("json_object")
    if kind == "choice":
        if not isinstance(v, list) or not v or not all(isinstance(c, str) for c in v):
            raise KServeInputError(f"{field_name}.choice", f"{field_name}.choice must be a non-empty list of strings")
        return StructuredOutput("choice", list(v))
    if not isinstance(v, str) or not v:
        raise KServeInputError(f"{field_name}.{kind}", f"{field_name}.{kind} must be a non-empty string")
    return StructuredOutput(kind, v)


def sampling_spec_from_dict(params: Mapping[str, Any], info: ModelInfo, structured_key: str,
                            root: str = "sampling_parameters") -> SamplingSpec:
    """Every field is mapped or refused by name; None means "vLLM's default", as in the backend."""
    params = {k: v for k, v in params.items() if v is not None}
    for key in params:
        if key not in _KNOWN:
            raise KServeInputError(f"{root}.{key}", f"{root}.{key} is not a sampling parameter this server supports")
    values: dict[str, Any] = {"max_tokens": DEFAULT_MAX_TOKENS}
    for key in _INT_FIELDS:
        if key in params:
            values[key] = _int(root, key, params[key])
    for key in _FLOAT_FIELDS:
        if key in params:
            values[key] = _float(root, key, params[key])
    for key in _BOOL_FIELDS:
        if key in params:
            if not isinstance(params[key], bool):
                raise KServeInputError(f"{root}.{key}", f"{root}.{key} must be true or false, got {params[key]!r:.40}")
            values[key] = params[key]
    if values["max_tokens"] < 1:
        raise KServeInputError(f"{root}.max_tokens", f"{root}.max_tokens must be at least 1")
    if not 1 <= values.get("n", 1) <= MAX_N:
        raise KServeInputError(f"{root}.n", f"{root}.n must be in 1..{MAX_N}")
    if values.get("temperature", 1.0) < 0:
        raise KServeInputError(f"{root}.temperature", f"{root}.temperature must be >= 0")
    if not 0 < values.get("top_p", 1.0) <= 1:
        raise KServeInputError(f"{root}.top_p", f"{root}.top_p must be in (0, 1]")
    if values.get("logprobs", 0) < 0:
        raise KServeInputError(f"{root}.logprobs", f"{root}.logprobs must be >= 0")
    if "logprobs" in values:
        raise KServeInputError(f"{root}.logprobs", f"{root}.logprobs: log probabilities are not returned over KServe "
                               "by this server")
    if values.get("min_tokens", 0) < 0:
        raise KServeInputError(f"{root}.min_tokens", f"{root}.min_tokens must be >= 0")
    top_k = values.pop("top_k", None)
    if top_k is not None and top_k < -1:
        raise KServeInputError(f"{root}.top_k", f"{root}.top_k must be -1 (or 0) to disable, or positive")
    stop: tuple[str, ...] = ()
    if "stop" in params:
        s = params["stop"]
        if isinstance(s, str):
            stop = (s,)
        elif isinstance(s, list) and all(isinstance(x, str) for x in s):
            stop = tuple(s)
        else:
            raise KServeInputError(f"{root}.stop", f"{root}.stop must be a string or a list of strings")
    stop_ids: tuple[int, ...] = ()
    if "stop_token_ids" in params:
        ids = params["stop_token_ids"]
        if not isinstance(ids, list):
            raise KServeInputError(f"{root}.stop_token_ids", f"{root}.stop_token_ids must be a list of token ids")
        stop_ids = tuple(_token(root, f"stop_token_ids[{i}]", t, info) for i, t in enumerate(ids))
    bias = None
    if "logit_bias" in params:
        lb = params["logit_bias"]
        if not isinstance(lb, dict):
            raise KServeInputError(f"{root}.logit_bias", f"{root}.logit_bias must be an object of token id -> bias")
        bias = {_token(root, f"logit_bias.{k}", k, info): _float(root, f"logit_bias.{k}", v) for k, v in lb.items()}
    structured = None
    keys = [k for k in ALL_STRUCTURED_KEYS if k in params]
    for key in keys:
        structured = _structured(root, key, params[key], structured_key)
    constraint_raw, constraint_field = None, f"{root}.constraint"
    if "extra_args" in params:
        extra = params["extra_args"]
        if not isinstance(extra, dict) or set(extra) - {"constraint"}:
            raise KServeInputError(f"{root}.extra_args", f"{root}.extra_args may only hold 'constraint'")
        if "constraint" in params:
            raise KServeInputError(f"{root}.extra_args.constraint", f"{root}: give the constraint once, either as "
                                   "'constraint' or as 'extra_args.constraint'")
        constraint_raw, constraint_field = extra.get("constraint"), f"{root}.extra_args.constraint"
    if "constraint" in params:
        constraint_raw = params["constraint"]
    constraint = None
    if constraint_raw is not None:
        if structured is not None:
            raise KServeInputError(constraint_field, f"{constraint_field} cannot be combined with "
                                   f"{root}.{keys[0]}: each one alone decides the allowed tokens")
        try:
            constraint = spec_to_json(validate_constraint(constraint_raw, info.vocab_size, info.eos_token_id))
        except ConstraintError as exc:
            # The spec module names the field from "constraint"; put it under where the client sent it.
            where = constraint_field + exc.field.removeprefix("constraint")
            raise KServeInputError(where, f"{where}: {exc.reason}") from exc
    return SamplingSpec(
        max_tokens=values["max_tokens"],
        temperature=values.get("temperature", 1.0),
        top_p=values.get("top_p", 1.0),
        top_k=top_k if top_k and top_k > 0 else None,
        min_p=values.get("min_p", 0.0),
        n=values.get("n", 1),
        stop=stop,
        stop_token_ids=stop_ids,
        seed=values.get("seed"),
        logit_bias=bias,
        presence_penalty=values.get("presence_penalty", 0.0),
        frequency_penalty=values.get("frequency_penalty", 0.0),
        repetition_penalty=values.get("repetition_penalty", 1.0),
        min_tokens=values.get("min_tokens", 0),
        ignore_eos=values.get("ignore_eos", False),
        structured=structured,
        constraint=constraint,
    )


def _token(root: str, key: str, value: Any, info: ModelInfo) -> int:
    token = _int(root, key, value)
    if not 0 <= token < info.vocab_size:
        raise KServeInputError(f"{root}.{key}", f"{root}.{key}: token id {token} is outside the vocabulary "
                               f"(0..{info.vocab_size - 1})")
    return token


# -- responses (server side) ---------------------------------------------------------------------------------------


@dataclass
class ResponseBuilder:
    """Folds engine deltas into response tensors: one response per delta when streaming, one at the end otherwise."""

    call: GenerateCall
    totals: OutputTotals = field(default_factory=OutputTotals)

    def _tensors(self, texts: list[str], tokens: list[int]) -> list[Tensor]:
        n = self.call.request.sampling.n
        finish = [str(self.totals.choice(i).finish_reason) for i in range(n)]  # "None" while running
        tensors = {
            "text_output": Tensor("text_output", "BYTES", (n,), tuple(t.encode("utf-8") for t in texts)),
            "finish_reason": Tensor("finish_reason", "BYTES", (n,), tuple(f.encode() for f in finish)),
            "num_input_tokens": Tensor("num_input_tokens", "UINT32", (1,), (self.totals.prompt_tokens,)),
            "num_output_tokens": Tensor("num_output_tokens", "UINT32", (n,), tuple(tokens)),
        }
        return [tensors[name] for name in self.call.outputs]

    def add(self, output: EngineOutput) -> list[Tensor] | None:
        """Record a delta; when streaming, return the response tensors for it."""
        self.totals.add(output)
        n = self.call.request.sampling.n
        delta_text, delta_tokens = [""] * n, [0] * n
        for delta in output.choices:
            delta_text[delta.index] += delta.text
            delta_tokens[delta.index] += len(delta.token_ids)
        if not self.call.stream:
            return None
        return self._tensors(delta_text, delta_tokens)

    def final(self) -> list[Tensor]:
        """The single response of a non-streaming request."""
        n = self.call.request.sampling.n
        prefix = self.call.request.prompt if self.call.prepend_input else ""
        assert isinstance(prefix, str)
        return self._tensors([prefix + self.totals.choice(i).text for i in range(n)],
                             [self.totals.choice(i).tokens for i in range(n)])


# -- requests and responses (client side: the Triton engine adapters) ----------------------------------------------


class ClientTranslationError(ValueError):
    """An EngineRequest that cannot be expressed as KServe tensors; `param` names the field."""

    def __init__(self, message: str, param: str):
        super().__init__(message)
        self.param = param


def sampling_parameters_json(spec: SamplingSpec, structured_key: str) -> str:
    """The sampling_parameters JSON Triton's vLLM backend accepts (SamplingParams field names)."""
    params: dict[str, Any] = {
        "n": spec.n, "temperature": spec.temperature, "top_p": spec.top_p, "min_p": spec.min_p,
        "presence_penalty": spec.presence_penalty, "frequency_penalty": spec.frequency_penalty,
        "repetition_penalty": spec.repetition_penalty, "min_tokens": spec.min_tokens, "ignore_eos": spec.ignore_eos,
    }
    if spec.max_tokens is not None:
        params["max_tokens"] = spec.max_tokens
    if spec.top_k is not None:
        params["top_k"] = spec.top_k
    if spec.stop:
        params["stop"] = list(spec.stop)
    if spec.stop_token_ids:
        params["stop_token_ids"] = list(spec.stop_token_ids)
    if spec.seed is not None:
        params["seed"] = spec.seed
    if spec.logprobs is not None:
        params["logprobs"] = spec.logprobs  # returned in the `logprobs` output (request_tensors sets return_logprobs)
    if spec.logit_bias:
        params["logit_bias"] = {str(k): v for k, v in spec.logit_bias.items()}
    if spec.structured is not None:
        kind, value = spec.structured.kind, spec.structured.value
        inner = {"json_schema": {"json": value}, "json_object": {"json_object": True}, "regex": {"regex": value},
                 "choice": {"choice": value}, "grammar": {"grammar": value}}[kind]
        params[structured_key] = json.dumps(inner)
    if spec.constraint is not None:
        # SamplingParams.extra_args is where the constraint processor reads it (docs/architecture.md §3.5); the stock
        # backend passes extra_args through to SamplingParams, which a top-level `constraint` would not survive.
        params["extra_args"] = {"constraint": spec.constraint}
    return json.dumps(params, separators=(",", ":"))


def triton_prompt(request: EngineRequest, decode: Callable[[list[int]], str] | None, bos_token: str | None,
                  tokenizer_adds_bos: bool) -> str:
    """The text to send as text_input: Triton's vLLM backend takes text and always tokenizes it with special tokens.

    Token-id prompts (what the OpenAI front-end renders) are decoded back to text with their special tokens, and a
    leading BOS is dropped when the tokenizer adds one itself, so the model does not see two BOS tokens that the
    local engine never sends. The backend re-tokenizes the text; for text that came out of the same tokenizer this
    gives the same ids (the round-trip test checks the outputs against the direct engine)."""
    prompt = request.prompt
    if not isinstance(prompt, str):
        if decode is None:
            raise ClientTranslationError("token-id prompts cannot be sent to Triton's vLLM backend without a "
                                         "tokenizer to turn them into text_input", "prompt")
        prompt = decode(list(prompt))
        special_applied = True  # ids rendered by a front-end already hold whatever special tokens they need
    else:
        special_applied = not request.add_special_tokens
    if special_applied and tokenizer_adds_bos and bos_token and prompt.startswith(bos_token):
        prompt = prompt[len(bos_token):]
    return prompt


def request_tensors(request: EngineRequest, structured_key: str, prompt: str | None = None) -> list[Tensor]:
    """The streaming request the Triton adapters send: text only, prompt excluded, every output switched on."""
    if prompt is None:
        prompt = triton_prompt(request, None, None, False)
    return [
        Tensor("text_input", "BYTES", (1,), (prompt.encode("utf-8"),)),
        Tensor("stream", "BOOL", (1,), (True,)),
        Tensor("exclude_input_in_output", "BOOL", (1,), (True,)),
        Tensor("sampling_parameters", "BYTES", (1,), (sampling_parameters_json(request.sampling,
                                                                              structured_key).encode(),)),
        *(Tensor(flag, "BOOL", (1,), (True,)) for flag in RETURN_FLAGS),
        *((Tensor("return_logprobs", "BOOL", (1,), (True,)),) if request.sampling.logprobs is not None else ()),
    ]


# -- log-probabilities in the vllm backend's `logprobs` output ------------------------------------------------------
# One JSON string per choice (the JSON `null` when the request asked for none): a list with one object per new token,
# token id (a string, as JSON keys are) -> {"logprob", "rank", "decoded_token"}, holding the sampled token and the
# request's top k (vLLM's Logprob dictionary, as vllm_backend's create_response serialises it). The sampled token is
# the first key: vLLM puts it first, and the stand-in backend writes it first.


def backend_logprobs(items: tuple[TokenLogprob, ...]) -> list[dict[str, dict]]:
    """The `logprobs` positions of some new tokens, as the backend writes them (the stand-in's engine process)."""
    positions = []
    for item in items:
        position = {str(item.token_id): {"logprob": item.logprob, "rank": item.rank, "decoded_token": item.token}}
        for rank, top in enumerate(item.top, start=1):
            position.setdefault(str(top.token_id), {"logprob": top.logprob, "rank": rank, "decoded_token": top.token})
        positions.append(position)
    return positions


def read_backend_logprobs(text: str | bytes, k: int) -> tuple[TokenLogprob, ...]:
    """The engine's TokenLogprobs from one choice's `logprobs` JSON; `k` is how many alternatives were asked for.
    Raises ValueError (a malformed response is the server's fault, never silently read as no log-probabilities)."""
    positions = json.loads(text)
    if positions is None:
        raise ValueError("the backend returned no log-probabilities (null) for a request that asked for them")
    out = []
    for position in positions:
        entries = [(int(token_id), entry) for token_id, entry in position.items()]
        if not entries:
            raise ValueError("a logprobs position without the sampled token")
        token_id, chosen = entries[0]
        top = sorted((e for e in entries if e[1].get("rank") is not None and e[1]["rank"] <= k),
                     key=lambda e: e[1]["rank"])
        out.append(TokenLogprob(token=chosen.get("decoded_token") or "", token_id=token_id,
                                logprob=float(chosen["logprob"]), rank=chosen.get("rank"),
                                top=tuple(TopLogprob(e.get("decoded_token") or "", tid, float(e["logprob"]))
                                          for tid, e in top)))
    return tuple(out)


@dataclass
class OutputReader:
    """Turns each streamed response's tensors (name -> flat values) into an EngineOutput delta."""

    request_id: str
    n: int
    prompt_tokens: int = 0
    finished: set[int] = field(default_factory=set)
    logprobs: int | None = None  # the request's k: each delta then carries its tokens' log-probabilities

    def read(self, outputs: Mapping[str, list], final: bool = False) -> EngineOutput:
        texts = outputs.get("text_output")
        if texts is None:
            if final:  # an empty final response (triton_final_response) carries no tensors
                return EngineOutput(self.request_id, self.prompt_tokens, (), True)
            raise ValueError("response has no text_output")
        reasons = outputs.get("finish_reason") or ["None"] * len(texts)
        counts = outputs.get("num_output_tokens") or [0] * len(texts)
        if outputs.get("num_input_tokens"):
            self.prompt_tokens = int(outputs["num_input_tokens"][0])
        logprobs = outputs.get("logprobs")
        if self.logprobs is not None and logprobs is None:
            raise ValueError("response has no logprobs output, though the request asked for log-probabilities")
        choices = []
        for index, text in enumerate(texts):
            token_logprobs = (read_backend_logprobs(logprobs[index], self.logprobs)
                              if self.logprobs is not None else None)
            reason = reasons[index]
            reason = reason.decode() if isinstance(reason, bytes) else str(reason)
            finish = None if reason == "None" else reason
            if finish is not None:
                self.finished.add(index)
            delta = ChoiceDelta(
                index=index,
                text=text.decode("utf-8") if isinstance(text, bytes) else str(text),
                # Token ids do not cross the KServe API, only their count (unless log-probabilities name them): -1
                # placeholders keep the count (vLLM itself uses -1 for not-yet-known ids), never to be read as ids.
                token_ids=(tuple(t.token_id for t in token_logprobs) if token_logprobs
                           else (-1,) * int(counts[index])),
                logprobs=token_logprobs,
                finish_reason=finish,
            )
            raise_if_cut_short(self.request_id, delta)
            choices.append(delta)
        return EngineOutput(self.request_id, self.prompt_tokens, tuple(choices),
                            finished=final or len(self.finished) == self.n)
