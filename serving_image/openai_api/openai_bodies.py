"""Pure translation between OpenAI request/response bodies and the served-model interface.

No I/O here: the app feeds requests in and generation outputs through, so every mapping is testable on its own and
shared by every served model.
"""

from __future__ import annotations

import time

from serving_image.constraints.spec import ConstraintError, constraint_text
from serving_image.openai_api.errors import bad_request
from serving_image.openai_api.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    ResponseFormatJsonObject,
    ResponseFormatJsonSchema,
)
from serving_image.served_model import (
    ModelInfo,
    OutputTotals,
    SamplingSpec,
    StructuredOutput,
    TokenLogprob,
)


def _structured(req: ChatCompletionRequest | CompletionRequest) -> StructuredOutput | None:
    given = []
    if req.response_format is not None and not req.response_format.type == "text":
        given.append("response_format")
    if req.structured_outputs is not None:
        given.append("structured_outputs")
    if req.constraint is not None:
        given.append("constraint")
    if len(given) > 1:
        raise bad_request(f"{' and '.join(given)} cannot be combined: each one alone decides the allowed tokens",
                          param=given[1])
    if isinstance(req.response_format, ResponseFormatJsonObject):
        return StructuredOutput("json_object")
    if isinstance(req.response_format, ResponseFormatJsonSchema):
        return StructuredOutput("json_schema", req.response_format.json_schema.schema_)
    so = req.structured_outputs
    if so is None:
        return None
    if so.regex is not None:
        return StructuredOutput("regex", so.regex)
    if so.choice is not None:
        return StructuredOutput("choice", list(so.choice))
    if so.grammar is not None:
        return StructuredOutput("grammar", so.grammar)
    return StructuredOutput("json_schema", so.json_)


def sampling_spec(req: ChatCompletionRequest | CompletionRequest, info: ModelInfo) -> SamplingSpec:
    """Every honoured field, mapped. Anything the request carries that has no place here was refused earlier."""
    if isinstance(req, ChatCompletionRequest):
        max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        logprobs = (req.top_logprobs or 0) if req.logprobs else None
    else:
        max_tokens = req.max_tokens if req.max_tokens is not None else 16  # OpenAI's completions default
        logprobs = req.logprobs
    bias = None
    if req.logit_bias:
        bias = {}
        for key, value in req.logit_bias.items():
            token = int(key)
            if not 0 <= token < info.vocab_size:
                raise bad_request(f"logit_bias: token id {token} is outside the vocabulary (0..{info.vocab_size - 1})",
                                  param=f"logit_bias.{key}")
            bias[token] = value
    constraint = None
    if req.constraint is not None:
        try:
            constraint = constraint_text(req.constraint, info.vocab_size, info.eos_token_id)
        except ConstraintError as exc:
            raise bad_request(str(exc), param=exc.field) from exc
    stop = (req.stop,) if isinstance(req.stop, str) else tuple(req.stop or ())
    return SamplingSpec(
        max_tokens=max_tokens,
        temperature=1.0 if req.temperature is None else req.temperature,
        top_p=1.0 if req.top_p is None else req.top_p,
        n=req.n or 1,
        stop=stop,
        seed=req.seed,
        logprobs=logprobs,
        logit_bias=bias,
        presence_penalty=req.presence_penalty or 0.0,
        frequency_penalty=req.frequency_penalty or 0.0,
        top_k=req.top_k if req.top_k not in (None, -1, 0) else None,
        min_p=req.min_p or 0.0,
        repetition_penalty=1.0 if req.repetition_penalty is None else req.repetition_penalty,
        min_tokens=req.min_tokens or 0,
        ignore_eos=bool(req.ignore_eos),
        structured=_structured(req),
        constraint=constraint,
    )


def chat_messages(req: ChatCompletionRequest) -> list[dict[str, str]]:
    # "developer" is OpenAI's newer name for "system"; chat templates know "system".
    return [{"role": "system" if m.role == "developer" else m.role, "content": m.text()} for m in req.messages]


# -- responses ------------------------------------------------------------------------------------------------------


def openai_finish_reason(reason: str | None) -> str | None:
    if reason is None or reason in ("stop", "length"):
        return reason
    # The served models raise on "abort" and "error" (served_model.raise_if_cut_short): reaching here is a bug.
    raise ValueError(f"finish reason {reason!r} has no OpenAI equivalent")


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def chat_logprobs(items: list[TokenLogprob]) -> dict:
    def entry(token: str, logprob: float) -> dict:
        return {"token": token, "logprob": logprob, "bytes": list(token.encode("utf-8"))}

    return {"content": [dict(entry(t.token, t.logprob), top_logprobs=[entry(x.token, x.logprob) for x in t.top])
                        for t in items], "refusal": None}


def completion_logprobs(items: list[TokenLogprob], text_offset: int = 0) -> dict:
    offsets, position = [], text_offset
    for item in items:
        offsets.append(position)
        position += len(item.token)
    return {
        "tokens": [t.token for t in items],
        "token_logprobs": [t.logprob for t in items],
        "top_logprobs": [{x.token: x.logprob for x in t.top} for t in items],
        "text_offset": offsets,
    }


def chat_response(request_id: str, model: str, acc: OutputTotals, want_logprobs: bool) -> dict:
    return {
        "id": request_id,
        "object": "chat.completion",
        "created": int(time.time()),
        "model": model,
        "choices": [
            {
                "index": index,
                "message": {"role": "assistant", "content": state.text, "refusal": None},
                "logprobs": chat_logprobs(state.logprobs) if want_logprobs else None,
                "finish_reason": openai_finish_reason(state.finish_reason),
            }
            for index, state in sorted(acc.choices.items())
        ],
        "usage": usage(acc.prompt_tokens, acc.completion_tokens),
    }


def completion_response(request_id: str, model: str, acc: OutputTotals, want_logprobs: bool,
                        echo_prefix: dict[int, str]) -> dict:
    choices = []
    for index, state in sorted(acc.choices.items()):
        prefix = echo_prefix.get(index, "")
        choices.append({
            "index": index,
            "text": prefix + state.text,
            "logprobs": completion_logprobs(state.logprobs, len(prefix)) if want_logprobs else None,
            "finish_reason": openai_finish_reason(state.finish_reason),
        })
    return {"id": request_id, "object": "text_completion", "created": int(time.time()), "model": model,
            "choices": choices, "usage": usage(acc.prompt_tokens, acc.completion_tokens)}


def chat_chunk(request_id: str, model: str, created: int, choices: list[dict], usage_: dict | None = None) -> dict:
    body = {"id": request_id, "object": "chat.completion.chunk", "created": created, "model": model,
            "choices": choices}
    if usage_ is not None:
        body["usage"] = usage_
    return body


def completion_chunk(request_id: str, model: str, created: int, choices: list[dict],
                     usage_: dict | None = None) -> dict:
    body = {"id": request_id, "object": "text_completion", "created": created, "model": model, "choices": choices}
    if usage_ is not None:
        body["usage"] = usage_
    return body
