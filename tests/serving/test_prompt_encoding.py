"""How the front-ends tokenize a prompt (serving_image/served_model.py `HFTokenizerMixin.encode_prompt`): straight
through the Rust tokenizer under a Hugging Face fast tokenizer, only where that gives exactly the ids
`tokenizer.encode` gives, and through `tokenizer.encode` everywhere else."""

from __future__ import annotations

import random

import pytest
from transformers import AutoTokenizer

from serving_image.served_model import HFTokenizerMixin, rust_tokenizer


class Encoder(HFTokenizerMixin):
    def __init__(self, tokenizer):
        self._tokenizer = tokenizer


@pytest.fixture(scope="module")
def tokenizer(demo_model_dir):
    return AutoTokenizer.from_pretrained(demo_model_dir)


def texts(tokenizer) -> list[str]:
    """Texts as the front-ends meet them: random token runs (the benchmarks' prompts), special tokens written out,
    whitespace runs, non-ASCII and control characters, the empty text."""
    rng = random.Random(7)
    decoded = [tokenizer.decode([rng.randrange(len(tokenizer)) for _ in range(rng.randrange(1, 90))])
               for _ in range(60)]
    return [*decoded, "", " ", "  two  spaces\n\nand lines\t", f"{tokenizer.bos_token}already here",
            f"a{tokenizer.eos_token}b", "ñandú 中文 😀 \x00\x07", "<s></s><unk>"]


def test_the_direct_path_gives_the_ids_transformers_gives(tokenizer):
    encoder = Encoder(tokenizer)
    assert rust_tokenizer(tokenizer) is not None  # the demo model's fast tokenizer takes the direct path
    for text in texts(tokenizer):
        for special in (True, False):
            assert encoder.encode_prompt(text, add_special_tokens=special) == \
                list(tokenizer.encode(text, add_special_tokens=special)), (text, special)


def test_a_truncating_tokenizer_goes_through_transformers_and_is_not_truncated(tokenizer, demo_model_dir):
    # transformers turns a tokenizer.json's truncation off for a plain encode; the Rust tokenizer alone would apply
    # it, so the direct path is not taken while it is set
    truncating = AutoTokenizer.from_pretrained(demo_model_dir)
    truncating.backend_tokenizer.enable_truncation(max_length=4)
    text = "one two three four five six seven eight nine ten"
    expected = list(tokenizer.encode(text, add_special_tokens=True))
    assert len(expected) > 4
    assert Encoder(truncating).encode_prompt(text, add_special_tokens=True) == expected


def test_split_special_tokens_is_honoured(demo_model_dir):
    splitting = AutoTokenizer.from_pretrained(demo_model_dir, split_special_tokens=True)
    text = f"x{splitting.eos_token}y"
    expected = list(splitting.encode(text, add_special_tokens=False))
    assert splitting.eos_token_id not in expected  # the written-out token is split, not read as the special one
    assert Encoder(splitting).encode_prompt(text, add_special_tokens=False) == expected


def test_a_tokenizer_without_a_rust_tokenizer_or_one_that_encodes_differently_is_used_as_it_is(tokenizer):
    class Slow:  # a slow tokenizer: no backend_tokenizer
        def encode(self, text, add_special_tokens):
            return [len(text), int(add_special_tokens)]

    class Prefixing:  # a wrapper whose encode adds to what its Rust tokenizer gives
        backend_tokenizer = tokenizer.backend_tokenizer
        split_special_tokens = False

        def encode(self, text, add_special_tokens):
            return [0, *tokenizer.encode(text, add_special_tokens=add_special_tokens)]

    assert rust_tokenizer(Slow()) is None and rust_tokenizer(Prefixing()) is None
    assert Encoder(Slow()).encode_prompt("abc", add_special_tokens=True) == [3, 1]
    assert Encoder(Prefixing()).encode_prompt("abc", add_special_tokens=False) == \
        [0, *tokenizer.encode("abc", add_special_tokens=False)]


def test_truncation_set_before_the_first_encode_does_not_cost_the_direct_path(tokenizer, demo_model_dir):
    truncating = AutoTokenizer.from_pretrained(demo_model_dir)
    truncating.backend_tokenizer.enable_truncation(max_length=4)
    assert rust_tokenizer(truncating) is truncating.backend_tokenizer  # transformers' probe encode turned it off
    text = "one two three four five six seven eight nine ten"
    assert Encoder(truncating).encode_prompt(text, add_special_tokens=True) == \
        list(tokenizer.encode(text, add_special_tokens=True))
