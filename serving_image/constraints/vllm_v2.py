"""vLLM batch logits processor for model runner V2 (vLLM 0.31+ on GPUs), on the same native core as V1.

V2 keys per-request state by a persistent slot (`add_request(slot, params)`), keeps the committed tokens on the
device (`req_states.all_token_ids`, valid up to each request's length) and passes the step's layout to `apply`
(`ctx.idx_mapping_np`: batch position -> slot; `ctx.seq_lens_upper_bound_np`: tokens visible to the token being
sampled, exact without speculative decoding). The state stays a function of the generated tokens alone:

  - every step, each constrained row's output length is seq_len - prompt_len (<= 0 during chunked prefill: the
    start state); the tokens it has not consumed yet are read from the device in one gather (one sync per step);
  - a preempted request comes back through `add_request` (possibly another slot) and is replayed from the device;
  - a history that is shorter, or whose last consumed token changed, is fetched whole and replayed by the core.

Speculative decoding (several logits rows per request) is refused at construction, as vLLM's V1 runner does for
custom processors. The CPU build always runs model runner V1, so this class is tested with the V2 runner's request
state built from CPU tensors (tests/native/test_vllm_v2.py), not inside a running V2 engine.
"""

from __future__ import annotations

import logging
import os
from typing import TYPE_CHECKING

import numpy as np
import torch
from vllm.v1.worker.gpu.sample.logits_processor import LogitsContext, LogitsProcessor, LogitsProcRequestState

from serving_image.constraints.machines import ConstraintRows
from serving_image.constraints.metrics import ProcessorMetrics
from serving_image.constraints.vllm_v1 import (
    THREADS_ENV,
    compile_for_request,
    model_eos,
    request_constraint,
    validate_at_admission,
)

if TYPE_CHECKING:
    from vllm import SamplingParams
    from vllm.config import VllmConfig

logger = logging.getLogger(__name__)


class ConstraintLogitsProcessorV2(LogitsProcessor):
    """Masks every constrained row to the tokens its constraint allows next (model runner V2 interface)."""

    @classmethod
    def validate_params(cls, sampling_params: SamplingParams) -> None:
        validate_at_admission(sampling_params)

    def __init__(self, vllm_config: VllmConfig, req_states: LogitsProcRequestState):
        if getattr(vllm_config, "speculative_config", None):
            raise ValueError("the constraint processor does not support speculative decoding")
        self.req_states = req_states
        self.vocab_size = req_states.vocab_size
        self.default_eos = model_eos(vllm_config)
        self.constraint_rows = ConstraintRows(self.vocab_size, req_states.max_num_reqs,
                                     int(os.environ.get(THREADS_ENV, "0")))
        # Per slot: the output tokens consumed so far (the core reads this list at every sync).
        self.history: dict[int, list[int]] = {}
        self.constrained = np.zeros(req_states.max_num_reqs, dtype=bool)  # per slot, for a vectorised row filter
        # the llm_serving_constraint_* metrics (constraints/metrics.py)
        self._metrics = ProcessorMetrics(self.constraint_rows)

    def add_request(self, req_idx: int, sampling_params: SamplingParams) -> bool:
        spec = request_constraint(sampling_params)
        if spec is None:
            self.constraint_rows.clear_row(req_idx)
            self.history.pop(req_idx, None)
            self.constrained[req_idx] = False
            return False
        hist: list[int] = []
        machine = compile_for_request(spec, sampling_params, self.vocab_size, self.default_eos)
        self.constraint_rows.set_row(req_idx, machine, hist)
        self.history[req_idx] = hist  # filled from the device at the next apply (a re-added request replays)
        self.constrained[req_idx] = True
        self._metrics.added(readded=False)  # a re-added request's history is on the device: not told apart here
        return True

    def _gather(self, spans: list[tuple[int, int, int]]) -> list[list[int]]:
        """Output tokens [begin, end) of each (slot, begin, end), read from the device in one gather."""
        tokens = self.req_states.all_token_ids.gpu
        prompt = self.req_states.prompt_len.np
        width = tokens.shape[1]
        index = np.concatenate(
            [np.arange(b, e, dtype=np.int64) + slot * width + int(prompt[slot]) for slot, b, e in spans]
        )
        flat = tokens.reshape(-1)[torch.from_numpy(index).to(tokens.device)].cpu().tolist()
        out, at = [], 0
        for _, b, e in spans:
            out.append(flat[at : at + e - b])
            at += e - b
        return out

    def _catch_up(self, slots: np.ndarray, out_lens: np.ndarray) -> None:
        """Bring each slot's history to its output length: read only the new tokens plus the last consumed one (a
        changed value means a rewritten history), or the whole history when it shrank or is new."""
        spans: list[tuple[int, int, int]] = []
        for slot, n in zip(slots.tolist(), out_lens.tolist(), strict=True):
            hist = self.history[slot]
            if n <= 0:
                hist.clear()  # prefill (possibly chunked): nothing generated is visible yet
            elif not hist or len(hist) > n:
                spans.append((slot, 0, n))
            elif len(hist) < n:
                spans.append((slot, len(hist) - 1, n))
        if not spans:
            return
        refetch: list[tuple[int, int, int]] = []
        for (slot, begin, end), chunk in zip(spans, self._gather(spans), strict=True):
            hist = self.history[slot]
            if begin == 0:
                hist[:] = chunk
            elif chunk[0] == hist[-1]:
                hist.extend(chunk[1:])
            else:
                refetch.append((slot, 0, end))
        if refetch:
            for (slot, _, _), chunk in zip(refetch, self._gather(refetch), strict=True):
                self.history[slot][:] = chunk

    def apply(self, logits: torch.Tensor, ctx: LogitsContext) -> torch.Tensor:
        slots_all = ctx.idx_mapping_np
        if len(slots_all) != logits.shape[0]:
            raise ValueError("one logits row per request expected (speculative decoding is not supported)")
        mine = self.constrained[slots_all]
        if not mine.any():
            return logits
        positions = np.flatnonzero(mine)
        slots = slots_all[positions].astype(np.int64)
        out_lens = ctx.seq_lens_upper_bound_np[positions].astype(np.int64) - self.req_states.prompt_len.np[slots]
        self._catch_up(slots, out_lens)
        self.constraint_rows.sync()
        self.constraint_rows.fill_apply_rows(logits, positions.astype(np.int32).tolist(),
                                             slots.astype(np.int32).tolist())
        self._metrics.stepped(len(positions))
        return logits
