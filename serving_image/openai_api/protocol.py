"""OpenAI request bodies as strict pydantic models: every field is either honoured or refused.

A field that is not declared here is refused with HTTP 400 naming it (`extra="forbid"`): a production front-end
once accepted `response_format` and silently dropped it, and this platform exists partly to make that impossible.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from serving_image.json_text import JSONText


class FieldValueError(ValueError):
    """A problem a model-level validator finds in one field: pydantic locates such an error at the body (`loc` is
    empty), so it carries the field's name for the error's `param` (errors.from_validation_error)."""

    def __init__(self, field: str, message: str):
        super().__init__(message)
        self.field = field


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextPart]

    @field_validator("content", mode="before")
    @classmethod
    def _text_parts_only(cls, v):
        if isinstance(v, list):
            for i, part in enumerate(v):
                kind = part.get("type") if isinstance(part, dict) else None
                if kind != "text":
                    raise ValueError(f"content[{i}].type {kind!r} is not supported: this model takes text parts only")
        return v

    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class JsonSchemaFormat(_Strict):
    name: str = Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")
    description: str | None = None
    schema_: dict[str, Any] = Field(alias="schema")
    strict: bool | None = None

    model_config = ConfigDict(extra="forbid", populate_by_name=True)


class ResponseFormatText(_Strict):
    type: Literal["text"]


class ResponseFormatJsonObject(_Strict):
    type: Literal["json_object"]


class ResponseFormatJsonSchema(_Strict):
    type: Literal["json_schema"]
    json_schema: JsonSchemaFormat


ResponseFormat = Annotated[
    ResponseFormatText | ResponseFormatJsonObject | ResponseFormatJsonSchema, Field(discriminator="type")
]


class StructuredOutputs(_Strict):
    """Platform extension: vLLM-style structured outputs beyond `response_format`. Exactly one kind."""

    regex: str | None = None
    choice: list[str] | None = Field(default=None, min_length=1)
    grammar: str | None = None
    json_: dict[str, Any] | None = Field(default=None, alias="json")

    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    @model_validator(mode="after")
    def _exactly_one(self) -> StructuredOutputs:
        given = [k for k in ("regex", "choice", "grammar", "json_") if getattr(self, k) is not None]
        if len(given) != 1:
            raise ValueError("give exactly one of regex, choice, grammar, json")
        return self


class StreamOptions(_Strict):
    include_usage: bool = False


class _SamplingFields(_Strict):
    model: str
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    n: int | None = Field(default=None, ge=1, le=16)
    stop: str | list[str] | None = None
    seed: int | None = Field(default=None, ge=-(2**63), le=2**64 - 1)
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    logit_bias: dict[str, float] | None = None
    presence_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    user: str | None = None  # metadata: recorded in the request log
    # Platform extensions (extra_body in the openai client). A constraint object may arrive as its JSON text instead
    # (json_text.JSONText: the body reader leaves it unread, see app._parse_body), which openai_bodies.sampling_spec
    # reads and checks with the served vocabulary in one pass (constraints/spec.py, constraint_text).
    constraint: dict[str, Any] | None = None
    structured_outputs: StructuredOutputs | None = None
    # vLLM's sampling extensions, with vLLM's names, so vLLM clients and its benchmark work unchanged.
    top_k: int | None = Field(default=None, ge=-1)
    min_p: float | None = Field(default=None, ge=0.0, le=1.0)
    repetition_penalty: float | None = Field(default=None, gt=0.0, le=2.0)
    min_tokens: int | None = Field(default=None, ge=0)
    ignore_eos: bool | None = None

    @field_validator("constraint", mode="wrap")
    @classmethod
    def _constraint_text(cls, v, handler):
        return v if isinstance(v, JSONText) else handler(v)

    @field_validator("stop")
    @classmethod
    def _check_stop(cls, v):
        if isinstance(v, list) and len(v) > 4:
            raise ValueError("at most 4 stop sequences")
        if isinstance(v, list) and any(not s for s in v) or v == "":
            raise ValueError("stop sequences must not be empty")
        return v

    @field_validator("logit_bias")
    @classmethod
    def _check_bias(cls, v):
        for key, value in (v or {}).items():
            if not key.lstrip("-").isdigit():
                raise ValueError(f"key {key!r} is not a token id")
            if not -100 <= value <= 100:
                raise ValueError(f"bias {value} for token {key} is outside -100..100")
        return v

    @model_validator(mode="after")
    def _check_stream_options(self):
        if self.stream_options is not None and not self.stream:
            raise FieldValueError("stream_options", "stream_options is only allowed when stream is true")
        return self


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    # Metadata: no effect on the output, recorded in the request log (fields.py).
    metadata: dict[str, str] | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool | None = False
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    response_format: ResponseFormat | None = None

    @model_validator(mode="after")
    def _check_chat(self):
        if self.top_logprobs is not None and not self.logprobs:
            raise FieldValueError("top_logprobs", "top_logprobs requires logprobs: true")
        if self.max_tokens is not None and self.max_completion_tokens is not None \
                and self.max_tokens != self.max_completion_tokens:
            raise FieldValueError("max_completion_tokens", "max_tokens and max_completion_tokens disagree; give one")
        return self


class CompletionRequest(_SamplingFields):
    prompt: str | list[str] | list[int]
    logprobs: int | None = Field(default=None, ge=0, le=5)
    echo: bool | None = False
    response_format: ResponseFormat | None = None  # extension: as in chat

    @field_validator("prompt")
    @classmethod
    def _check_prompt(cls, v):
        if isinstance(v, list) and not v:
            raise ValueError("prompt must not be empty")
        return v


class EmbeddingRequest(_Strict):
    model: str
    input: str | list[str] | list[int] | list[list[int]]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = Field(default=None, ge=1)
    user: str | None = None

    @field_validator("input")
    @classmethod
    def _check_input(cls, v):
        if v == "" or (isinstance(v, list) and (not v or any(item in ("", []) for item in v))):
            raise ValueError("input must not be empty")
        return v


class ScoreRequest(_Strict):
    """Platform extension: log-probability of each candidate continuation of a prompt, from the prefill alone."""

    model: str
    prompt: str = Field(min_length=1)
    candidates: list[str] = Field(min_length=1, max_length=256)
    user: str | None = None

    @field_validator("candidates")
    @classmethod
    def _check_candidates(cls, v):
        for i, candidate in enumerate(v):
            if not candidate:
                raise ValueError(f"candidates[{i}] is empty")
        return v


@dataclass(frozen=True)
class Endpoint:
    """One POST endpoint of the API: where it is, what its body is, and how its requests are named."""

    name: str  # the request log's `endpoint` field
    path: str
    body: type[BaseModel]
    id_prefix: str  # request ids are `<prefix>-<32 hex digits>`, as OpenAI's are (chatcmpl-..., cmpl-...)


CHAT_COMPLETIONS = Endpoint("chat", "/v1/chat/completions", ChatCompletionRequest, "chatcmpl")
COMPLETIONS = Endpoint("completion", "/v1/completions", CompletionRequest, "cmpl")
EMBEDDINGS = Endpoint("embedding", "/v1/embeddings", EmbeddingRequest, "embd")
SCORE = Endpoint("score", "/v1/score", ScoreRequest, "score")
ENDPOINTS = (CHAT_COMPLETIONS, COMPLETIONS, EMBEDDINGS, SCORE)
