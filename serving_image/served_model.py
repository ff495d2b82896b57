"""The served model: what the OpenAI front-end speaks to, one interface with two implementations behind it.

`ServedModel` is the model as a front-end sees it: its `ModelInfo`, a prompt's tokens, `generate` (a
`GenerationRequest` in, `GenerationOutput` deltas out), `embed`, `score`, `abort`, readiness. In the `openai` mode the
implementation is Triton embedded in the process (serving_image/triton_adapter/triton_model.py `EmbeddedTritonModel`),
with NVIDIA's vLLM backend in the image and the stand-in backend over vLLM's CPU build locally; `AsyncLlmModel`
(serving_image/engine/async_llm_model.py) is a vLLM engine in the calling process behind the same interface (the
stand-in backend's and the scoring model's, in the Python backend stub). Errors are `RequestInputError` (naming the
field) and `ModelUnavailableError`. Nothing here imports vLLM or Triton, so the translation code stays pure and shared.
"""

from __future__ import annotations

import abc
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any, Literal

StructuredKind = Literal["json_schema", "json_object", "regex", "choice", "grammar"]
FinishReason = Literal["stop", "length", "abort", "error"]


class ServedModelError(RuntimeError):
    """Base of the errors a served model raises to a front-end."""


class RequestInputError(ServedModelError, ValueError):
    """The request cannot be run as given (HTTP 400 / gRPC INVALID_ARGUMENT). `param` names the field."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


class ModelUnavailableError(ServedModelError):
    """The model is not ready, or its engine has died (HTTP 503 / gRPC UNAVAILABLE)."""


@dataclass(frozen=True)
class StructuredOutput:
    kind: StructuredKind
    value: Any = None  # JSON schema (dict), regex (str), choices (list[str]), grammar (str); None for json_object


@dataclass(frozen=True)
class SamplingSpec:
    """Sampling fields every served model honours. Defaults are OpenAI's, not vLLM's."""

    max_tokens: int | None = None  # None: up to the context window
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int | None = None
    min_p: float = 0.0
    n: int = 1
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    seed: int | None = None
    logprobs: int | None = None  # None: no logprobs; k >= 0: the sampled token's plus the top k
    logit_bias: dict[int, float] | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_tokens: int = 0
    ignore_eos: bool = False
    structured: StructuredOutput | None = None
    constraint: str | None = None  # a validated §3.5 constraint spec, as its JSON text (spec.constraint_text)


@dataclass(frozen=True)
class PromptText:
    """The text a front-end tokenized into a request's ids, and how: `encode(text, add_special_tokens=
    special_tokens_added)` gave them. An engine that takes text (Triton's vLLM backend) sends this text instead of
    decoding the ids back (a decode per request, and decode(encode(text)) need not be the text), so that it tokenizes
    exactly what the front-end counted."""

    text: str
    special_tokens_added: bool


@dataclass(frozen=True)
class GenerationRequest:
    request_id: str
    prompt: str | list[int]  # text, or token ids already rendered by the front-end
    sampling: SamplingSpec = field(default_factory=SamplingSpec)
    add_special_tokens: bool = True  # False for chat prompts: the chat template already holds BOS
    source: PromptText | None = None  # where token ids came from, when the front-end tokenized text


@dataclass(frozen=True)
class TopLogprob:
    token: str
    token_id: int
    logprob: float


@dataclass(frozen=True)
class TokenLogprob:
    token: str
    token_id: int
    logprob: float
    top: tuple[TopLogprob, ...] = ()  # the k most likely tokens, most likely first
    rank: int | None = None  # the sampled token's rank in the vocabulary (1: the most likely), when known


@dataclass(frozen=True)
class ChoiceDelta:
    """New output of one choice since the previous GenerationOutput."""

    index: int
    text: str
    token_ids: tuple[int, ...]
    logprobs: tuple[TokenLogprob, ...] | None = None
    finish_reason: FinishReason | None = None
    stop_reason: str | int | None = None


def context_window_error(prompt_tokens: int, max_tokens: int | None, window: int, *, prompt_field: str = "prompt",
                         max_tokens_field: str = "max_tokens") -> RequestInputError | None:
    """What of a request does not fit in the model's context window, as the error naming the field (each front-end
    names the fields in its own protocol's terms), or None when it fits."""
    if prompt_tokens >= window:
        return RequestInputError(f"{prompt_field}: the prompt has {prompt_tokens} tokens; this model's context window "
                                f"is {window}", prompt_field)
    if max_tokens is not None and max_tokens > window - prompt_tokens:
        return RequestInputError(f"{max_tokens_field} {max_tokens} plus the prompt's {prompt_tokens} tokens exceed "
                                f"this model's context window of {window} tokens", max_tokens_field)
    return None


def raise_if_cut_short(request_id: str, delta: ChoiceDelta) -> None:
    """A choice the engine ended by aborting it, or by an internal error, is incomplete: raise instead of letting a
    front-end pass it on as a normal finish (a client would read truncated text as a whole answer).

    Aborts this server asks for (a client that went away) never reach here: their stream is cancelled first."""
    if delta.finish_reason == "abort":
        raise ModelUnavailableError(f"the engine aborted request {request_id} (choice {delta.index}) before it "
                                     f"finished; the output is incomplete, retry the request")
    if delta.finish_reason == "error":
        raise ModelUnavailableError(f"the engine failed request {request_id} (choice {delta.index}) with an "
                                     f"internal error; the output is incomplete, retry the request")


@dataclass(frozen=True)
class GenerationOutput:
    request_id: str
    prompt_tokens: int
    choices: tuple[ChoiceDelta, ...]
    finished: bool


def merge_outputs(first: GenerationOutput, then: GenerationOutput) -> GenerationOutput:
    """Two consecutive deltas of one request as one (what vLLM's output collector does for a consumer that lags):
    per choice, the texts, token ids and log-probabilities one after the other, the later finish and stop reasons;
    the later prompt-token count and finished flag."""
    choices = {c.index: c for c in first.choices}
    for c in then.choices:
        before = choices.get(c.index)
        if before is None:
            choices[c.index] = c
            continue
        logprobs = (None if before.logprobs is None and c.logprobs is None
                    else (before.logprobs or ()) + (c.logprobs or ()))
        choices[c.index] = ChoiceDelta(c.index, before.text + c.text, before.token_ids + c.token_ids, logprobs,
                                       c.finish_reason or before.finish_reason, c.stop_reason or before.stop_reason)
    return GenerationOutput(then.request_id, then.prompt_tokens or first.prompt_tokens,
                        tuple(choices[i] for i in sorted(choices)), then.finished)


@dataclass
class ChoiceTotals:
    """One choice's output so far."""

    text: str = ""
    tokens: int = 0
    logprobs: list[TokenLogprob] = field(default_factory=list)
    finish_reason: FinishReason | None = None


@dataclass
class OutputTotals:
    """Folds a request's generation deltas into per-choice totals: what every front-end builds a whole answer (and its
    usage) from."""

    prompt_tokens: int = 0
    choices: dict[int, ChoiceTotals] = field(default_factory=dict)

    def add(self, output: GenerationOutput) -> None:
        self.prompt_tokens = max(self.prompt_tokens, output.prompt_tokens)
        for delta in output.choices:
            state = self.choices.setdefault(delta.index, ChoiceTotals())
            state.text += delta.text
            state.tokens += len(delta.token_ids)
            if delta.logprobs:
                state.logprobs.extend(delta.logprobs)
            if delta.finish_reason is not None:
                state.finish_reason = delta.finish_reason

    def choice(self, index: int) -> ChoiceTotals:
        return self.choices.get(index, ChoiceTotals())

    @property
    def completion_tokens(self) -> int:
        return sum(c.tokens for c in self.choices.values())


@dataclass(frozen=True)
class ModelInfo:
    name: str  # the served model id (what clients put in `model`)
    version: str
    max_model_len: int
    vocab_size: int
    eos_token_id: int | None
    embedding_dim: int | None = None  # set when the model also serves embeddings


@dataclass(frozen=True)
class Embedding:
    vector: tuple[float, ...]
    prompt_tokens: int


@dataclass(frozen=True)
class CandidateScore:
    logprob: float  # sum of the candidate's token log-probabilities given the prompt
    tokens: int


class ServedModel(abc.ABC):
    """An inference engine as the front-ends see it."""

    info: ModelInfo

    @abc.abstractmethod
    def generate(self, request: GenerationRequest) -> AsyncIterator[GenerationOutput]:
        """Stream deltas until every choice finished. Raises RequestInputError before the first output when the
        request is refused, ModelUnavailableError when the engine is not serving."""

    @abc.abstractmethod
    async def abort(self, request_id: str) -> None: ...

    @abc.abstractmethod
    def is_ready(self) -> bool: ...

    @property
    @abc.abstractmethod
    def dead_reason(self) -> str | None:
        """Why the engine died, or None while it is alive."""

    @abc.abstractmethod
    def encode_prompt(self, text: str, *, add_special_tokens: bool) -> list[int]: ...

    @abc.abstractmethod
    def decode(self, token_ids: list[int]) -> str: ...

    @abc.abstractmethod
    def render_chat(self, messages: list[dict[str, str]], *, add_generation_prompt: bool = True) -> str: ...

    async def embed(self, inputs: list[str | list[int]], request_id: str) -> list[Embedding]:
        raise RequestInputError(f"model {self.info.name} does not serve embeddings", "model")

    async def score(self, prompt: str, candidates: list[str], request_id: str) -> list[CandidateScore]:
        raise RequestInputError(f"model {self.info.name} does not serve scoring", "model")

    @abc.abstractmethod
    async def shutdown(self) -> None: ...


PROBE_TEXT = " Hello, world! <s></s> 1234 ñ 中文"


def rust_tokenizer(tokenizer: Any) -> Any | None:
    """The `tokenizers.Tokenizer` under a Hugging Face fast tokenizer, when encoding with it directly gives the ids
    `tokenizer.encode` gives (special tokens read as such, and the same ids for a probe text with and without
    special tokens); None for a slow tokenizer, one that splits special tokens, or a wrapper that encodes
    differently. What transformers resets at each call (truncation, padding, splitting) is checked at each call."""
    from tokenizers import Tokenizer

    rust = getattr(tokenizer, "backend_tokenizer", None)
    if not isinstance(rust, Tokenizer):
        return None
    if getattr(tokenizer, "split_special_tokens", False):  # transformers splits them at every call: not here
        return None
    for special in (True, False):
        expected = list(tokenizer.encode(PROBE_TEXT, add_special_tokens=special))  # first: it resets truncation
        if rust.truncation is not None or rust.padding is not None or \
                rust.encode(PROBE_TEXT, add_special_tokens=special).ids != expected:
            return None
    return rust


class HFTokenizerMixin:
    """encode_prompt / decode / render_chat over a Hugging Face tokenizer in `self._tokenizer`: the same for every
    adapter, because the front-ends render and tokenize with the served model's own tokenizer."""

    _tokenizer: Any
    info: ModelInfo
    _rust_tokenizer: Any = None  # resolved on first use (`rust_tokenizer`); False: there is none to use

    def encode_prompt(self, text: str, *, add_special_tokens: bool) -> list[int]:
        rust = self._rust_tokenizer
        if rust is None:
            rust = self._rust_tokenizer = rust_tokenizer(self._tokenizer) or False
        # Straight to the Rust tokenizer when transformers would call it with nothing changed: its own `encode`
        # wraps that call in a BatchEncoding and about a hundred lines of Python, a third of the time of encoding
        # a 64-token prompt (docs/kserve.md, "The front's Python per request")
        if rust and rust.truncation is None and rust.padding is None and not rust.encode_special_tokens:
            return rust.encode(text, add_special_tokens=add_special_tokens).ids
        return list(self._tokenizer.encode(text, add_special_tokens=add_special_tokens))

    def decode(self, token_ids: list[int]) -> str:
        return self._tokenizer.decode(token_ids)

    def render_chat(self, messages: list[dict[str, str]], *, add_generation_prompt: bool = True) -> str:
        if not getattr(self._tokenizer, "chat_template", None):
            raise RequestInputError(f"model {self.info.name} has no chat template; use /v1/completions", "messages")
        return self._tokenizer.apply_chat_template(messages, tokenize=False,
                                                   add_generation_prompt=add_generation_prompt)
