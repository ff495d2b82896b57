"""KServe gRPC streaming against the vLLM engine called directly, in one run (issues #6 and #13).

128 requests of 64 greedy output tokens (ignore_eos, so every request makes the same work), 32 prompt tokens, 16 at a
time, on the demo model. Baseline: `engine.generate` in this process. Subjects, with NVIDIA's asyncio tritonclient
streaming every token over gRPC:
- `triton`: the `standalone` serving mode, real tritonserver 2.51 with the stand-in vllm backend, whose engine (vLLM's
  AsyncLLM) runs in the Python backend stub's process (the hops: client -> Triton -> stub, and back).
Both measured in turn over several rounds (medians), with the CPU seconds each process spent per 1000 tokens.
Reported as ratios (subject / direct); the target for Triton is 0.8 of direct throughput (issue #13).
"""

from __future__ import annotations

import asyncio
import json
import pathlib
import statistics
import time

from bench.report import demo_model, main, percentile, ratio_plot, ratio_table, ratios, result
from llm_serving.kserve_stream import until_final_async
from llm_serving.ports import free_port

N_REQUESTS = 128
CONCURRENCY = 16
OUTPUT_TOKENS = 64
PROMPT = "The platform serves large language models next to the rest of the models " * 2
# float32: this machine's VM dies with SIGILL in vLLM's bf16 AMX attention kernel (docs/local-environment.md)
ENGINE_ARGS = {"max_model_len": 512, "kv_cache_memory_bytes": 256 * 1024 * 1024, "dtype": "float32"}


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


async def _kserve(url: str, model: str, n_requests: int = N_REQUESTS) -> dict:
    import numpy as np
    import tritonclient.grpc.aio as grpcaio

    params = json.dumps({"max_tokens": OUTPUT_TOKENS, "temperature": 0, "ignore_eos": True}).encode()
    gate = asyncio.Semaphore(CONCURRENCY)
    ttfts, tokens = [], 0

    def inputs():
        items = []
        for name, dtype, value in (("text_input", "BYTES", PROMPT.encode()), ("stream", "BOOL", True),
                                   ("sampling_parameters", "BYTES", params),
                                   ("return_num_output_tokens", "BOOL", True)):
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
            async for result, error in until_final_async(client.stream_infer(requests())):
                if error is not None:
                    raise RuntimeError(f"request {i}: {error}")
                if first is None:
                    first = time.perf_counter() - started
                tokens += int(result.as_numpy("num_output_tokens")[0])
            ttfts.append(first)

    client = grpcaio.InferenceServerClient(url)
    try:
        started = time.perf_counter()
        await asyncio.gather(*(one(client, i) for i in range(n_requests)))
        elapsed = time.perf_counter() - started
    finally:
        await client.close()
    return _summary(ttfts, elapsed, tokens)


async def _start_triton(model_dir: pathlib.Path, workdir: pathlib.Path):
    """The standalone serving mode's Triton on the demo model (as step 4 of the startup procedure starts it)."""
    from llm_serving.manifest import ServingMode
    from llm_serving.package import PackageSpec, build_package, open_package
    from serving_image.triton.runtime import start_standalone_triton

    package = open_package(build_package(PackageSpec(model_dir, "demo-tiny", "bench", engine_args=dict(ENGINE_ARGS),
                                                     serving_mode=ServingMode.STANDALONE), workdir / "pkg"))
    ports = {name: free_port() for name in ("http", "grpc", "metrics")}
    triton = await start_standalone_triton([package], workdir, http_port=ports["http"], grpc_port=ports["grpc"],
                                           metrics_port=ports["metrics"], host="127.0.0.1")
    return triton, f"127.0.0.1:{ports['grpc']}"


_ROLES = (("tritonserver", "tritonserver"), ("triton_python_backend_stub", "Python backend stub (vLLM's AsyncLLM)"),
          ("VLLM::", "vLLM engine core + worker"))


def _cpu_seconds() -> dict[str, float]:
    """CPU seconds so far of this process (the client, and the direct engine's front) and its descendants, by role."""
    import psutil

    me = psutil.Process()
    totals: dict[str, float] = {}
    under_triton = {p.pid for t in me.children() if t.name() == "tritonserver" for p in t.children(recursive=True)}
    for proc in (me, *me.children(recursive=True)):
        try:
            cmdline, times = " ".join(proc.cmdline()), proc.cpu_times()
        except psutil.Error:
            continue
        role = "this process (client; direct: the engine's front)" if proc.pid == me.pid else next(
            (name for needle, name in _ROLES if needle in cmdline or needle in proc.name()), "other")
        if role == "vLLM engine core + worker":
            role += " (Triton's)" if proc.pid in under_triton else " (direct)"
        totals[role] = totals.get(role, 0.0) + times.user + times.system
    return totals


async def _with_cpu(coro) -> tuple[dict, dict[str, float]]:
    """Run one measurement; also return the CPU seconds per 1000 output tokens it cost, by role."""
    before = _cpu_seconds()
    summary = await coro
    after = _cpu_seconds()
    tokens = N_REQUESTS * OUTPUT_TOKENS / 1000
    return summary, {role: (after[role] - before.get(role, 0.0)) / tokens for role in after
                     if after[role] - before.get(role, 0.0) > 0.005}


ROUNDS = 3


def _median(runs: list[dict]) -> dict:
    return {k: statistics.median(r[k] for r in runs) for k in runs[0]}


async def measure(model_dir: pathlib.Path) -> dict[str, dict]:
    """Both engines up at once (each idle while the other is measured), then ROUNDS rounds of direct and Triton,
    one after the other; medians, so that a burst of load from elsewhere on this shared machine moves one
    round, not the result."""
    import tempfile

    from serving_image.engine.vllm_local import VllmLocalEngine

    engine = await VllmLocalEngine.start(name="demo-tiny", version="bench", model_path=model_dir,
                                         tokenizer_path=model_dir, args=dict(ENGINE_ARGS))
    runs: dict[str, list] = {"direct": [], "triton": []}
    cpu: dict[str, list] = {"direct": [], "triton": []}
    try:
        with tempfile.TemporaryDirectory(prefix="bench-triton-") as workdir:
            triton, url = await _start_triton(model_dir, pathlib.Path(workdir))
            try:
                await _direct(engine)  # warm-ups, not reported
                await _kserve(url, "demo-tiny", n_requests=CONCURRENCY)
                for _ in range(ROUNDS):
                    summary, used = await _with_cpu(_direct(engine))
                    runs["direct"].append(summary)
                    cpu["direct"].append(used)
                    summary, used = await _with_cpu(_kserve(url, "demo-tiny"))
                    runs["triton"].append(summary)
                    cpu["triton"].append(used)
            finally:
                await triton.shutdown()
    finally:
        await engine.shutdown()
    if min(r["output_tokens_per_s"] for r in runs["triton"]) <= 0:
        raise RuntimeError("no tokens came back over KServe")
    roles = {role for used in cpu["direct"] + cpu["triton"] for role in used}
    return {"direct": _median(runs["direct"]), "triton": _median(runs["triton"]),
            "runs": runs,
            "cpu": {side: {role: statistics.median(u.get(role, 0.0) for u in cpu[side]) for role in roles}
                    for side in cpu}}


def run(out_dir: pathlib.Path) -> dict:
    results = asyncio.run(measure(demo_model()))
    base = results["direct"]
    throughput = results["triton"]["output_tokens_per_s"] / base["output_tokens_per_s"]
    lines = [
        f"{N_REQUESTS} requests, {OUTPUT_TOKENS} greedy output tokens each, {CONCURRENCY} at a time (demo model), "
        "NVIDIA's asyncio tritonclient streaming over gRPC, against the engine called directly in this process; "
        f"medians of {ROUNDS} rounds (direct and Triton in turn).",
        "",
        "Real tritonserver 2.51, the stand-in vllm backend with vLLM in its stub (the `standalone` serving mode):",
        "",
        *ratio_table(results["triton"], base, ("Triton gRPC stream", "engine directly", "ratio (Triton / direct)")),
        "",
        f"Triton's output-token throughput is {throughput:.2f} of direct (target 0.8); per round: "
        + ", ".join(f"{t['output_tokens_per_s'] / d['output_tokens_per_s']:.2f}"
                    for t, d in zip(results["runs"]["triton"], results["runs"]["direct"], strict=True)) + ".",
        "",
        "CPU seconds per 1000 output tokens, by process (this machine's cores are what the hops compete for; on a "
        "GPU node the engine's work leaves them to the front-ends):",
        "",
        "| process | direct | through Triton |",
        "| --- | ---: | ---: |",
        *(f"| {role} | {results['cpu']['direct'].get(role, 0.0):.3f} | {results['cpu']['triton'].get(role, 0.0):.3f} |"
          for role in sorted(set(results["cpu"]["direct"]) | set(results["cpu"]["triton"]))),
        f"| total | {sum(results['cpu']['direct'].values()):.3f} | {sum(results['cpu']['triton'].values()):.3f} |",
    ]
    plot = ratio_plot(ratios(results["triton"], base), out_dir, "kserve.png", color="tab:green",
                      xlabel="Triton gRPC stream / direct engine (same run)", title="KServe through real Triton")
    return result("KServe gRPC through Triton vs the engine directly", lines, [plot])


if __name__ == "__main__":
    main(run, __doc__.splitlines()[0])
