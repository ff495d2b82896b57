"""The KServe gRPC front-end's cost: the same requests through tritonclient's ModelStreamInfer against the same vLLM
engine called directly, one after the other in one run (issue #6).

One engine (the demo model); 128 requests of 64 greedy output tokens (ignore_eos, so every request makes the same
work), 32 prompt tokens, 16 at a time. Baseline: `engine.generate` in the same process. Subject: NVIDIA's asyncio
tritonclient streaming every token over gRPC to the local KServe server on that engine. Reported as ratios
(KServe / direct); no target is asserted anywhere, the numbers are for the report.
"""

from __future__ import annotations

import asyncio
import json
import pathlib
import socket
import statistics
import time

from bench.report import demo_model, main, percentile, ratio_plot, ratio_table, ratios, result

N_REQUESTS = 128
CONCURRENCY = 16
OUTPUT_TOKENS = 64
PROMPT = "The platform serves large language models next to the rest of the models " * 2
# float32: this machine's VM dies with SIGILL in vLLM's bf16 AMX attention kernel (tests/serving/test_kserve_server.py)
ENGINE_ARGS = {"max_model_len": 512, "kv_cache_memory_bytes": 256 * 1024 * 1024, "dtype": "float32"}


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _summary(ttfts: list[float], elapsed: float, tokens: int) -> dict:
    return {"requests_per_s": len(ttfts) / elapsed, "output_tokens_per_s": tokens / elapsed,
            "median_ttft_ms": statistics.median(ttfts) * 1000, "p99_ttft_ms": percentile(ttfts, 0.99) * 1000}


async def _direct(engine) -> dict:
    from serving_image.engine.base import EngineRequest, SamplingSpec

    spec = SamplingSpec(max_tokens=OUTPUT_TOKENS, temperature=0.0, ignore_eos=True)
    gate = asyncio.Semaphore(CONCURRENCY)
    ttfts, tokens = [], 0

    async def one(i: int) -> None:
        nonlocal tokens
        async with gate:
            started, first = time.perf_counter(), None
            async for output in engine.generate(EngineRequest(f"direct-{i}", PROMPT, spec)):
                if first is None:
                    first = time.perf_counter() - started
                tokens += sum(len(c.token_ids) for c in output.choices)
            ttfts.append(first)

    started = time.perf_counter()
    await asyncio.gather(*(one(i) for i in range(N_REQUESTS)))
    return _summary(ttfts, time.perf_counter() - started, tokens)


async def _kserve(url: str, model: str) -> dict:
    import numpy as np
    import tritonclient.grpc.aio as grpcaio

    params = json.dumps({"max_tokens": OUTPUT_TOKENS, "temperature": 0, "ignore_eos": True}).encode()
    gate = asyncio.Semaphore(CONCURRENCY)
    ttfts, tokens = [], 0

    def inputs():
        items = []
        for name, dtype, value in (("text_input", "BYTES", PROMPT.encode()), ("stream", "BOOL", True),
                                   ("sampling_parameters", "BYTES", params)):
            item = grpcaio.InferInput(name, [1], dtype)
            item.set_data_from_numpy(np.array([value], dtype=np.object_ if dtype == "BYTES" else bool))
            items.append(item)
        return items

    async def one(client, i: int) -> None:
        nonlocal tokens
        async with gate:
            async def requests():
                yield {"model_name": model, "inputs": inputs(), "request_id": f"kserve-{i}"}

            started, first = time.perf_counter(), None
            async for result, error in client.stream_infer(requests()):
                if error is not None:
                    raise RuntimeError(f"request {i}: {error}")
                if first is None:
                    first = time.perf_counter() - started
                tokens += int(result.as_numpy("num_output_tokens")[0])
                if result.get_response().parameters["triton_final_response"].bool_param:
                    break
            ttfts.append(first)

    client = grpcaio.InferenceServerClient(url)
    try:
        started = time.perf_counter()
        await asyncio.gather(*(one(client, i) for i in range(N_REQUESTS)))
        elapsed = time.perf_counter() - started
    finally:
        await client.close()
    return _summary(ttfts, elapsed, tokens)


async def measure(model_dir: pathlib.Path) -> dict[str, dict]:
    from serving_image.engine.vllm_local import VllmLocalEngine
    from serving_image.kserve.frontends import start_kserve

    engine = await VllmLocalEngine.start(name="demo-tiny", version="bench", model_path=model_dir,
                                         tokenizer_path=model_dir, args=dict(ENGINE_ARGS))
    kserve = await start_kserve(engine, None, host="127.0.0.1", grpc_port=_free_port(), http_port=_free_port())
    try:
        await _direct(engine)  # warm-up, not reported
        results = {"direct": await _direct(engine),
                   "kserve": await _kserve(f"127.0.0.1:{kserve.grpc_port}", "demo-tiny")}
    finally:
        await kserve.stop()
        await engine.shutdown()
    if results["kserve"]["output_tokens_per_s"] <= 0:
        raise RuntimeError("no tokens came back over KServe")
    return results


def run(out_dir: pathlib.Path) -> dict:
    results = asyncio.run(measure(demo_model()))
    ours, base = results["kserve"], results["direct"]
    lines = [
        f"{N_REQUESTS} requests, {OUTPUT_TOKENS} greedy output tokens each, {CONCURRENCY} at a time, one vLLM engine "
        "(demo model): NVIDIA's asyncio tritonclient streaming over gRPC to the local KServe server, against the "
        "engine called directly in the same process, one after the other.",
        "",
        *ratio_table(ours, base, ("KServe gRPC stream", "engine directly", "ratio (KServe / direct)")),
    ]
    plot = ratio_plot(ratios(ours, base), out_dir, "kserve.png", color="tab:green",
                      xlabel="KServe gRPC stream / direct engine (same run)", title="KServe front-end cost")
    return result("KServe gRPC front-end vs the engine directly", lines, [plot])


if __name__ == "__main__":
    main(run, __doc__.splitlines()[0])
