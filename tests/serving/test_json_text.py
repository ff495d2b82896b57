"""serving_image.json_text: msgspec's speed with the standard library's results and errors, and the spliced
sampling_parameters text the front-end hands Triton (the same JSON as json.dumps wrote before)."""

from __future__ import annotations

import json

import pytest

from serving_image.constraints.spec import constraint_text, spec_to_json, validate_constraint
from serving_image.engine.vllm_backend_tensors import sampling_parameters_json
from serving_image.json_text import JSONText, dumps_spec, loads, loads_keeping
from serving_image.served_model import SamplingSpec


@pytest.mark.parametrize("text", ['{"a":1,"a":2}', "[1, 2.5, true, null]", '"\\u00e9"', "NaN", "[Infinity]",
                                  str(2 ** 70), '{"tokens":[1,2,3]}'])
def test_loads_gives_what_json_loads_gives(text):
    got, expected = loads(text), json.loads(text)
    assert repr(got) == repr(expected) and type(got) is type(expected)


@pytest.mark.parametrize("text", ["[1,", "{'a': 1}", "", "[1,]"])
def test_malformed_text_raises_json_loads_own_error(text):
    with pytest.raises(json.JSONDecodeError) as ours:
        loads(text)
    with pytest.raises(json.JSONDecodeError) as stdlib:
        json.loads(text)
    assert str(ours.value) == str(stdlib.value)


@pytest.mark.parametrize("spec", [{"kind": "allowed_tokens", "tokens": list(range(0, 8000, 3))},
                                  {"kind": "choice_sequence", "choices": [[5, 6], [7]], "separator": [9],
                                   "min_items": 1, "max_items": 3, "unique": True},
                                  {"kind": "token_dfa", "start": 0, "accept": [1], "edges": [[0, 5, 1]]}])
def test_dumps_spec_writes_what_compact_json_dumps_writes(spec):
    canonical = spec_to_json(validate_constraint(spec, vocab_size=8192, eos_token_id=2))
    assert dumps_spec(canonical) == json.dumps(canonical, separators=(",", ":"))


def test_sampling_parameters_carry_the_constraint_as_extra_args_after_every_other_field():
    constraint = constraint_text({"kind": "allowed_tokens", "tokens": [3, 4, 5]}, 64, 2)
    spec = SamplingSpec(max_tokens=8, temperature=0.5, stop=("é",), constraint=constraint)
    text = sampling_parameters_json(spec, "structured_outputs")
    params = json.loads(text)
    assert params["extra_args"] == {"constraint": {"kind": "allowed_tokens", "tokens": [3, 4, 5]}}
    assert params["max_tokens"] == 8 and params["temperature"] == 0.5 and params["stop"] == ["é"]
    without = json.loads(sampling_parameters_json(SamplingSpec(max_tokens=8, temperature=0.5, stop=("é",)),
                                                  "structured_outputs"))
    assert {k: v for k, v in params.items() if k != "extra_args"} == without


KEEP = {"constraint": None, "extra_args": {"constraint": None}}


@pytest.mark.parametrize(("text", "constraint_kept"), [
    ('{"model":"m","constraint":{"kind":"allowed_tokens","tokens":[1, 2]},"n":1}', True),
    ('{"extra_args":{"constraint":{"kind":"x"},"other":[1.5,"é"]},"constraint":5}', False),
    ('{"constraint":[1,2],"extra_args":"no"}', False),  # kept only when an object
    ('{"constraint":{"a":1},"constraint":{"b":2}}', True),  # the last of duplicate members, as json.loads
])
def test_loads_keeping_leaves_the_named_objects_as_text_and_reads_the_rest_as_json_loads(text, constraint_kept):
    kept = loads_keeping(text, KEEP)

    def unkeep(value):
        if isinstance(value, JSONText):
            return json.loads(value.text)
        if isinstance(value, dict):
            return {k: unkeep(v) for k, v in value.items()}
        return value

    assert unkeep(kept) == json.loads(text)
    assert isinstance(kept.get("constraint"), JSONText) is constraint_kept
    if isinstance(kept.get("extra_args"), dict):
        assert isinstance(kept["extra_args"]["constraint"], JSONText)


@pytest.mark.parametrize("text", ['{"constraint":{"a":NaN}}', "[1,2]", '"s"', "{'a': 1}", '{"a":1,}'])
def test_loads_keeping_gives_what_loads_gives_for_anything_else(text):
    try:
        expected = json.loads(text)
    except json.JSONDecodeError as exc:
        with pytest.raises(json.JSONDecodeError) as ours:
            loads_keeping(text, KEEP)
        assert str(ours.value) == str(exc)
    else:
        assert repr(loads_keeping(text, KEEP)) == repr(expected)
