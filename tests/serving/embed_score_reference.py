"""Embeddings and scores of the demo model, recorded from vLLM called directly (no Triton: `VllmLocalEngine` behind
this project's OpenAI app, in one process) in tests/serving/golden/embed-score/demo-tiny.json, so that the Triton
paths can be held to them without starting a second engine: test_openai_api.py and test_openai_embedded.py check the
embedded Triton's answers against the file. Re-record (when the demo model or vLLM changes) with
`.venv-serving/bin/python -m tests.serving.embed_score_reference`.

The demo model is deterministic (fixed seed, float32), so the values only change when it does.
"""

from __future__ import annotations

import json
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


def record(model_dir: Path) -> dict:
    """Measure vLLM directly (the engine the stand-in backend's engine process runs, without Triton in front) through
    this project's OpenAI app on a local port, and write the reference."""
    import asyncio

    from serving_image.engine.vllm_local import VllmLocalEngine
    from serving_image.http_server import uvicorn_server
    from serving_image.local_server import ENGINE_ARGS, free_port
    from serving_image.openai_api.app import create_app

    async def measure_direct() -> dict:
        engine = await VllmLocalEngine.start(name=MODEL, version="reference", model_path=model_dir,
                                             tokenizer_path=model_dir, args={**ENGINE_ARGS, "enforce_eager": True},
                                             tasks=("generate", "embed", "score"))
        port = free_port()
        server = uvicorn_server(create_app(engine), "127.0.0.1", port)
        task = asyncio.create_task(server.serve())
        try:
            while not server.started:
                if task.done():
                    task.result()
                await asyncio.sleep(0.05)
            return await asyncio.to_thread(measure, f"http://127.0.0.1:{port}")
        finally:
            server.should_exit = True
            await task
            await engine.shutdown()

    measured = asyncio.run(measure_direct())
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

    REPO = Path(__file__).resolve().parents[2]
    record(ensure_demo_model(REPO / ".cache" / "llm-serving" / "models" / "demo-tiny"))
    print(f"recorded {GOLDEN}")
