"""The field table: every request field of the OpenAI API, classified (docs/architecture.md §3.2).

Each field of `/v1/chat/completions` and `/v1/completions` is one of
- honoured: it changes what the server does, and a test shows its effect;
- metadata: accepted without effect on the output, and recorded in the request log;
- refused: HTTP 400 naming the field, with the reason below.

A test derives the field list from the installed `openai` client's own request types, so a field added in a new
client release fails the suite until it is classified here. `python -m serving_image.openai_api.fields` writes
`docs/openai-fields.md` (a test checks that the committed file is current).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

Kind = Literal["honoured", "metadata", "refused", "extension"]


@dataclass(frozen=True)
class Field:
    kind: Kind
    note: str


CHAT: dict[str, Field] = {
    "model": Field("honoured", "must name the served model id; another id is 404 `model_not_found`"),
    "messages": Field("honoured", "roles system, developer (as system), user, assistant; text content or text parts "
                                  "(other part types are refused naming `messages[i].content`)"),
    "max_tokens": Field("honoured", "deprecated alias of max_completion_tokens; both given must agree"),
    "max_completion_tokens": Field("honoured", "must fit in the context window with the prompt (else 400); "
                                               "default: the rest of the context window"),
    "temperature": Field("honoured", "0..2; 0 is greedy"),
    "top_p": Field("honoured", "(0, 1]"),
    "n": Field("honoured", "1..16 choices"),
    "stop": Field("honoured", "a string or up to 4 strings; the stop string is not included in the output"),
    "seed": Field("honoured", "per-request sampling seed: the same seed gives the same output"),
    "stream": Field("honoured", "server-sent events, ending with `data: [DONE]`"),
    "stream_options": Field("honoured", "`include_usage`: a last chunk with empty choices and the usage"),
    "logprobs": Field("honoured", "log-probability of each output token"),
    "top_logprobs": Field("honoured", "0..20 alternatives per position; needs logprobs: true"),
    "logit_bias": Field("honoured", "token id -> bias in -100..100; ids outside the vocabulary are refused"),
    "presence_penalty": Field("honoured", "-2..2"),
    "frequency_penalty": Field("honoured", "-2..2"),
    "response_format": Field("honoured", "`text`, `json_object`, `json_schema` (strict or not: the schema is always "
                                         "enforced by grammar-constrained decoding)"),
    "user": Field("metadata", "recorded in the request log"),
    "metadata": Field("metadata", "string key/value pairs, recorded in the request log"),
    "safety_identifier": Field("metadata", "recorded in the request log"),
    "prompt_cache_key": Field("metadata", "recorded in the request log; prefix caching is automatic in vLLM"),
    "tools": Field("refused", "tool calling is not implemented: a tool call would come back as plain text; use "
                              "`response_format` with a JSON schema or `structured_outputs` instead"),
    "tool_choice": Field("refused", "tool calling is not implemented (see tools)"),
    "parallel_tool_calls": Field("refused", "tool calling is not implemented (see tools)"),
    "functions": Field("refused", "deprecated function calling is not implemented (see tools)"),
    "function_call": Field("refused", "deprecated function calling is not implemented (see tools)"),
    "audio": Field("refused", "the served models produce text only"),
    "modalities": Field("refused", "the served models produce text only"),
    "prediction": Field("refused", "predicted outputs (speculative decoding from a given text) are not supported"),
    "reasoning_effort": Field("refused", "the served models have no reasoning-effort setting"),
    "verbosity": Field("refused", "the served models have no verbosity setting"),
    "web_search_options": Field("refused", "no web search is available to the served models"),
    "store": Field("refused", "completions are not stored for distillation or evals"),
    "service_tier": Field("refused", "there are no service tiers; capacity is managed by the platform"),
    "moderation": Field("refused", "no moderation is run by this server"),
    "prompt_cache_options": Field("refused", "prompt caching is automatic and has no options here"),
    "prompt_cache_retention": Field("refused", "prompt caching is automatic; its retention cannot be chosen"),
    "constraint": Field("extension", "step-wise token constraint (docs/architecture.md §3.5), "
                                     "`extra_body` in the client"),
    "structured_outputs": Field("extension", "exactly one of `regex`, `choice`, `grammar`, `json` (vLLM's "
                                             "structured outputs); not combinable with response_format/constraint"),
    "top_k": Field("extension", "vLLM's: sample from the k most likely tokens; 0 or -1 disables"),
    "min_p": Field("extension", "vLLM's: drop tokens below this fraction of the most likely one's probability"),
    "repetition_penalty": Field("extension", "vLLM's: (0, 2]; above 1 discourages tokens already in the text"),
    "min_tokens": Field("extension", "vLLM's: end-of-sequence and stop strings are ignored before this many tokens"),
    "ignore_eos": Field("extension", "vLLM's: keep generating past end-of-sequence until max tokens"),
}

COMPLETIONS: dict[str, Field] = {
    "model": CHAT["model"],
    "prompt": Field("honoured", "a string, a list of strings (one set of choices each), or a list of token ids"),
    "max_tokens": Field("honoured", "default 16, as OpenAI; must fit in the context window with the prompt"),
    "temperature": CHAT["temperature"],
    "top_p": CHAT["top_p"],
    "n": CHAT["n"],
    "stop": CHAT["stop"],
    "seed": CHAT["seed"],
    "stream": CHAT["stream"],
    "stream_options": CHAT["stream_options"],
    "logprobs": Field("honoured", "0..5: the sampled token's log-probability plus that many alternatives"),
    "logit_bias": CHAT["logit_bias"],
    "presence_penalty": CHAT["presence_penalty"],
    "frequency_penalty": CHAT["frequency_penalty"],
    "echo": Field("honoured", "the prompt is prepended to each choice's text"),
    "user": CHAT["user"],
    "best_of": Field("refused", "server-side best-of sampling is not supported (vLLM V1 removed it); use n"),
    "suffix": Field("refused", "insertion (text after the completion) is not supported by the served models"),
    "constraint": CHAT["constraint"],
    "structured_outputs": CHAT["structured_outputs"],
    "response_format": Field("extension", "as in chat completions (not part of OpenAI's completions API)"),
    **{name: CHAT[name] for name in ("top_k", "min_p", "repetition_penalty", "min_tokens", "ignore_eos")},
}

TABLES = {"/v1/chat/completions": CHAT, "/v1/completions": COMPLETIONS}


def refusal_reason(endpoint: str, field: str) -> str | None:
    entry = TABLES.get(endpoint, {}).get(field)
    return entry.note if entry is not None and entry.kind == "refused" else None


def render_markdown() -> str:
    lines = [
        "# OpenAI API: every request field, classified",
        "",
        "Generated by `python -m serving_image.openai_api.fields` from `serving_image/openai_api/fields.py`; a test",
        "fails when the installed `openai` client has a field that is not classified here, and when this file is",
        "stale. **honoured**: it changes what the server does (a test shows it); **metadata**: accepted, no effect on",
        "the output, recorded in the request log; **refused**: HTTP 400 naming the field; **extension**: this",
        "platform's own fields (`extra_body` in the `openai` client). Any field not listed is refused the same way.",
        "",
    ]
    for endpoint, table in TABLES.items():
        lines += [f"## `{endpoint}`", "", "| field | | what the server does |", "| --- | --- | --- |"]
        order = {"honoured": 0, "extension": 1, "metadata": 2, "refused": 3}
        for name, entry in sorted(table.items(), key=lambda item: (order[item[1].kind], item[0])):
            lines.append(f"| `{name}` | {entry.kind} | {entry.note} |")
        lines.append("")
    lines += [
        "## Other endpoints",
        "",
        "- `/v1/embeddings`: `model`, `input` (string, list of strings, token ids), `encoding_format` (`float`,",
        "  `base64`) and `dimensions` (refused unless equal to the model's size) are honoured, `user` is metadata.",
        "- `/v1/score` (extension): `{\"model\", \"prompt\", \"candidates\": [...]}` returns the summed",
        "  log-probability of each candidate continuation given the prompt, computed in the prefill (no decoding).",
        "",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    out = Path(argv[0]) if argv else Path("docs/openai-fields.md")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(render_markdown())
    print(out)


if __name__ == "__main__":
    main()
