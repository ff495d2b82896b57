"""serving_image.json_text: msgspec's speed with the standard library's results and errors, and the spliced
sampling_parameters text the front-end hands Triton (the same JSON as json.dumps wrote before)."""

from __future__ import annotations

import json

import pytest

from serving_image.constraints.spec import spec_to_json, validate_constraint
from serving_image.engine.base import SamplingSpec
from serving_image.json_text import dumps_spec, loads
from serving_image.triton.translate import sampling_parameters_json


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
    constraint = spec_to_json(validate_constraint({"kind": "allowed_tokens", "tokens": [3, 4, 5]}, 64, 2))
    spec = SamplingSpec(max_tokens=8, temperature=0.5, stop=("é",), constraint=constraint)
    text = sampling_parameters_json(spec, "structured_outputs")
    params = json.loads(text)
    assert params["extra_args"] == {"constraint": constraint}
    assert params["max_tokens"] == 8 and params["temperature"] == 0.5 and params["stop"] == ["é"]
    without = json.loads(sampling_parameters_json(SamplingSpec(max_tokens=8, temperature=0.5, stop=("é",)),
                                                  "structured_outputs"))
    assert {k: v for k, v in params.items() if k != "extra_args"} == without
