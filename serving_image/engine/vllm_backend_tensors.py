"""The served model's requests -> KServe v2 tensors and back, for the clients of Triton's vLLM model: the served
model over Triton (serving_image/triton_adapter/triton_model.py) and the tests. Nothing here does I/O.

- A `GenerationRequest` becomes the streaming request Triton's vLLM backend takes (`text_input`, `stream`,
  `exclude_input_in_output`, `sampling_parameters` as SamplingParams fields, the `return_*` flags);
- each streamed response's tensors become a `GenerationOutput` delta (`OutputReader`);
- log-probabilities cross in the backend's `logprobs` output (JSON), written by the stand-in backend's in-stub engine
  (`backend_logprobs`) and read back here.

The server side is Triton itself (NVIDIA's backend in the image, the stand-in backend locally): this module never
parses a KServe request. It runs in two processes, so it sits in the `engine` package below both: the serving
process's adapter (serving_image/triton_adapter) and the stub's engine (serving_image/triton_stub/stub_vllm.py,
which writes `backend_logprobs`) import this one module, so both sides of the `logprobs` output share one format.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from serving_image.served_model import (
    ChoiceDelta,
    GenerationOutput,
    GenerationRequest,
    SamplingSpec,
    TokenLogprob,
    TopLogprob,
    raise_if_cut_short,
)

# The vllm_backend's optional flags that switch on the outputs beyond text_output: the adapters always ask for these
# (Triton sends finish_reason and token counts only when asked); return_logprobs only when the request wants them.
RETURN_FLAGS = ("return_finish_reason", "return_num_input_tokens", "return_num_output_tokens")


@dataclass(frozen=True)
class Tensor:
    """One request tensor as plain Python values (the adapters turn them into numpy arrays for the wire)."""

    name: str
    datatype: str
    shape: tuple[int, ...]
    values: tuple[Any, ...]  # bytes for BYTES, bool for BOOL


class ClientTranslationError(ValueError):
    """An GenerationRequest that cannot be expressed as KServe tensors; `param` names the field."""

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
    text = json.dumps(params, separators=(",", ":"))
    if spec.constraint is None:
        return text
    # SamplingParams.extra_args is where the constraint processor reads it (docs/architecture.md §3.5); the stock
    # backend passes extra_args through to SamplingParams, which a top-level `constraint` would not survive. The
    # checked text spliced in as the last key: an 8k-id list took json.dumps 0.8 ms (json_text.py).
    return f'{text[:-1]},"extra_args":{{"constraint":{spec.constraint}}}}}'



def triton_prompt(request: GenerationRequest, decode: Callable[[list[int]], str] | None, bos_token: str | None,
                  tokenizer_adds_bos: bool) -> str:
    """The text to send as text_input: Triton's vLLM backend takes text and always tokenizes it with special tokens.

    Token-id prompts (what the OpenAI front-end renders) go as the text the front-end tokenized into them
    (`request.source`), or else are decoded back to text with their special tokens. Where that text already holds
    its special tokens, a leading BOS is dropped when the tokenizer adds one itself, so the model does not see two
    BOS tokens that a vLLM engine given the token ids never sees. The backend tokenizes the text again: from the
    source text, exactly as the front-end did; from decoded ids, the same ids for text that came out of the same
    tokenizer (tests/serving/test_vllm_backend_tensors.py checks the seam with the demo model's tokenizer)."""
    prompt = request.prompt
    if not isinstance(prompt, str):
        if request.source is not None:  # no decode: the text itself, tokenized as the front-end did
            prompt, special_applied = request.source.text, not request.source.special_tokens_added
        elif decode is None:
            raise ClientTranslationError("token-id prompts cannot be sent to Triton's vLLM backend without a "
                                         "tokenizer to turn them into text_input", "prompt")
        else:
            prompt = decode(list(prompt))
            special_applied = True  # ids rendered by a front-end already hold whatever special tokens they need
    else:
        special_applied = not request.add_special_tokens
    if special_applied and tokenizer_adds_bos and bos_token and prompt.startswith(bos_token):
        prompt = prompt[len(bos_token):]
    return prompt


def request_tensors(request: GenerationRequest, structured_key: str, prompt: str | None = None) -> list[Tensor]:
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
    """The `logprobs` positions of some new tokens, as the backend writes them (the stand-in's in-stub engine)."""
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
    """Turns each streamed response's tensors (name -> flat values) into an GenerationOutput delta."""

    request_id: str
    n: int
    prompt_tokens: int = 0
    finished: set[int] = field(default_factory=set)
    logprobs: int | None = None  # the request's k: each delta then carries its tokens' log-probabilities

    def read(self, outputs: Mapping[str, list], final: bool = False) -> GenerationOutput:
        texts = outputs.get("text_output")
        if texts is None:
            if final:  # an empty final response (triton_final_response) carries no tensors
                return GenerationOutput(self.request_id, self.prompt_tokens, (), True)
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
        return GenerationOutput(self.request_id, self.prompt_tokens, tuple(choices),
                            finished=final or len(self.finished) == self.n)
