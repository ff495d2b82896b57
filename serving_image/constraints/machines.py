"""Thin Python layer over the native core: compile a validated spec, and apply the packed bitmask to a logits tensor.
Together they are the constraint engine (docs/architecture.md §2.3), which runs inside a vLLM engine.

The core (`serving_image.constraints._native`, C++ built by the package build) owns the per-row states, the bitmask
(int32 words, one row per batch row, bit t%32 of word t//32, 1 = allowed: xgrammar's layout) and a thread pool.
On the CPU the bitmask is applied in place by the core (float32, bfloat16) with the GIL released. On a CUDA
device by the fused kernel (`gpu.py`, native/src/mask_kernel.cu: one asynchronous copy from pinned memory, one
kernel); where the kernel is unavailable, and on any other device, through torch operations (`apply_bitmask_torch`),
which the log reports for CUDA (`gpu.applier_for`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from serving_image.constraints import _native, gpu
from serving_image.constraints.spec import (
    MAX_TOKEN_IDS,
    AllowedTokensSpec,
    ChoiceSequenceSpec,
    ConstraintSpec,
    TokenDfaSpec,
    plain_bitmask,
)

if TYPE_CHECKING:
    import torch

_INT32_MAX = 2**31 - 1


def compile_spec(spec: ConstraintSpec, vocab_size: int, eos_token_id: int) -> _native.Machine:
    """Compile a validated spec (see `validate_constraint`) for a model's vocabulary."""
    if isinstance(spec, TokenDfaSpec):
        flat = [x for edge in spec.edges for x in edge]
        return _native.compile_token_dfa(vocab_size, eos_token_id, spec.start, list(spec.accept), flat)
    if isinstance(spec, ChoiceSequenceSpec):
        max_items = -1 if spec.max_items is None else min(spec.max_items, _INT32_MAX)
        return _native.compile_choice_sequence(
            vocab_size,
            eos_token_id,
            [list(c) for c in spec.choices],
            list(spec.separator),
            min(spec.min_items, _INT32_MAX),
            max_items,
            spec.unique,
        )
    if isinstance(spec, AllowedTokensSpec):
        return _native.compile_allowed_tokens(vocab_size, eos_token_id, spec.tokens)  # the tuple, read in one C pass
    raise TypeError(f"not a constraint spec: {spec!r}")


def compile_plain_text(text: str, vocab_size: int, eos_token_id: int) -> _native.Machine | None:
    """The machine of a spec given as its JSON text in a plain form (`spec.checked_plain_text`: allowed_tokens or
    token_dfa), read, checked and compiled in one native pass: what validating and compiling its parsed value gives,
    without a Python value per token id or edge on the engine's path (8k allowed ids: 0.08 ms, where parsing first
    cost 0.46; 256 edges: 0.02 ms against 0.34). None for any other text (a choice_sequence, another form, a bad
    spec), which the caller parses and validates for the exact error."""
    raw = text.encode()
    machine = _native.compile_allowed_tokens_json(vocab_size, eos_token_id, raw, MAX_TOKEN_IDS)
    if machine is None:
        machine = _native.compile_token_dfa_json(vocab_size, eos_token_id, raw, MAX_TOKEN_IDS)
    if machine is None:
        packed = plain_bitmask(raw)  # the packed allowed_tokens the front-ends hand on (spec.checked_plain_text)
        if packed is not None:
            machine = _native.compile_allowed_packed(vocab_size, eos_token_id, packed)
    return machine


def _cpu_dtype_name(logits: torch.Tensor) -> str | None:
    import torch

    if logits.device.type != "cpu" or logits.dim() != 2 or logits.stride(1) != 1:
        return None
    return {torch.float32: "float32", torch.bfloat16: "bfloat16"}.get(logits.dtype)


def apply_bitmask_torch(logits: torch.Tensor, bitmask: torch.Tensor, logit_rows, mask_rows):
    """Any device, any float dtype: unpack the rows' bits and set the masked logits to -inf (torch operations)."""
    import torch

    if len(logit_rows) == 0:
        return
    vocab = logits.shape[1]
    words = bitmask[mask_rows].to(logits.device, non_blocking=True)  # [n, words] int32
    shifts = torch.arange(32, device=logits.device, dtype=torch.int32)
    allowed = ((words.unsqueeze(-1) >> shifts) & 1).bool().reshape(len(mask_rows), -1)[:, :vocab]
    index = torch.tensor(logit_rows, device=logits.device, dtype=torch.long)
    rows = logits.index_select(0, index)
    rows.masked_fill_(~allowed, float("-inf"))
    # As the core does: a row left with nothing to sample (another processor had masked every allowed token) gets
    # its allowed tokens back at logit 0; the constraint wins.
    dead = torch.isneginf(rows).all(dim=1, keepdim=True)
    rows.masked_fill_(dead & allowed, 0.0)
    logits.index_copy_(0, index, rows)


class ConstraintRows:
    """Per-row constraint states of vLLM's batch, `capacity` rows over a vocabulary of `vocab_size` tokens.

    `threads` is the size of the core's pool (0: every hardware thread). Rows are vLLM's batch indices; a row without a
    constraint costs nothing in `sync`, `fill` and `apply`.
    """

    def __init__(self, vocab_size: int, capacity: int, threads: int = 0):
        self.core = _native.Engine(vocab_size, max(1, capacity), threads)
        self.vocab_size = vocab_size
        self.kernel_steps = 0  # steps masked by the GPU kernel
        self.torch_steps = 0  # steps masked by torch operations (a non-CPU device without the kernel)

    # ----- rows
    def ensure_capacity(self, rows: int) -> None:
        if rows > self.core.capacity:
            self.core.ensure_capacity(max(rows, 2 * self.core.capacity))

    def set_row(self, row: int, machine: _native.Machine, tokens: list[int] | None) -> None:
        """Constrain `row`; `tokens` is the request's output list (read again at every `sync`, may grow in place)."""
        self.ensure_capacity(row + 1)
        self.core.set_row(row, machine, tokens)

    def clear_row(self, row: int) -> None:
        if row < self.core.capacity:
            self.core.clear_row(row)

    def move_row(self, src: int, dst: int) -> None:
        self.ensure_capacity(max(src, dst) + 1)
        self.core.move_row(src, dst)

    def swap_rows(self, a: int, b: int) -> None:
        self.ensure_capacity(max(a, b) + 1)
        self.core.swap_rows(a, b)

    def sync(self) -> int:
        """Advance every constrained row by its new tokens; returns how many rows were rebuilt by replay."""
        return self.core.sync()

    def num_constrained(self) -> int:
        return self.core.num_constrained()

    # ----- masks
    def bitmask(self):
        """The bitmask as a torch tensor sharing the core's memory ([capacity, words] int32)."""
        import torch

        return torch.from_numpy(self.core.bitmask())

    def fill_apply(self, logits: torch.Tensor, threads: int = 0) -> int:
        """Fill the constrained rows below logits.shape[0] and mask the same logits rows; returns the row count."""
        if logits.shape[1] > self.core.words * 32:
            raise ValueError(f"logits have {logits.shape[1]} columns, the engine's vocabulary is {self.vocab_size}")
        name = _cpu_dtype_name(logits)
        if name is not None:
            return self.core.fill_apply(logits.data_ptr(), logits.shape[0], logits.shape[1], logits.stride(0), name,
                                        threads)
        rows = self.core.fill_constrained(logits.shape[0], threads)  # int32 array, straight to the device apply
        if len(rows):
            self._apply_device(logits, rows, rows)
        return len(rows)

    def fill_apply_rows(self, logits: torch.Tensor, logit_rows: list[int], mask_rows: list[int],
                        threads: int = 0) -> None:
        """Fill the bitmask rows `mask_rows` and mask logits row logit_rows[i] by bitmask row mask_rows[i]."""
        if not mask_rows:
            return
        self.core.fill(sorted(set(mask_rows)), threads)
        name = _cpu_dtype_name(logits)
        if name is not None:
            self.core.apply(logits.data_ptr(), logits.shape[0], logits.shape[1], logits.stride(0), name,
                            logit_rows, mask_rows, threads)
        else:
            self._apply_device(logits, logit_rows, mask_rows)

    def _apply_device(self, logits: torch.Tensor, logit_rows, mask_rows) -> None:
        """Logits off the CPU: the GPU kernel on CUDA when it is available, else torch operations."""
        if logits.device.type == "cuda" and gpu.kernel_accepts(logits):
            applier = gpu.applier_for(logits.device)  # None: unavailable, and the log says so (once)
            if applier is not None:
                applier.apply(logits, self.core.bitmask(), logit_rows, mask_rows)
                self.kernel_steps += 1
                return
        self.torch_steps += 1
        apply_bitmask_torch(logits, self.bitmask(), logit_rows, mask_rows)
