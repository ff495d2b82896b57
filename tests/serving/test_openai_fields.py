"""The field table is complete for the installed `openai` client, agrees with the request models, and its generated
doc is current. A field added by a new client release fails here until it is classified in fields.py."""

from __future__ import annotations

import pytest
from openai.types import completion_create_params
from openai.types.chat import completion_create_params as chat_create_params
from pydantic import ValidationError

from llm_serving.repository import REPO_ROOT
from serving_image.openai_api.errors import from_validation_error
from serving_image.openai_api.fields import CHAT, COMPLETIONS, render_markdown
from serving_image.openai_api.protocol import ChatCompletionRequest, CompletionRequest


def _client_fields(module) -> set[str]:
    fields: set[str] = set()
    for name in ("CompletionCreateParamsStreaming", "CompletionCreateParamsNonStreaming"):
        fields |= set(getattr(module, name).__annotations__)
    for base in module.CompletionCreateParamsStreaming.__mro__:
        fields |= set(getattr(base, "__annotations__", {}))
    return fields


@pytest.mark.parametrize(("module", "table"), [(chat_create_params, CHAT), (completion_create_params, COMPLETIONS)])
def test_every_field_of_the_openai_client_is_classified(module, table):
    client_fields = _client_fields(module)
    assert "stream" in client_fields and "model" in client_fields  # the derivation found the real types
    unclassified = sorted(client_fields - set(table))
    assert unclassified == [], f"classify these new OpenAI fields in serving_image/openai_api/fields.py: {unclassified}"


@pytest.mark.parametrize(("model", "table"), [(ChatCompletionRequest, CHAT), (CompletionRequest, COMPLETIONS)])
def test_request_models_accept_exactly_the_honoured_metadata_and_extension_fields(model, table):
    declared = {f.alias or name for name, f in model.model_fields.items()}
    accepted = {name for name, entry in table.items() if entry.kind != "refused"}
    assert declared == accepted


CHAT_BASE = {"model": "m", "messages": [{"role": "user", "content": "x"}]}


@pytest.mark.parametrize(("model", "table", "endpoint", "base"), [
    (ChatCompletionRequest, CHAT, "/v1/chat/completions", CHAT_BASE),
    (CompletionRequest, COMPLETIONS, "/v1/completions", {"model": "m", "prompt": "x"}),
])
def test_every_refused_field_is_refused_naming_it_and_why(model, table, endpoint, base):
    for name, entry in table.items():
        if entry.kind != "refused":
            continue
        with pytest.raises(ValidationError) as info:
            model.model_validate({**base, name: None})
        error = from_validation_error(info.value, endpoint)
        assert (error.status, error.param, error.code) == (400, name, "unsupported_parameter")
        assert entry.note in error.message


def test_generated_doc_is_current():
    doc = REPO_ROOT / "docs" / "openai-fields.md"
    assert doc.read_text() == render_markdown(), "run: python -m serving_image.openai_api.fields"


@pytest.mark.parametrize(("model", "body", "param", "needle"), [
    (CompletionRequest, {"prompt": "x", "stream_options": {"include_usage": True}}, "stream_options",
     "only allowed when stream is true"),
    (ChatCompletionRequest, {"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}, "top_logprobs",
     "requires logprobs: true"),
    (ChatCompletionRequest, {"messages": [{"role": "user", "content": "x"}], "max_tokens": 2,
                             "max_completion_tokens": 3}, "max_completion_tokens", "disagree"),
])
def test_a_check_across_fields_names_the_field(model, body, param, needle):
    """Found by the in-process fuzz (test_openai_fuzz.py): a model-level check's error had no field (`param`
    null, "Invalid value for 'None'")."""
    with pytest.raises(ValidationError) as info:
        model.model_validate({"model": "m", **body})
    error = from_validation_error(info.value)
    assert error.param == param
    assert f"Invalid value for '{param}'" in str(error.message) and needle in str(error.message)
