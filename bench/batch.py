"""The cached batch path (issue #32): batch throughput against the same requests through the real-time endpoint, and
real-time p99 TTFT with and without a batch running, on one `openai`-mode server.

One server (the real entrypoint, the demo model, the Batch API on a directory store); the batch worker is the real
one (`python -m serving_image.batch.worker`) as a process of its own, at the concurrency the real-time run uses.

- Throughput: N greedy chat requests (max_tokens OUT) sent at concurrency C straight to /v1/chat/completions, then
  the same N as a batch (submitted with the official `openai` client, run by the worker at concurrency C), timed
  from submission to `completed`. The worker is already running and polling the store when the batch is submitted,
  as the stack's long-running worker Deployment is: its interpreter's start is not the batch path's cost.
  Target: batch >= 0.8 of real-time.
- TTFT: a real-time probe (streaming chat requests, PROBE_CONCURRENCY at a time) on the idle server, then the same
  probe while a batch of BACKGROUND lines runs; p99 TTFT of each. Target: with / without <= 1.2. The worker's
  requests carry `x-llm-serving-priority: batch`, so admission lets at most its share of the budget in, none while
  a real-time request is in flight, and a real-time request's admission preempts the batch generations running
  (serving_image/openai_api/admission.py); the preemptions are counted and reported.
"""

from __future__ import annotations

import asyncio
import json
import os
import pathlib
import subprocess
import sys
import tempfile
import time

import httpx

from bench.report import demo_model, main, percentile, ratio_plot, result
from serving_image.local_server import publish_demo, start_server

QUICK = os.environ.get("LLM_SERVING_BENCH_QUICK") == "1"
N = 48 if QUICK else 240
OUT = 16
CONCURRENCY = 8
PROBES = 16 if QUICK else 48
PROBE_CONCURRENCY = 2
BACKGROUND = 4 * N
# The worker's concurrency while the probe runs: the throughput run's, and a quarter of it (what a platform team sets
# when real-time latency matters more than batch completion time; the admission share caps it from the server's side).
BACKGROUND_CONCURRENCIES = (CONCURRENCY, CONCURRENCY // 4)
MODEL = "demo-tiny"
CHAT = "/v1/chat/completions"


def _body(i: int, tag: str) -> dict:
    return {"model": MODEL, "messages": [{"role": "user", "content": f"{tag} title {i}: summarise"}],
            "temperature": 0, "max_tokens": OUT}


async def _realtime(url: str, bodies: list[dict], concurrency: int) -> float:
    queue = list(bodies)
    async with httpx.AsyncClient(base_url=url, timeout=600) as client:
        async def lane() -> None:
            while queue:
                response = await client.post(CHAT, json=queue.pop())
                response.raise_for_status()

        start = time.perf_counter()
        await asyncio.gather(*(lane() for _ in range(concurrency)))
        return time.perf_counter() - start


async def _ttfts(url: str, count: int, concurrency: int) -> list[float]:
    bodies = [{**_body(i, "probe"), "stream": True} for i in range(count)]
    ttfts: list[float] = []
    async with httpx.AsyncClient(base_url=url, timeout=600) as client:
        async def lane() -> None:
            while bodies:
                start = time.perf_counter()
                first = None
                async with client.stream("POST", CHAT, json=bodies.pop()) as response:
                    response.raise_for_status()
                    async for line in response.aiter_lines():  # read to the end: the request must complete
                        if first is None and line.startswith("data: ") and '"content"' in line:
                            first = time.perf_counter() - start
                if first is not None:
                    ttfts.append(first)

        await asyncio.gather(*(lane() for _ in range(concurrency)))
    return ttfts


def _submit(url: str, bodies: list[dict], tag: str) -> str:
    import openai

    client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)
    lines = "".join(json.dumps({"custom_id": f"{tag}-{i}", "method": "POST", "url": CHAT, "body": b}) + "\n"
                    for i, b in enumerate(bodies))
    uploaded = client.files.create(file=(f"{tag}.jsonl", lines.encode()), purpose="batch")
    return client.batches.create(input_file_id=uploaded.id, endpoint=CHAT, completion_window="24h").id


def _worker(url: str, store: pathlib.Path, concurrency: int = CONCURRENCY) -> subprocess.Popen:
    """The real worker as a process of its own, polling the store until killed (the stack's Deployment)."""
    return subprocess.Popen([sys.executable, "-m", "serving_image.batch.worker", "--store", str(store), "--endpoint",
                             url, "--concurrency", str(concurrency), "--poll-s", "0.1"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def _wait_until(url: str, batch_id: str, statuses: tuple[str, ...], poll_s: float = 0.05) -> dict:
    while (status := _status(url, batch_id))["status"] not in statuses:
        time.sleep(poll_s)
    return status


def _preempted(metrics_url: str) -> float:
    """The server's count of preempted batch requests (llm_serving_batch_preempted_total on /metrics)."""
    for line in httpx.get(metrics_url, timeout=30).text.splitlines():
        if line.startswith("llm_serving_batch_preempted_total"):
            return float(line.split()[-1])
    return 0.0


def _status(url: str, batch_id: str) -> dict:
    return httpx.get(f"{url}/v1/batches/{batch_id}", timeout=30).json()


def measure(workdir: pathlib.Path) -> dict:
    store = workdir / "batch-store"
    package = publish_demo(demo_model(), workdir, version="bench")
    server = start_server(package, workdir / "server", extra_env={"LLM_SERVING_BATCH_STORE": str(store)})
    try:
        url = server.url
        asyncio.run(_realtime(url, [_body(i, "warm") for i in range(CONCURRENCY)], CONCURRENCY))  # warm-up
        realtime_s = asyncio.run(_realtime(url, [_body(i, "tp") for i in range(N)], CONCURRENCY))
        # The same requests again would be answered from vLLM's prefix cache as warm as the first run left it;
        # another tag gives the batch prompts of the same length that are as cold as the real-time run's were.
        worker = _worker(url, store)
        warm = _submit(url, [_body(i, "worker-warm") for i in range(2)], "worker-warm")  # its imports, its client
        _wait_until(url, warm, ("completed",))
        start = time.perf_counter()
        batch_id = _submit(url, [_body(i, "tq") for i in range(N)], "throughput")
        status = _wait_until(url, batch_id, ("completed", "failed", "expired", "cancelled"))
        batch_s = time.perf_counter() - start
        worker.kill()
        worker.wait(timeout=60)
        assert status["status"] == "completed" and status["request_counts"]["completed"] == N, status

        idle = asyncio.run(_ttfts(url, PROBES, PROBE_CONCURRENCY))
        busy, still_running, preempted = {}, {}, {}
        for concurrency in BACKGROUND_CONCURRENCIES:
            background = _submit(url, [_body(i, f"bg{concurrency}") for i in range(BACKGROUND)], "background")
            worker = _worker(url, store, concurrency)
            _wait_until(url, background, ("in_progress",))
            before = _preempted(server.metrics_url)
            busy[concurrency] = asyncio.run(_ttfts(url, PROBES, PROBE_CONCURRENCY))
            preempted[concurrency] = _preempted(server.metrics_url) - before
            status = _status(url, background)
            still_running[concurrency] = (status["status"] == "in_progress"
                                          and status["request_counts"]["completed"] < BACKGROUND)
            worker.kill()  # the rest of its batch stays in the store, unfinished: nothing else reads it here
            worker.wait(timeout=60)
            httpx.post(f"{url}/v1/batches/{background}/cancel", timeout=30)
    finally:
        server.kill()
    return {"realtime_s": realtime_s, "batch_s": batch_s, "throughput_ratio": realtime_s / batch_s,
            "p99_idle_ms": percentile(idle, 0.99) * 1000, "p50_idle_ms": percentile(idle, 0.5) * 1000,
            "busy": {c: {"p99_ms": percentile(t, 0.99) * 1000, "p50_ms": percentile(t, 0.5) * 1000,
                         "ratio": percentile(t, 0.99) / percentile(idle, 0.99), "ran_throughout": still_running[c],
                         "preempted": preempted[c]}
                     for c, t in busy.items()}}


def run(out_dir: pathlib.Path) -> dict:
    with tempfile.TemporaryDirectory(prefix="bench-batch-") as tmp:
        m = measure(pathlib.Path(tmp))
    lines = [
        f"Demo model, greedy chat, {OUT} output tokens. Throughput: {N} requests at concurrency {CONCURRENCY}, "
        f"real-time {m['realtime_s']:.1f} s vs batch {m['batch_s']:.1f} s (submission to completed, worker at the "
        f"same concurrency): batch/real-time throughput **{m['throughput_ratio']:.2f}** (target >= 0.8: "
        f"**{'met' if m['throughput_ratio'] >= 0.8 else 'missed'}**).",
        "",
        f"Real-time TTFT, {PROBES} streaming probes at concurrency {PROBE_CONCURRENCY}: idle p99 "
        f"{m['p99_idle_ms']:.0f} ms (p50 {m['p50_idle_ms']:.0f} ms); with a {BACKGROUND}-line batch running:",
        "",
        "| worker concurrency | p99 TTFT ms | p50 TTFT ms | p99 with / without | <= 1.2 | batch ran throughout "
        "| batch requests preempted |",
        "| ---: | ---: | ---: | ---: | --- | --- | ---: |",
        *(f"| {c} | {b['p99_ms']:.0f} | {b['p50_ms']:.0f} | {b['ratio']:.2f} | "
          f"{'met' if b['ratio'] <= 1.2 else 'missed'} | {b['ran_throughout']} | {b['preempted']:.0f} |"
          for c, b in m["busy"].items()),
        "",
        "Batch work takes idle capacity only: no batch request is admitted while a real-time one is in flight, and a "
        "real-time admission preempts the batch generations running (503, sent again by the worker).",
    ]
    plots = [ratio_plot({"batch / real-time throughput": m["throughput_ratio"],
                         **{f"p99 TTFT with batch (worker x{c}) / without": b["ratio"] for c, b in m["busy"].items()}},
                        out_dir, "batch.png",
                        xlabel="ratio (same run)", title="Batch path vs real-time")]
    return result("The cached batch path: throughput and real-time TTFT", lines, plots)


if __name__ == "__main__":
    main(run, __doc__.splitlines()[0])
