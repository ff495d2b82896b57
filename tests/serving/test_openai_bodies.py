"""The pure half of the OpenAI front-end: request parsing, error naming, and the mapping to the engine's spec."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from serving_image.openai_api.errors import APIError, from_validation_error
from serving_image.openai_api.openai_bodies import chat_messages, sampling_spec
from serving_image.openai_api.protocol import ChatCompletionRequest, CompletionRequest
from serving_image.served_model import ModelInfo, StructuredOutput

INFO = ModelInfo(name="demo", version="1", max_model_len=512, vocab_size=600, eos_token_id=1)
MESSAGES = [{"role": "user", "content": "hi"}]


def _error(model_cls, body: dict) -> APIError:
    with pytest.raises(ValidationError) as info:
        model_cls.model_validate(body)
    return from_validation_error(info.value)


@pytest.mark.parametrize(
    ("body", "param", "code"),
    [
        ({"tools": []}, "tools", "unsupported_parameter"),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
         "response_format.json_schema.schema", "missing_required_parameter"),
        ({"response_format": {"type": "xml"}}, "response_format", "invalid_value"),
        ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
         "messages[0].content", "invalid_value"),
        ({"messages": [{"role": "user", "content": "x", "name": "bob"}]}, "messages[0].name",
         "unsupported_parameter"),
        ({"temperature": 2.5}, "temperature", "invalid_value"),
        ({"top_logprobs": 3}, "top_logprobs", "invalid_value"),
        ({"stream_options": {"include_usage": True}}, "stream_options", "invalid_value"),
        ({"stop": ["a", "b", "c", "d", "e"]}, "stop", "invalid_value"),
        ({"logit_bias": {"abc": 1}}, "logit_bias", "invalid_value"),
    ],
)
def test_chat_errors_name_the_field(body: dict, param: str | None, code: str):
    error = _error(ChatCompletionRequest, {"model": "demo", "messages": MESSAGES, **body})
    assert error.status == 400 and error.code == code
    assert error.param == param
    if param:
        assert param in error.message


def test_non_text_content_part_is_named():
    error = _error(ChatCompletionRequest, {"model": "demo", "messages": [
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "image_url", "image_url": {}}]}]})
    assert "content[1].type 'image_url' is not supported" in error.message


def test_unknown_fields_are_reported_first():
    error = _error(ChatCompletionRequest, {"model": "demo", "messages": MESSAGES, "temperature": 9, "zzz": 1})
    assert error.param == "zzz" and "temperature" in error.message


def test_sampling_spec_maps_every_honoured_field():
    req = ChatCompletionRequest.model_validate({
        "model": "demo", "messages": MESSAGES, "max_completion_tokens": 9, "temperature": 0.5, "top_p": 0.9,
        "n": 2, "stop": "END", "seed": 7, "logprobs": True, "top_logprobs": 3, "logit_bias": {"5": -100},
        "presence_penalty": 0.5, "frequency_penalty": -0.5,
        "response_format": {"type": "json_schema", "json_schema": {"name": "s", "schema": {"type": "object"}}},
    })
    spec = sampling_spec(req, INFO)
    assert (spec.max_tokens, spec.temperature, spec.top_p, spec.n, spec.stop, spec.seed) == \
        (9, 0.5, 0.9, 2, ("END",), 7)
    assert spec.logprobs == 3 and spec.logit_bias == {5: -100}
    assert (spec.presence_penalty, spec.frequency_penalty) == (0.5, -0.5)
    assert spec.structured == StructuredOutput("json_schema", {"type": "object"})


def test_completion_defaults_follow_openai():
    spec = sampling_spec(CompletionRequest.model_validate({"model": "demo", "prompt": "x"}), INFO)
    assert spec.max_tokens == 16 and spec.temperature == 1.0 and spec.logprobs is None


def test_json_object_and_extensions():
    req = ChatCompletionRequest.model_validate({"model": "demo", "messages": MESSAGES,
                                                "response_format": {"type": "json_object"}})
    assert sampling_spec(req, INFO).structured == StructuredOutput("json_object")
    req = ChatCompletionRequest.model_validate({"model": "demo", "messages": MESSAGES,
                                                "structured_outputs": {"choice": ["yes", "no"]}})
    assert sampling_spec(req, INFO).structured == StructuredOutput("choice", ["yes", "no"])


def test_structured_outputs_and_response_format_cannot_be_combined():
    req = ChatCompletionRequest.model_validate({"model": "demo", "messages": MESSAGES,
                                                "response_format": {"type": "json_object"},
                                                "structured_outputs": {"regex": "a+"}})
    with pytest.raises(APIError) as info:
        sampling_spec(req, INFO)
    assert info.value.param == "structured_outputs"


def test_logit_bias_outside_the_vocabulary_is_refused():
    req = ChatCompletionRequest.model_validate({"model": "demo", "messages": MESSAGES, "logit_bias": {"600": 1}})
    with pytest.raises(APIError) as info:
        sampling_spec(req, INFO)
    assert info.value.param == "logit_bias.600"


def test_constraint_is_validated_naming_the_field():
    req = ChatCompletionRequest.model_validate({
        "model": "demo", "messages": MESSAGES,
        "constraint": {"kind": "allowed_tokens", "tokens": [5, 99999]}})
    with pytest.raises(APIError) as info:
        sampling_spec(req, INFO)
    assert info.value.status == 400 and info.value.param.startswith("constraint.tokens")


def test_developer_role_is_rendered_as_system():
    req = ChatCompletionRequest.model_validate({"model": "demo", "messages": [
        {"role": "developer", "content": "be brief"}, {"role": "user", "content": [{"type": "text", "text": "a"},
                                                                                     {"type": "text", "text": "b"}]}]})
    assert chat_messages(req) == [{"role": "system", "content": "be brief"}, {"role": "user", "content": "ab"}]
