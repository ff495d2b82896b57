"""Embeddings and scores of the demo model, recorded from the vLLM-direct engine (the `openai` mode's engine in the
process) in tests/serving/golden/embed-score/demo-tiny.json, so that every path can be held to them without starting
an engine of its own: test_openai_api.py checks the vLLM-direct server against the file (and rewrites it with
LLM_SERVING_UPDATE_GOLDEN=1 when it runs on vLLM directly), test_openai_embedded.py checks the embedded Triton.

The demo model is deterministic (fixed seed, float32), so the values only change when it does.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import httpx
import pytest

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


def record(measured: dict) -> None:
    """Write the reference (only when asked, from the vLLM-direct engine)."""
    GOLDEN.parent.mkdir(parents=True, exist_ok=True)
    GOLDEN.write_text(json.dumps(measured, indent=1) + "\n")


def should_record() -> bool:
    return os.environ.get("LLM_SERVING_UPDATE_GOLDEN") == "1"


def check(measured: dict) -> None:
    assert GOLDEN.is_file(), f"{GOLDEN} is missing: record it with LLM_SERVING_UPDATE_GOLDEN=1 (test_openai_api.py)"
    expected = json.loads(GOLDEN.read_text())
    assert measured["prompt_tokens"] == expected["prompt_tokens"]
    for got, want in zip(measured["embeddings"], expected["embeddings"], strict=True):
        assert got["input"] == want["input"] and len(got["vector"]) == len(want["vector"])
        assert got["vector"] == pytest.approx(want["vector"], abs=VECTOR_ABS), got["input"]
    for got, want in zip(measured["scores"], expected["scores"], strict=True):
        assert (got["prompt"], got["candidates"], got["tokens"]) == (want["prompt"], want["candidates"],
                                                                      want["tokens"])
        assert got["logprob"] == pytest.approx(want["logprob"], abs=LOGPROB_ABS), got["prompt"]
