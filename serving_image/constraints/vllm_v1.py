"""vLLM batch logits processor (V1 interface: the CPU build and GPU runs with VLLM_USE_V2_MODEL_RUNNER=0).

Loaded by vLLM from the `vllm.logits_processors` entry point, or by import path
(`serving_image.constraints.vllm_v1:ConstraintLogitsProcessor`). A request is constrained by
`SamplingParams.extra_args["constraint"]` (ARCHITECTURE §3.5).

The state of a row is a function of the request's output token list alone (vLLM's own list, which grows in
place), never of how many times `apply` ran:
  - chunked prefill: vLLM samples a token for a partially prefilled row and throws it away; it never reaches the
    output list, so the row does not advance;
  - preemption: a preempted request is removed and later added again (another index, an output list that may be
    a new object or shorter); adding always replays the list it is given;
  - a list that shrank or changed under a row between steps is detected by the core and replayed;
  - async scheduling: -1 placeholders are not tokens; consumption waits until vLLM fills them in.
"""

from __future__ import annotations

import logging
import os
from typing import TYPE_CHECKING

import torch
from vllm.v1.sample.logits_processor import BatchUpdate, LogitsProcessor, MoveDirectionality

from serving_image.constraints.engine import ConstraintBatch, compile_spec
from serving_image.constraints.spec import ConstraintError, validate_constraint

if TYPE_CHECKING:
    from vllm import SamplingParams
    from vllm.config import VllmConfig

logger = logging.getLogger(__name__)

CONSTRAINT_KEY = "constraint"
# Threads of the core's pool; 0 = every hardware thread. The engine's own intra-op threads are idle while
# the processor runs (it sits between the forward pass and the sampler), so sharing the cores is fine.
THREADS_ENV = "LLM_SERVING_CONSTRAINT_THREADS"


def constraint_of(params: SamplingParams) -> object | None:
    extra = params.extra_args
    return None if not extra else extra.get(CONSTRAINT_KEY)


def model_eos(vllm_config: VllmConfig) -> int | None:
    eos = getattr(vllm_config.model_config.hf_config, "eos_token_id", None)
    if isinstance(eos, list | tuple):
        eos = eos[0] if eos else None
    return eos


class ConstraintLogitsProcessor(LogitsProcessor):
    """Masks every constrained row of the batch to the tokens its constraint allows next."""

    @classmethod
    def validate_params(cls, sampling_params: SamplingParams) -> None:
        # Runs at admission in the front-end process, before vLLM knows the vocabulary or eos for this request:
        # everything else is checked here, the ranges again in the worker (the platform's front-ends check them
        # too, with the served model's vocabulary, before a request reaches vLLM).
        spec = constraint_of(sampling_params)
        if spec is not None:
            validate_constraint(spec, vocab_size=None, eos_token_id=None)

    def __init__(self, vllm_config: VllmConfig, device: torch.device, is_pin_memory: bool):
        self.vocab_size = vllm_config.model_config.get_vocab_size()
        self.default_eos = model_eos(vllm_config)
        capacity = vllm_config.scheduler_config.max_num_seqs
        self.batch = ConstraintBatch(self.vocab_size, capacity, int(os.environ.get(THREADS_ENV, "0")))
        self.device = device
        self.rebuilt = 0  # rows replayed because their history shrank or changed (observability, tests)
        self.readded = 0  # rows added with a non-empty output list (preempted requests coming back)

    def is_argmax_invariant(self) -> bool:
        return False  # it masks tokens, greedy decoding included

    def _machine(self, params: SamplingParams, spec: object):
        eos = params.eos_token_id if params.eos_token_id is not None else self.default_eos
        try:
            if eos is None:
                raise ConstraintError("constraint", "the model has no end-of-sequence token to end the output with")
            return compile_spec(validate_constraint(spec, self.vocab_size, eos), self.vocab_size, eos)
        except ConstraintError as exc:
            # Only reachable when a caller skipped the front-ends' validation (which knows the vocabulary): raising
            # here would kill the engine for every request, so the request ends at once with only eos allowed.
            logger.error("constraint rejected in the worker, the request ends now: %s", exc)
            fallback = eos if eos is not None else 0
            return compile_spec(validate_constraint({"kind": "allowed_tokens", "tokens": [fallback]}, None, None),
                                self.vocab_size, fallback)

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        if batch_update is not None:
            for index in batch_update.removed:
                self.batch.clear_row(index)
            for index, params, _prompt, output_ids in batch_update.added:
                spec = constraint_of(params) if params is not None else None
                if spec is None:
                    self.batch.clear_row(index)  # the index may still hold a previous request's state
                    continue
                self.batch.set_row(index, self._machine(params, spec), output_ids)
                if output_ids:
                    self.readded += 1
            for src, dst, direction in batch_update.moved:
                if direction == MoveDirectionality.SWAP:
                    self.batch.swap_rows(src, dst)
                else:
                    self.batch.move_row(src, dst)
        self.rebuilt += self.batch.sync()

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        if self.batch.num_constrained() == 0:
            return logits
        self.batch.fill_apply(logits)
        return logits
