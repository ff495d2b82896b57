"""Constraints through the OpenAI API end to end: the platform's server (startup procedure, real vLLM engine,
the constraint processor loaded from its entry point) and the official `openai` client sending `constraint` in
`extra_body`. Malformed constraints come back as 400 naming the field.

The specs use tokens whose texts are whole words, none a prefix of another, so a response's text maps back to
exactly one token sequence, which the pure-Python reference then checks.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import openai
import pytest

from serving_image.constraints.reference import satisfies
from serving_image.constraints.spec import validate_constraint
from serving_image.local_server import publish_demo, start_server

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def server(demo_model_dir: Path, tmp_path_factory):
    root = tmp_path_factory.mktemp("constraints-openai")
    srv = start_server(publish_demo(demo_model_dir, root), root)
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def words(demo_model_dir: Path) -> dict[int, str]:
    """Token id -> text for whole-word tokens, none a prefix of another (so text parses back uniquely)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(demo_model_dir))
    cands = {i: tok.decode([i]) for i in range(len(tok))}
    cands = {i: s for i, s in cands.items() if s.startswith(" ") and s[1:].isalpha() and len(s) > 3}
    texts = list(cands.values())
    return {i: s for i, s in cands.items() if not any(o != s and o.startswith(s) for o in texts)}


def parse(text: str, words: dict[int, str]) -> list[int]:
    by_text = {s: i for i, s in words.items()}
    out, at = [], 0
    while at < len(text):
        match = [s for s in by_text if text.startswith(s, at)]
        assert len(match) == 1, f"text {text!r} is not a sequence of the constraint's words (at {at})"
        out.append(by_text[match[0]])
        at += len(match[0])
    return out


def specs(words: dict[int, str]) -> list[dict]:
    w = sorted(words)[:12]
    return [
        {"kind": "choice_sequence", "choices": [[w[0], w[1]], [w[2]], [w[3], w[4], w[5]], [w[6]]],
         "separator": [w[7]], "min_items": 2, "max_items": 3, "unique": True},
        {"kind": "token_dfa", "start": 0, "accept": [2],
         "edges": [[0, w[8], 1], [1, w[9], 2], [2, w[10], 0], [1, w[11], 1]]},
        {"kind": "allowed_tokens", "tokens": [w[0], w[3], w[6], w[9]]},
    ]


def check(spec: dict, text: str, finish_reason: str, words: dict[int, str]) -> None:
    tokens = parse(text, words)  # may be empty: eos first is allowed by allowed_tokens (the reference decides)
    problem = satisfies(validate_constraint(spec, None, None), 1, tokens, finished_by_eos=finish_reason == "stop")
    assert problem is None, f"{spec['kind']}: {problem} (text {text!r}, finish {finish_reason})"


def test_concurrent_constrained_completions_and_chats_satisfy_their_constraints(client, words):
    all_specs = specs(words)

    def one(i: int):
        spec = all_specs[i % 3]
        if i % 2:
            r = client.completions.create(model="demo-tiny", prompt=f"Request {i}: list a few things", max_tokens=40,
                                          extra_body={"constraint": spec})
            return spec, r.choices[0].text, r.choices[0].finish_reason
        r = client.chat.completions.create(model="demo-tiny", messages=[{"role": "user", "content": f"Say {i}"}],
                                           max_tokens=40, extra_body={"constraint": spec})
        return spec, r.choices[0].message.content, r.choices[0].finish_reason

    with ThreadPoolExecutor(24) as pool:
        results = list(pool.map(one, range(48)))
    for spec, text, finish in results:
        check(spec, text, finish, words)
    # the unique choice sequence ends by itself (at most 3 items, then only eos)
    assert any(finish == "stop" for spec, _, finish in results if spec["kind"] == "choice_sequence")


def test_streaming_respects_the_constraint(client, words):
    spec = specs(words)[0]
    stream = client.completions.create(model="demo-tiny", prompt="stream", max_tokens=40, stream=True,
                                       extra_body={"constraint": spec})
    text, finish = "", None
    for chunk in stream:
        if chunk.choices:
            text += chunk.choices[0].text
            finish = chunk.choices[0].finish_reason or finish
    check(spec, text, finish, words)


@pytest.mark.parametrize(
    ("constraint", "field", "message"),
    [
        ({"kind": "token_dfa", "start": 0, "accept": [1], "edges": [[0, 5, 1], [1, 6, 1], [1, 7, 0], [0, 99999, 1]]},
         "constraint.edges[3][1]", "token id 99999 is outside the vocabulary (0..623)"),
        ({"kind": "choice_sequence", "choices": [[5]], "separator": [5]}, "constraint.separator[0]",
         "also appears in constraint.choices[0]"),
        ({"kind": "allowed_tokens", "tokens": [1, "x"]}, "constraint.tokens[1]", "must be an integer"),
        ({"kind": "regex"}, "constraint.kind", "must be one of"),
    ],
)
def test_malformed_constraint_is_a_400_naming_the_field(client, constraint, field, message):
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model="demo-tiny", prompt="x", max_tokens=4, extra_body={"constraint": constraint})
    assert err.value.status_code == 400
    assert field in str(err.value) and message in str(err.value)
