"""Differential property tests: the native core against the pure-Python reference, on random specs, random token
streams and random batch operations (moves, swaps, removals, shrunk and rewritten histories, -1 placeholders)."""

from __future__ import annotations

import random

import numpy as np
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from serving_image.constraints import validate_constraint
from serving_image.constraints.machines import ConstraintRows, compile_spec
from serving_image.constraints.reference import ReferenceState
from tests.native.gen import BatchModel, next_token, random_batch_op, random_spec, random_vocab

SETTINGS = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def bitmask_tokens(bitmask: np.ndarray, row: int, vocab: int) -> list[int]:
    bits = np.unpackbits(bitmask[row].view(np.uint8), bitorder="little")
    assert not bits[vocab:].any(), "bits set beyond the vocabulary"
    return np.flatnonzero(bits[:vocab]).tolist()


@SETTINGS
@given(st.randoms(use_true_random=True))
def test_single_row_matches_reference_step_by_step(rng: random.Random):
    vocab, eos = random_vocab(rng)
    spec = random_spec(rng, vocab, eos)
    batch = ConstraintRows(vocab, 2, threads=1)
    tokens: list[int] = []
    batch.set_row(1, compile_spec(spec, vocab, eos), tokens)
    ref = ReferenceState(spec, eos)
    logits = torch.zeros(2, vocab)
    for _ in range(rng.randint(1, 40)):
        batch.sync()
        expected = sorted(ref.allowed())
        assert batch.core.allowed(1) == expected
        assert batch.core.finished(1) == ref.finished
        logits.zero_()
        assert batch.fill_apply(logits) == 1
        assert bitmask_tokens(batch.core.bitmask(), 1, vocab) == expected
        assert torch.isfinite(logits[1]).nonzero().flatten().tolist() == expected
        assert torch.isfinite(logits[0]).all(), "an unconstrained row was masked"
        t = next_token(rng, ref.allowed(), vocab, eos)
        tokens.append(t)
        ref.advance(t)


@SETTINGS
@given(st.randoms(use_true_random=True))
def test_batch_operations_match_reference_replay(rng: random.Random):
    """Whatever happens to the batch, every constrained row's allowed set equals the reference replay of its
    current output list (a function of the generated tokens alone)."""
    vocab, eos = random_vocab(rng)
    capacity = rng.randint(1, 6)
    batch = ConstraintRows(vocab, capacity, threads=rng.choice((1, 2)))
    model = BatchModel(capacity)  # row -> (spec, its output list)
    logits = torch.zeros(capacity, vocab, dtype=rng.choice((torch.float32, torch.bfloat16)))
    for _ in range(rng.randint(5, 60)):
        match random_batch_op(rng, model, vocab, eos, prefilled=True):
            case ("set", row, spec, out):
                batch.set_row(row, compile_spec(spec, vocab, eos), out)
            case ("clear", row):
                batch.clear_row(row)
            case ("move", src, dst):
                batch.move_row(src, dst)
            case ("swap", a, b):
                batch.swap_rows(a, b)
            case ("history", row):
                _, out = model.rows[row]
                op = rng.random()
                if op < 0.12 and out:  # preemption with a shorter history
                    del out[rng.randint(0, len(out) - 1):]
                elif op < 0.2 and out:  # history rewritten in place
                    out[-1] = rng.randrange(vocab)
                elif op < 0.32:  # async placeholder, filled in later
                    out.append(-1)
                elif -1 in out:
                    out[out.index(-1)] = next_token(rng, model.reference(row, eos).allowed(), vocab, eos)
                else:
                    allowed = model.reference(row, eos).allowed()
                    out.extend(next_token(rng, allowed, vocab, eos) for _ in range(rng.randint(1, 3)))
        batch.sync()
        logits.zero_()
        batch.fill_apply(logits)
        for r in range(capacity):
            if r in model.rows:
                expected = model.allowed(r, eos)
                assert batch.core.allowed(r) == expected, (r, model.rows[r][1])
                assert bitmask_tokens(batch.core.bitmask(), r, vocab) == expected
                assert torch.isfinite(logits[r].float()).nonzero().flatten().tolist() == expected
            else:
                assert not batch.core.constrained(r)
                assert torch.isfinite(logits[r].float()).all()


def test_history_shrink_and_rewrite_are_detected():
    vocab, eos = 64, 0
    spec = validate_constraint({"kind": "token_dfa", "start": 0, "accept": [2],
                                "edges": [[0, 17, 1], [1, 42, 2], [1, 17, 1]]}, vocab, eos)
    batch = ConstraintRows(vocab, 1, threads=1)
    out = [17, 42]
    batch.set_row(0, compile_spec(spec, vocab, eos), out)
    assert batch.sync() == 0
    assert batch.core.allowed(0) == [eos]
    del out[1:]  # shorter history: replayed
    assert batch.sync() == 1
    assert batch.core.allowed(0) == [17, 42]
    out[0] = 5  # same length, rewritten: replayed, 5 is not allowed at the start so only eos remains
    assert batch.sync() == 1
    assert batch.core.allowed(0) == [eos] and batch.core.finished(0)
    out[:] = [17, -1]  # a placeholder is not a token
    batch.sync()
    assert batch.core.allowed(0) == [17, 42] and batch.core.consumed(0) == 1
    out[1] = 17
    assert batch.sync() == 0
    assert batch.core.allowed(0) == [17, 42] and batch.core.consumed(0) == 2


@SETTINGS
@given(st.randoms(use_true_random=True))
def test_manual_advance_and_rebuild_match_the_reference(rng: random.Random):
    """The core's direct API (no output list): advance by tokens, rebuild from a history at any time."""
    vocab, eos = random_vocab(rng)
    spec = random_spec(rng, vocab, eos)
    batch = ConstraintRows(vocab, 1, threads=1)
    batch.set_row(0, compile_spec(spec, vocab, eos), None)
    history: list[int] = []
    ref = ReferenceState(spec, eos)
    for _ in range(rng.randint(1, 30)):
        chunk = [next_token(rng, ref.allowed(), vocab, eos) for _ in range(rng.randint(1, 3))]
        for t in chunk:
            ref.advance(t)
        history.extend(chunk)
        if rng.random() < 0.3:
            cut = rng.randint(0, len(history))
            history = history[:cut]
            ref = ReferenceState.replay(spec, eos, history)
            batch.core.rebuild(0, history)
        else:
            batch.core.advance(0, chunk)
        assert batch.core.allowed(0) == sorted(ref.allowed())
        assert batch.core.finished(0) == ref.finished
