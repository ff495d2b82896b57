"""vLLM batch logits processor (V1 interface: the CPU build and GPU runs with VLLM_USE_V2_MODEL_RUNNER=0).

vLLM loads it through `serving_image.constraints.vllm_processor:ConstraintLogitsProcessor` (the
`vllm.logits_processors` entry point, one class for both runners), or by import path
(`serving_image.constraints.vllm_v1:ConstraintLogitsProcessorV1`). A request is constrained by
`SamplingParams.extra_args["constraint"]` (docs/architecture.md §3.5).

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

import functools
import logging
import os
from collections import OrderedDict
from typing import TYPE_CHECKING

import torch
from vllm.v1.sample.logits_processor import BatchUpdate, LogitsProcessor, MoveDirectionality

from serving_image.constraints.machines import ConstraintRows, compile_plain_text, compile_spec
from serving_image.constraints.metrics import ProcessorMetrics
from serving_image.constraints.spec import (
    AllowedTokensSpec,
    ConstraintError,
    checked_plain_text,
    take_checked,
    validate_constraint,
)
from serving_image.json_text import loads

if TYPE_CHECKING:
    from vllm import SamplingParams
    from vllm.config import VllmConfig

logger = logging.getLogger(__name__)

CONSTRAINT_KEY = "constraint"
# Threads of the core's pool; 0 = every hardware thread. The engine's own intra-op threads are idle while
# the processor runs (it sits between the forward pass and the sampler), so sharing the cores is fine.
THREADS_ENV = "LLM_SERVING_CONSTRAINT_THREADS"


def constraint_of(params: SamplingParams, *, strict: bool = False) -> object | None:
    """The request's spec: extra_args["constraint"], an object or its JSON text. The text form costs vLLM almost
    nothing per request (it deep-copies and msgpack-encodes SamplingParams on the way to the engine core: about
    4 ms for an allowed_tokens list of 8k ids as an object, 0.04 ms as text; bench/constraints_e2e.py measures it).
    Text that is not JSON raises ConstraintError when `strict` (admission); in the worker it is returned as is, and
    the compilation ends that request (`compile_for_request`) instead of the engine."""
    extra = params.extra_args
    spec = None if not extra else extra.get(CONSTRAINT_KEY)
    if isinstance(spec, str):
        try:
            return _parse_spec_text(spec)
        except ValueError as exc:
            if strict:
                raise ConstraintError(CONSTRAINT_KEY, f"is a string but not JSON: {exc}") from exc
    return spec


def request_constraint(params: SamplingParams) -> object | None:
    """The request's extra_args["constraint"] as given (its JSON text, or an object), unparsed: for the worker, which
    compiles a plain-form text straight from it (`compile_for_request`)."""
    extra = params.extra_args
    return None if not extra else extra.get(CONSTRAINT_KEY)


def validate_at_admission(sampling_params: SamplingParams) -> None:
    """Both processors' validate_params. Runs at admission in the front-end process, before vLLM knows the
    vocabulary or eos for this request: everything else is checked here, the ranges again in the worker (the
    platform's front-ends check them too, with the served model's vocabulary, before a request reaches vLLM). A
    text the stand-in backend's stub checked with the served vocabulary (spec.remember_checked) is not checked again;
    a text in its plain form (`checked_plain_text`: a client calling AsyncLLM itself) is checked in one native pass."""
    extra = sampling_params.extra_args
    raw = extra.get(CONSTRAINT_KEY) if extra else None
    if raw is None or take_checked(raw):
        return
    if isinstance(raw, str) and checked_plain_text(raw.encode(), None, None) is not None:
        return
    spec = constraint_of(sampling_params, strict=True)
    if spec is not None:
        validate_constraint(spec, vocab_size=None, eos_token_id=None)


@functools.lru_cache(maxsize=256)
def _parse_spec_text(text: str) -> object:
    # Cached: admission and the worker parse the same text, and a preempted request is added again. The parsed
    # object is only read (validate_constraint builds a new typed spec). msgspec first (json_text.py).
    return loads(text)


def model_eos(vllm_config: VllmConfig) -> int | None:
    eos = getattr(vllm_config.model_config.hf_config, "eos_token_id", None)
    if isinstance(eos, list | tuple):
        eos = eos[0] if eos else None
    return eos


def compile_for_request(spec: object, params: SamplingParams, vocab_size: int, default_eos: int | None):
    """Validate a request's spec (its value, or its JSON text as `request_constraint` gives it) against the served
    vocabulary and compile it, in the worker. An allowed_tokens (listed or packed) or token_dfa text in its plain form
    compiles in one native pass (`compile_plain_text`; 8k ids: 0.08 ms, where parsing it first cost 0.46 ms on the
    engine's path); any other text is parsed first."""
    eos = params.eos_token_id if params.eos_token_id is not None else default_eos
    try:
        if eos is None:
            raise ConstraintError("constraint", "the model has no end-of-sequence token to end the output with")
        if isinstance(spec, str):
            machine = compile_plain_text(spec, vocab_size, eos)
            if machine is not None:
                return machine
            try:
                spec = _parse_spec_text(spec)
            except ValueError:
                pass  # not JSON: validate_constraint names it
        return compile_spec(validate_constraint(spec, vocab_size, eos), vocab_size, eos)
    except ConstraintError as exc:
        # Only reachable when a caller skipped the front-ends' validation (which knows the vocabulary): raising
        # here would kill the engine for every request in flight, so this request ends at once (only eos).
        logger.error("constraint rejected in the worker, the request ends now: %s", exc)
        fallback = eos if eos is not None else 0
        return compile_spec(AllowedTokensSpec(tokens=(fallback,)), vocab_size, fallback)


class ConstraintLogitsProcessorV1(LogitsProcessor):
    """Masks every constrained row of vLLM's batch to the tokens its constraint allows next."""

    @classmethod
    def validate_params(cls, sampling_params: SamplingParams) -> None:
        validate_at_admission(sampling_params)

    def __init__(self, vllm_config: VllmConfig, device: torch.device, is_pin_memory: bool):
        self.vocab_size = vllm_config.model_config.get_vocab_size()
        self.default_eos = model_eos(vllm_config)
        capacity = vllm_config.scheduler_config.max_num_seqs
        self.constraint_rows = ConstraintRows(self.vocab_size, capacity, int(os.environ.get(THREADS_ENV, "0")))
        self.device = device
        # Counted here and exported as the llm_serving_constraint_* metrics (constraints/metrics.py); the rows'
        # core counts stalls, rebuilds and rescued rows, and the rows count the steps masked on a device.
        self._metrics = ProcessorMetrics(self.constraint_rows)
        self.readded = 0  # rows added with a non-empty output list (preempted requests coming back)
        self.constrained_added = 0
        self.steps = 0
        self.max_rows = 0  # most constrained rows masked in one step
        # Compiled machines by request (SamplingParams object): a preempted request re-added later is not compiled
        # again. The entry holds the params object, so its id cannot be reused while cached.
        self._machines: OrderedDict[int, tuple[SamplingParams, object]] = OrderedDict()
        self._cache_size = 4 * capacity

    def is_argmax_invariant(self) -> bool:
        return False  # it masks tokens, greedy decoding included

    def _machine(self, params: SamplingParams, spec: object):
        hit = self._machines.get(id(params))
        if hit is not None and hit[0] is params:
            self._machines.move_to_end(id(params))
            return hit[1]
        machine = compile_for_request(spec, params, self.vocab_size, self.default_eos)
        self._machines[id(params)] = (params, machine)
        if len(self._machines) > self._cache_size:
            self._machines.popitem(last=False)
        return machine

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        if batch_update is not None:
            for index in batch_update.removed:
                self.constraint_rows.clear_row(index)
            for index, params, _prompt, output_ids in batch_update.added:
                spec = request_constraint(params) if params is not None else None
                if spec is None:
                    self.constraint_rows.clear_row(index)  # the index may still hold a previous request's state
                    continue
                self.constraint_rows.set_row(index, self._machine(params, spec), output_ids)
                self.constrained_added += 1
                if output_ids:
                    self.readded += 1
                self._metrics.added(readded=bool(output_ids))
            for src, dst, direction in batch_update.moved:
                if direction == MoveDirectionality.SWAP:
                    self.constraint_rows.swap_rows(src, dst)
                else:
                    self.constraint_rows.move_row(src, dst)
        self.constraint_rows.sync()

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        if self.constraint_rows.num_constrained() == 0:
            return logits
        rows = self.constraint_rows.fill_apply(logits)
        self.steps += 1
        self.max_rows = max(self.max_rows, rows)
        self._metrics.stepped(rows)
        return logits
