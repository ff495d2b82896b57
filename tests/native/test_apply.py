"""Bitmask application: the core's CPU kernels (float32, bfloat16), the torch path used on other devices, and
xgrammar's CPU kernel all give the same logits for the same bitmask (xgrammar's layout)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from serving_image.constraints.machines import ConstraintRows, apply_bitmask_torch, compile_spec
from serving_image.constraints.spec import AllowedTokensSpec, validate_constraint


def random_batch(vocab: int, rows: int, seed: int, threads: int = 0) -> tuple[ConstraintRows, list[list[int]]]:
    """Rows constrained with random allowed sets of very different sizes (sparse and dense)."""
    rng = np.random.default_rng(seed)
    batch = ConstraintRows(vocab, rows, threads=threads)
    sets = []
    for r in range(rows):
        size = int(rng.choice([1, 5, 100, vocab // 3, vocab - 1]))
        toks = sorted({int(t) for t in rng.integers(0, vocab, size)} | {0})
        spec = AllowedTokensSpec(tokens=tuple(toks))  # valid by construction (validation is tested elsewhere)
        batch.set_row(r, compile_spec(spec, vocab, 0), None)
        sets.append(toks)
    return batch, sets


def expected_logits(logits: torch.Tensor, sets: list[list[int]]) -> torch.Tensor:
    """The definition: every logit whose token is not in its row's set becomes -inf."""
    keep = torch.zeros(logits.shape, dtype=torch.bool)
    rows = torch.tensor([r for r, toks in enumerate(sets) for _ in toks], dtype=torch.long)
    cols = torch.tensor([t for toks in sets for t in toks], dtype=torch.long)
    keep[rows, cols] = True
    return logits.masked_fill(~keep, float("-inf"))


@pytest.mark.parametrize("vocab", [31, 32, 1000, 32_768 + 77])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("threads", [1, 0])
def test_native_and_torch_paths_match_the_definition(vocab, dtype, threads):
    batch, sets = random_batch(vocab, 6, seed=vocab, threads=threads)
    logits = torch.randn(6, vocab).to(dtype)
    want = expected_logits(logits, sets)
    got = logits.clone()
    assert batch.fill_apply(got, threads=threads) == 6  # float16: through torch operations
    assert torch.equal(got, want)
    # the torch path on its own, as on a GPU
    other = logits.clone()
    apply_bitmask_torch(other, batch.bitmask(), list(range(6)), list(range(6)))
    assert torch.equal(other, want)


def test_rows_map_to_other_logits_rows_and_strided_logits():
    """V2 layout: logits row i masked by bitmask row (slot) j; logits as a view into a wider buffer."""
    vocab = 1000
    batch, sets = random_batch(vocab, 4, seed=7)
    storage = torch.randn(3, vocab + 24)
    logits = storage[:, :vocab]  # row stride vocab + 24
    before, tail = logits.clone(), storage[:, vocab:].clone()
    batch.fill_apply_rows(logits, [2, 0], [3, 1])
    assert torch.equal(logits[2], expected_logits(before[2:3], [sets[3]])[0])
    assert torch.equal(logits[0], expected_logits(before[0:1], [sets[1]])[0])
    assert torch.equal(logits[1], before[1])
    assert torch.equal(storage[:, vocab:], tail)  # nothing written past a row's end


def test_unconstrained_rows_are_untouched_and_cost_no_fill():
    vocab = 4096
    batch = ConstraintRows(vocab, 8)
    spec = validate_constraint({"kind": "allowed_tokens", "tokens": [3]}, vocab, 0)
    batch.set_row(5, compile_spec(spec, vocab, 0), None)
    logits = torch.randn(8, vocab)
    before = logits.clone()
    assert batch.fill_apply(logits) == 1
    assert torch.equal(logits[:5], before[:5]) and torch.equal(logits[6:], before[6:])
    assert torch.isfinite(logits[5]).nonzero().flatten().tolist() == [0, 3]
    assert not batch.bitmask()[:5].any() and not batch.bitmask()[6:].any()


def test_same_layout_as_xgrammar():
    import xgrammar as xgr  # installed with vLLM (its structured-output backend)

    vocab = 32_768 + 5
    batch, sets = random_batch(vocab, 5, seed=3)
    logits = torch.randn(5, vocab)
    ours, theirs = logits.clone(), logits.clone()
    batch.fill_apply(ours)
    xgr.apply_token_bitmask_inplace(theirs, batch.bitmask()[:5].clone(), vocab_size=vocab)
    assert torch.equal(ours, theirs)


def test_bad_logits_are_refused():
    batch, _ = random_batch(64, 2, seed=1)
    with pytest.raises(ValueError, match="logits have 100 columns"):
        batch.fill_apply(torch.zeros(2, 100))
    with pytest.raises(ValueError, match="unsupported logits dtype"):
        batch.core.apply(torch.zeros(2, 64, dtype=torch.float64).data_ptr(), 2, 64, 64, "float64", [0], [0])
    with pytest.raises(IndexError, match="logit row 5 out of range"):
        batch.core.apply(torch.zeros(2, 64).data_ptr(), 2, 64, 64, "float32", [5], [0])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_large_logits_take_the_streaming_path_and_stay_exact(dtype):
    """Above 32 MiB of logits the core writes fully masked words with non-temporal stores."""
    vocab, rows = 131_072, 128 if dtype == torch.bfloat16 else 64  # exactly 32 MiB
    batch, sets = random_batch(vocab, rows, seed=11)
    logits = torch.rand(rows, vocab, dtype=dtype)
    assert logits.numel() * logits.element_size() >= 32 << 20
    want = expected_logits(logits, sets)
    batch.fill_apply(logits)
    assert torch.equal(logits, want)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])  # float16: the torch path
def test_a_row_left_with_nothing_to_sample_gets_its_allowed_tokens_back(dtype):
    """An earlier processor set every allowed token to -inf (min_tokens masking eos when the constraint can only
    end): the constraint wins, its allowed tokens get logit 0, and the row still has something to sample."""
    vocab, eos = 1000, 0
    batch = ConstraintRows(vocab, 2, threads=1)
    for row in (0, 1):
        batch.set_row(row, compile_spec(AllowedTokensSpec(tokens=(3, 7)), vocab, eos), None)
    logits = torch.randn(2, vocab).to(dtype)
    logits[0, [eos, 3, 7]] = float("-inf")  # every allowed token already masked
    logits[1, eos] = float("-inf")  # eos masked, 3 and 7 still there: nothing to rescue
    kept = logits[1, [3, 7]].clone()
    batch.fill_apply(logits)
    assert torch.isfinite(logits[0].float()).nonzero().flatten().tolist() == [eos, 3, 7]
    assert (logits[0, [eos, 3, 7]] == 0).all()
    assert torch.isfinite(logits[1].float()).nonzero().flatten().tolist() == [3, 7]
    assert torch.equal(logits[1, [3, 7]], kept)
    if dtype != torch.float16:  # counted by the core; the torch path (other devices) does the same in torch
        assert batch.core.rescued == 1


def test_hardware_threads_is_what_a_pool_of_every_thread_gets():
    """threads=0 means every hardware thread: the core reports the machine's count (os.cpu_count, the same
    std::thread::hardware_concurrency reads), and at least 1 where that is unknown (the binding maps 0 to 1)."""
    import os

    from serving_image.constraints import _native

    count = _native.hardware_threads()
    assert isinstance(count, int) and count >= 1
    assert count == max(1, os.cpu_count() or 0)
