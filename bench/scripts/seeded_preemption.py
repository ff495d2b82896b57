"""Seeded requests under forced preemption and chunked prefill, on the real CPU engine (run as a script: vLLM
spawns its engine processes, so it needs a __main__ guard). Writes what happened as JSON to the file named by its
second argument (not to stdout, where the engine processes' logs interleave with it)."""

from __future__ import annotations

import json
import random
import sys

if __name__ == "__main__":
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    model_dir = sys.argv[1]
    # The settings of docs/local-environment.md, "vLLM on CPU" that force preemption and chunked prefill on the tiny
    # model.
    llm = LLM(model=model_dir, max_model_len=256, kv_cache_memory_bytes=600_000, max_num_batched_tokens=64,
              dtype="float32", disable_log_stats=False, enforce_eager=True)
    rng = random.Random(0)
    vocab = llm.get_tokenizer().vocab_size
    prompts = [TokensPrompt(prompt_token_ids=[rng.randrange(3, vocab) for _ in range(rng.randint(40, 70))])
               for _ in range(48)]
    params = [SamplingParams(max_tokens=80, ignore_eos=True, temperature=1.0, seed=1000 + i) for i in range(48)]
    result = {"completed": 0, "error": None, "preemptions": 0}
    try:
        outputs = llm.generate(prompts, params, use_tqdm=False)
        result["completed"] = sum(len(o.outputs[0].token_ids) == 80 for o in outputs)
    except Exception as exc:  # the point of the script: report whether the engine died
        result["error"] = f"{type(exc).__name__}: {exc}"
    try:
        for metric in llm.get_metrics():
            if metric.name == "vllm:num_preemptions":
                result["preemptions"] = int(metric.value)
    except Exception as exc:  # a dead engine has no metrics to give
        result["metrics_error"] = repr(exc)
    with open(sys.argv[2], "w") as out:
        json.dump(result, out)
