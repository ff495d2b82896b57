"""The constraint processor's admission check (vLLM's validate_params) and the texts the stand-in backend's stub
checked with the served model's vocabulary (spec.remember_checked): such a text is not checked again, once; any
other text, an equal copy included, is: in one native pass when it is in its plain form, else parsed and checked in
full."""

from __future__ import annotations

import pytest
from vllm import SamplingParams

from serving_image.constraints import vllm_v1
from serving_image.constraints.spec import (
    ConstraintError,
    checked_plain_text,
    constraint_text,
    remember_checked,
    take_checked,
    validate_constraint,
)

SPEC = {"kind": "allowed_tokens", "tokens": [3, 4, 5]}


@pytest.fixture
def checks(monkeypatch) -> list[object]:
    """Every check admission runs: ("plain", text) for the native pass, ("full", value) for validate_constraint."""
    seen: list[object] = []

    def full(spec, vocab_size, eos_token_id):
        seen.append(("full", spec))
        return validate_constraint(spec, vocab_size, eos_token_id)

    def plain(text, vocab_size, eos_token_id):
        seen.append(("plain", text.decode()))
        return checked_plain_text(text, vocab_size, eos_token_id)

    monkeypatch.setattr(vllm_v1, "validate_constraint", full)
    monkeypatch.setattr(vllm_v1, "checked_plain_text", plain)
    return seen


def _params(text: str) -> SamplingParams:
    return SamplingParams(max_tokens=4, extra_args={"constraint": text})


def test_a_text_the_stub_checked_is_admitted_without_a_second_check_once(checks):
    text = remember_checked(constraint_text(SPEC, 64, 2))
    vllm_v1.validate_at_admission(_params(text))
    assert checks == []
    vllm_v1.validate_at_admission(_params(text))  # taken: the same text again is checked like any other
    assert checks == [("plain", text)]


def test_an_equal_copy_and_a_bad_text_are_checked(checks):
    text = remember_checked(constraint_text(SPEC, 64, 2))
    copy = "".join(list(text))
    assert copy == text and copy is not text
    vllm_v1.validate_at_admission(_params(copy))
    assert checks == [("plain", copy)]
    bad = '{"kind":"allowed_tokens","tokens":[]}'
    with pytest.raises(ConstraintError, match=r"^constraint\.tokens: must not be empty"):
        vllm_v1.validate_at_admission(_params(bad))
    assert checks[1:] == [("plain", bad), ("full", {"kind": "allowed_tokens", "tokens": []})]  # the full read names it
    assert take_checked(text)  # still waiting for its own admission


def test_texts_never_admitted_age_out():
    texts = [remember_checked(constraint_text(SPEC, 64, 2)) for _ in range(100)]
    assert not take_checked(texts[0])  # a request that failed before admission leaves nothing behind for long
    assert take_checked(texts[-1])
