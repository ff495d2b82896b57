"""KServe gRPC streaming against vLLM's AsyncLLM called directly, in one run.

384 requests of 64 greedy output tokens (ignore_eos, so every request makes the same work), 32 prompt tokens, 16 at a
time, on the demo model. Baseline: vLLM's `AsyncLLM.generate` in this process, streaming deltas. Subjects, with
NVIDIA's asyncio tritonclient streaming over gRPC (`ModelStreamInfer`; one stream per concurrent slot, which sends its
next request once the last one ended, as NVIDIA's vllm_backend sample client sends all its prompts on one stream; a
new stream for every request is measured beside it):
- `standalone`: the `standalone` serving mode (`make up MODE=standalone`), real tritonserver 2.51 with the stand-in
  vllm backend, whose engine (vLLM's AsyncLLM) runs in the Python backend stub's process (client -> Triton -> stub);
- `embedded`: the `openai` serving mode (`make up`), the real entrypoint, whose KServe gRPC port (8001 in the image)
  is Triton embedded in the OpenAI front-end's process through the C API, with the same backend and stub.
The three up at once (each idle while another is measured), measured in turn over several rounds with identical
engine arguments (medians), with the CPU seconds each process spent per 1000 tokens. Reported as ratios (subject /
direct); the target is 0.8 of direct throughput.
"""

from __future__ import annotations

import asyncio
import gc
import json
import pathlib
import statistics
import time
import uuid

from bench.local_server import ENGINE_SPIN_S, publish_demo, start_server
from bench.report import demo_model, main, percentile, ratio_plot, ratio_table, ratios, result
from llm_serving.kserve_stream import is_final
from llm_serving.ports import free_port

# 384, not 128: at 128 a side's measurement lasted about a second, and one side's consecutive rounds moved 0.77-0.99
# of direct on this shared machine (2026-12-05); three times longer, and five rounds, for a median that noise moves less
N_REQUESTS = 384
CONCURRENCY = 16
OUTPUT_TOKENS = 64
PROMPT = "The platform serves large language models next to the rest of the models " * 2
# float32: this machine's VM dies with SIGILL in vLLM's bf16 AMX attention kernel (docs/local-environment.md)
ENGINE_ARGS = {"max_model_len": 512, "kv_cache_memory_bytes": 256 * 1024 * 1024, "dtype": "float32"}


def _summary(ttfts: list[float], elapsed: float, tokens: int) -> dict:
    return {"requests_per_s": len(ttfts) / elapsed, "output_tokens_per_s": tokens / elapsed,
            "median_ttft_ms": statistics.median(ttfts) * 1000, "p99_ttft_ms": percentile(ttfts, 0.99) * 1000}


async def _direct(llm) -> dict:
    """The same requests through vLLM's AsyncLLM in this process, streamed as deltas."""
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    params = SamplingParams(max_tokens=OUTPUT_TOKENS, temperature=0.0, ignore_eos=True,
                            output_kind=RequestOutputKind.DELTA)
    gate = asyncio.Semaphore(CONCURRENCY)
    ttfts, tokens = [], 0
    run_id = uuid.uuid4().hex[:8]

    async def one(i: int) -> None:
        nonlocal tokens
        async with gate:
            started, first = time.perf_counter(), None
            async for output in llm.generate(PROMPT, params, request_id=f"direct-{run_id}-{i}"):
                if first is None:
                    first = time.perf_counter() - started
                tokens += sum(len(c.token_ids) for c in output.outputs)
            ttfts.append(first)

    started = time.perf_counter()
    await asyncio.gather(*(one(i) for i in range(N_REQUESTS)))
    return _summary(ttfts, time.perf_counter() - started, tokens)


def _infer_inputs(params: bytes) -> list:
    import numpy as np
    import tritonclient.grpc.aio as grpcaio

    items = []
    for name, dtype, value in (("text_input", "BYTES", PROMPT.encode()), ("stream", "BOOL", True),
                               ("sampling_parameters", "BYTES", params), ("return_num_output_tokens", "BOOL", True)):
        item = grpcaio.InferInput(name, [1], dtype)
        item.set_data_from_numpy(np.array([value], dtype=np.object_ if dtype == "BYTES" else bool))
        items.append(item)
    return items


async def _kserve(url: str, model: str, n_requests: int = N_REQUESTS, *, stream_per_request: bool = False) -> dict:
    """`n_requests` streamed requests, CONCURRENCY at a time, through tritonclient's asyncio `stream_infer`.

    As KServe clients use `ModelStreamInfer` (NVIDIA's vllm_backend sample client sends all its prompts on one
    stream, matching responses by id): each of the CONCURRENCY slots keeps one stream open and sends its next
    request on it once the previous one's final response came. `stream_per_request`: a new stream for every
    request instead (a client that opens and closes a call per prompt), reported beside it."""
    import tritonclient.grpc.aio as grpcaio

    params = json.dumps({"max_tokens": OUTPUT_TOKENS, "temperature": 0, "ignore_eos": True}).encode()
    ttfts, tokens = [], 0
    numbers = iter(range(n_requests))

    async def one_stream(client, first_request: int) -> None:
        """Requests on one stream, one at a time: `first_request`, then the next numbers while there are any
        (none after it when `stream_per_request`)."""
        nonlocal tokens
        pending: asyncio.Queue = asyncio.Queue()

        async def requests():
            while (request := await pending.get()) is not None:
                yield request

        def send(number: int | None) -> float:
            pending.put_nowait(None if number is None else
                               {"model_name": model, "inputs": _infer_inputs(params), "request_id": f"kserve-{number}"})
            return time.perf_counter()

        current, started, first = first_request, send(first_request), None
        responses = client.stream_infer(requests())
        try:
            async for result, error in responses:
                if error is not None:
                    raise RuntimeError(f"request {current}: {error}")
                if result.get_response().id != f"kserve-{current}":
                    raise RuntimeError(f"a response of {result.get_response().id!r} while kserve-{current} ran")
                if first is None:
                    first = time.perf_counter() - started
                tokens += int(result.as_numpy("num_output_tokens")[0])
                if is_final(result):
                    ttfts.append(first)
                    # the next request, or the end of this client's side: the server then ends the stream
                    current = None if stream_per_request else next(numbers, None)
                    started, first = send(current), None
        finally:
            responses.cancel()  # a no-op once the stream has ended; on an error, closes it

    client = grpcaio.InferenceServerClient(url)
    try:
        started = time.perf_counter()
        if stream_per_request:
            gate = asyncio.Semaphore(CONCURRENCY)

            async def gated(number: int) -> None:
                async with gate:
                    await one_stream(client, number)

            await asyncio.gather(*(gated(number) for number in numbers))
        else:
            await asyncio.gather(*(one_stream(client, number) for number in
                                   [next(numbers) for _ in range(min(CONCURRENCY, n_requests))]))
        elapsed = time.perf_counter() - started
    finally:
        await client.close()
    if len(ttfts) != n_requests:
        raise RuntimeError(f"{len(ttfts)} of {n_requests} requests finished")
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


SUBJECTS = ("standalone", "embedded")
# The same two servers with a new stream for every request (the client pattern of earlier runs), beside them
PER_REQUEST = {"standalone": "standalone, a stream per request", "embedded": "embedded, a stream per request"}
SIDES = ("direct", *SUBJECTS, *PER_REQUEST.values())
SERVER = {**{subject: subject for subject in SUBJECTS}, **{label: subject for subject, label in PER_REQUEST.items()}}
CLIENT = "this process (client; direct: AsyncLLM's front)"


def _kind(cmdline: str, name: str) -> str:
    if "triton_python_backend_stub" in cmdline or "triton_python_backend_stub" in name:
        return "Python backend stub (vLLM's AsyncLLM)"
    if cmdline.startswith("VLLM::"):
        return "vLLM engine core + worker"
    if name == "tritonserver":
        return "tritonserver"
    if "serving_image.startup" in cmdline:
        return "server process (front-end + embedded Triton)"
    return "other"


def _cpu_seconds() -> dict[tuple[str, str], float]:
    """CPU seconds so far of this process and its descendants, by (side, kind of process): each child of this
    process is one side's (tritonserver the standalone one, the entrypoint the embedded one, vLLM's engine processes
    the direct AsyncLLM's), and its descendants with it."""
    import psutil

    me = psutil.Process()
    totals: dict[tuple[str, str], float] = {}

    def add(side: str, proc) -> None:
        try:
            cmdline, name, times = " ".join(proc.cmdline()), proc.name(), proc.cpu_times()
        except psutil.Error:  # gone meanwhile, or a zombie
            return
        key = (side, _kind(cmdline, name))
        totals[key] = totals.get(key, 0.0) + times.user + times.system

    times = me.cpu_times()
    totals[("client", CLIENT)] = times.user + times.system
    for child in me.children():
        try:
            name, cmdline = child.name(), " ".join(child.cmdline())
        except psutil.Error:
            continue
        side = "standalone" if name == "tritonserver" else "embedded" if "serving_image.startup" in cmdline \
            else "direct"
        for proc in (child, *child.children(recursive=True)):
            add(side, proc)
    return totals


def _engine_steps(metrics_url: str | None) -> float:
    """vLLM's engine steps so far (the count of its `vllm:iteration_tokens_total` histogram, one observation per
    step): the direct engine's from this process's registry, a server's from its merged /metrics."""
    if metrics_url is None:
        from prometheus_client import REGISTRY

        families = REGISTRY.collect()
    else:
        import httpx
        from prometheus_client.parser import text_string_to_metric_families

        families = text_string_to_metric_families(httpx.get(metrics_url, timeout=10).text)
    return sum(sample.value for family in families if family.name.startswith("vllm:iteration_tokens")
               for sample in family.samples if sample.name.endswith("_count"))


async def _with_cpu(side: str, coro, metrics_url: str | None = None) -> tuple[dict, dict[str, float]]:
    """Run one measurement of `side`; also return the CPU seconds per 1000 output tokens it cost, by kind of
    process: this process's and that side's own (the others idle meanwhile, their polling not charged to it). For
    the direct engine and a server with `metrics_url`, the summary also holds the engine steps the side took and
    their mean wall time: same steps and longer ones say the loss is in each step, not in fewer requests a step."""
    counted = side == "direct" or metrics_url is not None
    steps = _engine_steps(metrics_url) if counted else 0.0
    before = _cpu_seconds()
    summary = await coro
    after = _cpu_seconds()
    if counted:
        summary["engine_steps"] = _engine_steps(metrics_url) - steps
        summary["ms_per_step"] = 1000 * N_REQUESTS / summary["requests_per_s"] / max(summary["engine_steps"], 1)
    tokens = N_REQUESTS * OUTPUT_TOKENS / 1000
    return summary, {kind: (after[(owner, kind)] - before.get((owner, kind), 0.0)) / tokens
                     for owner, kind in after if owner in (SERVER.get(side, side), "client")
                     and after[(owner, kind)] - before.get((owner, kind), 0.0) > 0.005}


# 7, not 5: one round's ratio moved 0.68-1.01 on this shared machine (2026-12-06, the direct side's own speed moving
# as much as the subjects'), and the median of five moved 0.76-0.87 between runs of the same code
ROUNDS = 7


def _median(runs: list[dict]) -> dict:
    return {k: statistics.median(r[k] for r in runs) for k in runs[0]}


async def measure(model_dir: pathlib.Path) -> dict[str, dict]:
    """The three sides up at once (each idle while another is measured), then ROUNDS rounds of direct, standalone
    and embedded, one after the other; medians, so that a burst of load from elsewhere on this shared machine moves
    one round, not the result."""
    import tempfile

    from vllm.v1.engine.async_llm import AsyncLLM

    from serving_image.cpu_placement import describe, keep_front_off_engine_cores
    from serving_image.engine.async_llm_model import build_engine_args

    runs: dict[str, list] = {side: [] for side in SIDES}
    cpu: dict[str, list] = {side: [] for side in SIDES}
    steps: dict[str, list] = {side: [] for side in SIDES}
    llm = AsyncLLM.from_engine_args(build_engine_args(model_dir, model_dir, dict(ENGINE_ARGS)))
    try:
        with tempfile.TemporaryDirectory(prefix="bench-kserve-") as workdir:
            triton, standalone_url = await _start_triton(model_dir, pathlib.Path(workdir))
            embedded = None
            try:
                # In this process's session, as the standalone tritonserver (started here) and the direct engine are:
                # the three sides under the same scheduling (local_server.start_server's `own_session`).
                embedded = await asyncio.to_thread(
                    start_server, publish_demo(model_dir, pathlib.Path(workdir), version="bench",
                                               engine_args=dict(ENGINE_ARGS)), pathlib.Path(workdir) / "embedded",
                    own_session=False)
                urls = {"standalone": standalone_url, "embedded": f"127.0.0.1:{embedded.ports['kserve_grpc']}"}
                # Every side's front off the cores the engines' workers bound themselves to, as the startup procedure
                # places a server's (serving_image/cpu_placement.py): the direct engine's front is this process, the
                # standalone tritonserver and its stubs are below it, the embedded server placed itself.
                print(describe(keep_front_off_engine_cores()), flush=True)
                await _direct(llm)  # warm-ups, not reported
                for subject in SUBJECTS:
                    await _kserve(urls[subject], "demo-tiny", n_requests=CONCURRENCY)
                for _ in range(ROUNDS):
                    for side in SIDES:
                        await asyncio.sleep(ENGINE_SPIN_S)  # the engine measured last has stopped spinning
                        work = _direct(llm) if side == "direct" else _kserve(
                            urls[SERVER[side]], "demo-tiny", stream_per_request=side in PER_REQUEST.values())
                        summary, used = await _with_cpu(
                            side, work, embedded.metrics_url if SERVER.get(side) == "embedded" else None)
                        steps[side].append({k: summary.pop(k) for k in ("engine_steps", "ms_per_step")
                                            if k in summary})
                        runs[side].append(summary)
                        cpu[side].append(used)
            finally:
                if embedded is not None:
                    embedded.stop()
                await triton.shutdown()
    finally:
        llm.shutdown()
        del llm
        gc.collect()  # its __del__ shuts down again: now, not at interpreter exit, where it fails on torn-down modules
    for subject in SIDES:
        if min(r["output_tokens_per_s"] for r in runs[subject]) <= 0:
            raise RuntimeError(f"no tokens came back over KServe ({subject})")
    kinds = {kind for side in SIDES for used in cpu[side] for kind in used}
    return {**{side: _median(runs[side]) for side in SIDES}, "runs": runs,
            "steps": {side: _median(steps[side]) for side in SIDES if steps[side][0]},
            "cpu": {side: {kind: statistics.median(u.get(kind, 0.0) for u in cpu[side]) for kind in kinds}
                    for side in SIDES}}


TARGET = 0.8
LABELS = {"standalone": "make up MODE=standalone (tritonserver)", "embedded": "make up (embedded Triton's 8001)"}


def run(out_dir: pathlib.Path) -> dict:
    results = asyncio.run(measure(demo_model()))
    base = results["direct"]
    lines = [
        f"{N_REQUESTS} requests, {OUTPUT_TOKENS} greedy output tokens each, {CONCURRENCY} at a time (demo model), "
        "NVIDIA's asyncio tritonclient streaming over gRPC (one stream per concurrent slot, each sending its next "
        "request when the last one ended, as NVIDIA's vllm_backend sample client sends its prompts on one stream), "
        "against vLLM's AsyncLLM called directly in this process; medians of "
        f"{ROUNDS} rounds (every side in turn), identical engine arguments.",
    ]
    verdicts = []
    for subject in SUBJECTS:
        throughput = results[subject]["output_tokens_per_s"] / base["output_tokens_per_s"]
        per_round = ", ".join(f"{t['output_tokens_per_s'] / d['output_tokens_per_s']:.2f}"
                              for t, d in zip(results["runs"][subject], results["runs"]["direct"], strict=True))
        lines += ["", f"**{LABELS[subject]}**, the stand-in vllm backend with vLLM in its stub:", "",
                  *ratio_table(results[subject], base, (subject, "AsyncLLM directly", f"ratio ({subject} / direct)")),
                  "", f"Output-token throughput {throughput:.2f} of direct (target {TARGET}); per round: {per_round}."]
        verdicts.append(f"{subject} {throughput:.2f}: **{'met' if throughput >= TARGET else 'missed'}**")
    lines += ["", "With a new stream for every request (the client pattern of the runs before 2026-12-05), beside "
              "them:", "",
              "| subject | output-token throughput / direct | per round | median TTFT, ms | p99 TTFT, ms |",
              "| --- | ---: | --- | ---: | ---: |"]
    for label in PER_REQUEST.values():
        per_round = ", ".join(f"{t['output_tokens_per_s'] / d['output_tokens_per_s']:.2f}"
                              for t, d in zip(results["runs"][label], results["runs"]["direct"], strict=True))
        lines.append(f"| {label} | {results[label]['output_tokens_per_s'] / base['output_tokens_per_s']:.2f} | "
                     f"{per_round} | {results[label]['median_ttft_ms']:.1f} | {results[label]['p99_ttft_ms']:.1f} |")
    lines += ["", "Output tokens per second, round by round (each side's own speed moves with this shared machine's):",
              "", "| side | " + " | ".join(str(n + 1) for n in range(ROUNDS)) + " |", "| --- |" + " ---: |" * ROUNDS,
              *(f"| {side} | " + " | ".join(f"{r['output_tokens_per_s']:.0f}" for r in results["runs"][side]) + " |"
                for side in SIDES)]
    stepped = results["steps"]
    lines += ["", "vLLM's engine steps per side's measurement and their mean wall time (medians; the standalone "
              "tritonserver's engine exports no metrics here):", "",
              "| side | engine steps | ms per step |", "| --- | ---: | ---: |",
              *(f"| {side} | {stepped[side]['engine_steps']:.0f} | {stepped[side]['ms_per_step']:.2f} |"
                for side in stepped)]
    lines += [
        "", "Targets (>= 0.8 of direct): " + "; ".join(verdicts) + ".", "",
        "CPU seconds per 1000 output tokens, by process (this machine's cores are what the hops compete for; on a "
        "GPU node the engine's work leaves them to the front-ends):",
        "",
        "| process | " + " | ".join(SIDES) + " |",
        "| --- |" + " ---: |" * len(SIDES),
        *(f"| {kind} | " + " | ".join(f"{results['cpu'][side].get(kind, 0.0):.3f}" for side in SIDES) + " |"
          for kind in sorted({k for side in SIDES for k in results["cpu"][side]})),
        "| total | " + " | ".join(f"{sum(results['cpu'][side].values()):.3f}" for side in SIDES) + " |",
    ]
    plot = ratio_plot({f"{subject} {m}": v for subject in SIDES[1:] for m, v in ratios(results[subject], base).items()},
                      out_dir, "kserve.png", color="tab:green", height=7,
                      xlabel="KServe gRPC stream / AsyncLLM directly (same run)", title="KServe through real Triton")
    return result("KServe gRPC through Triton (standalone and embedded) vs AsyncLLM directly", lines, [plot])


if __name__ == "__main__":
    main(run, __doc__.splitlines()[0])
