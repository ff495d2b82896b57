"""Every model kind through one endpoint, with NVIDIA's tritonclient (docs/kserve.md, "Every model kind through one
call").

Against what `make up` serves (KServe gRPC on localhost:8001, HTTP on localhost:8000): the XGBoost ranker with a
unary `ModelInfer` over a batch of feature rows (gRPC and HTTP), the ranker pipeline (a Triton ensemble) called as one
model, and the demo LLM streamed with `ModelStreamInfer`. The same calls work against a pod's Gateway hostnames.

    .venv-serving/bin/python examples/kserve_client.py [--grpc localhost:8001] [--http localhost:8000]
"""

from __future__ import annotations

import argparse
import json
import queue

import numpy as np
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient

from llm_serving.kserve_stream import until_final

RANKER = "ranker"
PIPELINE = "ranker-pipeline"
LLM = "demo-tiny"
N_FEATURES = 8


def feature_rows(count: int) -> np.ndarray:
    """A fixed batch of feature rows (the ranker's input: FP32 [batch, 8])."""
    return (np.arange(count * N_FEATURES, dtype=np.float32).reshape(count, N_FEATURES) % 7) / 7


def rank(grpc: grpcclient.InferenceServerClient, rows: np.ndarray) -> np.ndarray:
    features = grpcclient.InferInput("features", list(rows.shape), "FP32")
    features.set_data_from_numpy(rows)
    return grpc.infer(RANKER, [features]).as_numpy("score")


def rank_http(http: httpclient.InferenceServerClient, rows: np.ndarray) -> np.ndarray:
    features = httpclient.InferInput("features", list(rows.shape), "FP32")
    features.set_data_from_numpy(rows)
    return http.infer(RANKER, [features]).as_numpy("score")


def pipeline(grpc: grpcclient.InferenceServerClient, rows: np.ndarray) -> dict[str, np.ndarray]:
    raw = grpcclient.InferInput("raw", list(rows.shape), "FP32")
    raw.set_data_from_numpy(rows)
    result = grpc.infer(PIPELINE, [raw])
    return {name: result.as_numpy(name) for name in ("score", "relevance", "relevant")}


def generate(grpc: grpcclient.InferenceServerClient, prompt: str, max_tokens: int, **sampling) -> tuple[str, int]:
    """Stream the LLM's answer; returns its text and token count. `sampling`: any other of vLLM's sampling
    parameters (temperature=0, ignore_eos=True, ...), sent in `sampling_parameters` beside max_tokens."""
    parameters = json.dumps({"max_tokens": max_tokens, **sampling}).encode()
    inputs = []
    for name, value, datatype in (("text_input", prompt.encode(), "BYTES"), ("stream", True, "BOOL"),
                                  ("sampling_parameters", parameters, "BYTES"),
                                  ("return_num_output_tokens", True, "BOOL")):
        tensor = grpcclient.InferInput(name, [1], datatype)
        tensor.set_data_from_numpy(np.array([value], dtype=np.object_ if datatype == "BYTES" else np.bool_))
        inputs.append(tensor)
    responses: queue.Queue = queue.Queue()
    grpc.start_stream(callback=lambda result, error: responses.put((result, error)))
    try:
        grpc.async_stream_infer(LLM, inputs, enable_empty_final_response=True)
        text, tokens = "", 0
        for result, error in until_final(responses, timeout=300):  # up to the response flagged final
            if error is not None:
                raise error
            if result.get_response().outputs:
                text += b"".join(result.as_numpy("text_output")).decode()
                tokens += int(result.as_numpy("num_output_tokens").sum())
        return text, tokens
    finally:
        grpc.stop_stream()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--grpc", default="localhost:8001")
    parser.add_argument("--http", default="localhost:8000")
    args = parser.parse_args(argv)
    grpc = grpcclient.InferenceServerClient(args.grpc)
    http = httpclient.InferenceServerClient(args.http)
    try:
        ready = {m["name"]: m.get("state") for m in grpc.get_model_repository_index(as_json=True)["models"]}
        print("models:", ", ".join(f"{name} {state}" for name, state in sorted(ready.items())))
        rows = feature_rows(4)
        print("ranker (gRPC):", rank(grpc, rows).reshape(-1).round(4).tolist())
        print("ranker (HTTP):", rank_http(http, rows).reshape(-1).round(4).tolist())
        outputs = pipeline(grpc, rows)
        print("pipeline:", {name: value.reshape(-1).tolist() for name, value in outputs.items()})
        text, tokens = generate(grpc, "Say hello", 8)
        print(f"{LLM} ({tokens} tokens, streamed): {text!r}")
    finally:
        grpc.close()
        http.close()


if __name__ == "__main__":
    main()
