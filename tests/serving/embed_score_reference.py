"""Embeddings and scores of the demo model, recorded from vLLM's own offline API (`vllm.LLM`: no Triton, no engine
adapter or OpenAI app of this project) in tests/serving/golden/embed-score/demo-tiny.json, so that the served paths
are held to vLLM, not to themselves, without starting another engine: test_openai_api.py and
test_openai_embedded.py check the embedded Triton's answers against the file. Re-record (when the demo model or vLLM
changes) with `.venv-serving/bin/python -m tests.serving.embed_score_reference`.

- Embeddings: `LLM(..., runner="pooling", convert="embed").embed(...)`, strings as given (vLLM's tokenizer with its
  special tokens) and token-id lists as `{"prompt_token_ids": ...}`.
- Scores: vLLM's `LLM.score` is a cross-encoder/embedding similarity, another quantity; the platform's score is the
  prefill's log-probability of each candidate's tokens after the prompt (docs/openai-fields.md, `/v1/score`), so it is
  recorded with `LLM.generate` and `prompt_logprobs=0` over the prompt's tokens (with special tokens) followed by the
  candidate's (without), summing the candidate positions' log-probabilities of the actual tokens.

The demo model is deterministic (fixed seed, float32), so the values only change when it or vLLM does.
"""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest

from llm_serving.repository import REPO_ROOT

GOLDEN = Path(__file__).parent / "golden" / "embed-score" / "demo-tiny.json"
MODEL = "demo-tiny"
# One request per OpenAI input shape (a list of strings; a list of token ids): the API takes no list that mixes them.
EMBED_REQUESTS: list[list] = [["the platform", "a lazy dog jumps over the quick brown fox"], [[5, 17, 42, 99]]]
EMBED_INPUTS: list = [item for request in EMBED_REQUESTS for item in request]
SCORE_CASES = [("The quick brown", [" the", " fox jumps", " zq zq zq"]), ("Hello", ["!", " world"])]
# Same engine code and weights behind both paths; what may differ is the order of floating-point sums when
# requests are batched differently.
VECTOR_ABS = 1e-4
LOGPROB_ABS = 2e-3


def measure(url: str, headers: dict | None = None) -> dict:
    """Embeddings (one request per input shape) and scores (one request per case) from an OpenAI-mode server."""
    embeddings, prompt_tokens = [], 0
    for inputs in EMBED_REQUESTS:
        response = httpx.post(f"{url}/v1/embeddings", json={"model": MODEL, "input": inputs}, headers=headers,
                              timeout=120)
        assert response.status_code == 200, response.text
        body = response.json()
        embeddings += [{"input": item, "vector": data["embedding"]} for item, data in zip(inputs, body["data"],
                                                                                            strict=True)]
        prompt_tokens += body["usage"]["prompt_tokens"]
    scores = []
    for prompt, candidates in SCORE_CASES:
        response = httpx.post(f"{url}/v1/score", json={"model": MODEL, "prompt": prompt, "candidates": candidates},
                              headers=headers, timeout=120)
        assert response.status_code == 200, response.text
        data = response.json()["data"]
        scores.append({"prompt": prompt, "candidates": candidates, "logprob": [d["logprob"] for d in data],
                       "tokens": [d["tokens"] for d in data]})
    return {"embeddings": embeddings, "prompt_tokens": prompt_tokens, "scores": scores}


def record(model_dir: Path) -> dict:
    """Measure with vLLM's offline API (module docstring) and write the reference."""
    import gc

    from vllm import LLM, SamplingParams

    from bench.local_server import ENGINE_ARGS

    args = {**ENGINE_ARGS, "enforce_eager": True}
    pooling = LLM(model=str(model_dir), runner="pooling", convert="embed", **args)
    embeddings, prompt_tokens = [], 0
    for inputs in EMBED_REQUESTS:
        prompts = [{"prompt_token_ids": item} if isinstance(item, list) else item for item in inputs]
        for item, output in zip(inputs, pooling.embed(prompts, use_tqdm=False), strict=True):
            embeddings.append({"input": item, "vector": [float(x) for x in output.outputs.embedding]})
            prompt_tokens += len(output.prompt_token_ids)
    del pooling
    gc.collect()
    llm = LLM(model=str(model_dir), **args)
    tokenizer = llm.get_tokenizer()
    params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0)
    scores = []
    for prompt, candidates in SCORE_CASES:
        prompt_ids = tokenizer.encode(prompt, add_special_tokens=True)
        logprobs, tokens = [], []
        for candidate in candidates:
            ids = tokenizer.encode(candidate, add_special_tokens=False)
            (output,) = llm.generate([{"prompt_token_ids": prompt_ids + ids}], params, use_tqdm=False)
            positions = output.prompt_logprobs[len(prompt_ids):]
            logprobs.append(float(sum(entry[token].logprob for entry, token in zip(positions, ids, strict=True))))
            tokens.append(len(ids))
        scores.append({"prompt": prompt, "candidates": candidates, "logprob": logprobs, "tokens": tokens})
    measured = {"embeddings": embeddings, "prompt_tokens": prompt_tokens, "scores": scores,
                "recorded_with": "vllm.LLM (tests/serving/embed_score_reference.py)"}
    GOLDEN.parent.mkdir(parents=True, exist_ok=True)
    GOLDEN.write_text(json.dumps(measured, indent=1) + "\n")
    return measured


def check(measured: dict) -> None:
    assert GOLDEN.is_file(), f"{GOLDEN} is missing: record it with python -m tests.serving.embed_score_reference"
    expected = json.loads(GOLDEN.read_text())
    assert measured["prompt_tokens"] == expected["prompt_tokens"]
    for got, want in zip(measured["embeddings"], expected["embeddings"], strict=True):
        assert got["input"] == want["input"] and len(got["vector"]) == len(want["vector"])
        assert got["vector"] == pytest.approx(want["vector"], abs=VECTOR_ABS), got["input"]
    for got, want in zip(measured["scores"], expected["scores"], strict=True):
        assert (got["prompt"], got["candidates"], got["tokens"]) == (want["prompt"], want["candidates"],
                                                                      want["tokens"])
        assert got["logprob"] == pytest.approx(want["logprob"], abs=LOGPROB_ABS), got["prompt"]


if __name__ == "__main__":
    from serving_image.demo_model import ensure_demo_model

    record(ensure_demo_model(REPO_ROOT / ".cache" / "llm-serving" / "models" / "demo-tiny"))
    print(f"recorded {GOLDEN}")
