"""The cached batch path: batch throughput against the same requests through the real-time endpoint, and
real-time p99 TTFT with and without a batch running, on one `openai`-mode server.

One server (the real entrypoint, the demo model, the Batch API on a directory store); the batch worker is the real
one (`python -m serving_image.batch.worker`) as a process of its own, at the concurrency the real-time run uses. It
is already running and polling the store when a batch is submitted, as the stack's long-running worker Deployment
is: its interpreter's start is not the batch path's cost. This machine's speed drifts by 10-30 % within minutes, so
each figure is the median of ROUNDS alternating rounds, never one run against another run minutes later.

- Throughput: per round, THROUGHPUT_N (1,000) greedy chat requests (max_tokens OUT) sent at concurrency C straight to
  /v1/chat/completions, and as many others of the same length as a batch (submitted with the official `openai`
  client, run by the worker at concurrency C), timed from submission to `completed` (read from the store, so that
  the timing adds no HTTP load); which of the two goes first alternates.
  Target: batch >= 0.8 of real-time (the median of the rounds' ratios).
- TTFT: per round, a real-time probe (streaming chat requests, PROBE_CONCURRENCY at a time) while the worker is
  stopped (SIGSTOP: the server idle), then while it runs a BACKGROUND-line batch (SIGCONT); p99 TTFT of each.
  Target: with / without <= 1.2 (the median of the rounds' ratios). The worker's requests carry
  `x-llm-serving-priority: batch`, so admission lets at most its share of the budget in, none while a real-time
  request is in flight, and a real-time request's admission preempts the batch generations running
  (serving_image/openai_api/admission.py); the preemptions are counted and reported.
"""

from __future__ import annotations

import asyncio
import json
import os
import pathlib
import signal
import subprocess
import sys
import tempfile
import time

import httpx

from bench.local_server import publish_demo, start_server
from bench.report import demo_model, main, percentile, ratio_plot, result
from llm_serving.object_store import open_object_store
from serving_image.batch.records import TERMINAL
from serving_image.batch.storage import BatchStorage

QUICK = os.environ.get("LLM_SERVING_BENCH_QUICK") == "1"
N = 48 if QUICK else 240  # the TTFT probes' idle and busy phases
# The throughput rounds' batch size: the issue's own 1,000-line batch. A batch's fixed costs (upload, the worker
# noticing it, finalize: about 0.2 s together, measured) are part of its time; at 240 lines, 1.2 s of work here,
# they alone were 15 %, which says more about the size than about the path.
THROUGHPUT_N = 48 if QUICK else 1000
OUT = 16
CONCURRENCY = 8
PROBES = 16 if QUICK else 48
PROBE_CONCURRENCY = 2
ROUNDS = 1 if QUICK else 3
BACKGROUND = 8 * N  # more than ROUNDS busy phases take at either concurrency
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


async def _ttfts(url: str, count: int, concurrency: int, tag: str = "probe") -> list[float]:
    bodies = [{**_body(i, tag), "stream": True} for i in range(count)]
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


def _median(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[len(ordered) // 2]


def _batch_seconds(url: str, storage: BatchStorage, bodies: list[dict], tag: str) -> float:
    """Submission to `completed`, observed in the store. Not by polling GET /v1/batches/{id}: a poll is an HTTP
    request the front-end serves on the cores the batch runs on, and at the 10 Hz this timing needs it cost the batch
    10-25 % of its rate (measured: 108-129 against 141-144 lines/s); a client team polls every few seconds."""
    start = time.perf_counter()
    batch_id = _submit(url, bodies, tag)
    while (record := storage.get_batch(batch_id)) is None or record.batch.status not in TERMINAL:
        time.sleep(0.02)
    seconds = time.perf_counter() - start
    status = _status(url, batch_id)  # and the API says the same
    assert status["status"] == "completed" and status["request_counts"]["completed"] == len(bodies), status
    return seconds


def _throughput_rounds(url: str, store: pathlib.Path) -> list[tuple[float, float]]:
    """(real-time s, batch s) per round, the order alternating."""
    worker = _worker(url, store)
    storage = BatchStorage(open_object_store(str(store)))
    try:
        warm = _submit(url, [_body(i, "worker-warm") for i in range(2)], "worker-warm")  # its imports, its client
        _wait_until(url, warm, ("completed",))
        rounds = []
        for r in range(ROUNDS):
            def realtime(r: int = r) -> float:
                return asyncio.run(_realtime(url, [_body(i, f"rt{r}") for i in range(THROUGHPUT_N)], CONCURRENCY))

            def batch(r: int = r) -> float:
                return _batch_seconds(url, storage, [_body(i, f"b{r}") for i in range(THROUGHPUT_N)],
                                      f"throughput{r}")

            if r % 2 == 0:
                realtime_s, batch_s = realtime(), batch()
            else:
                batch_s, realtime_s = batch(), realtime()
            rounds.append((realtime_s, batch_s))
    finally:
        worker.kill()
        worker.wait(timeout=60)
    return rounds


def _ttft_rounds(url: str, metrics_url: str, store: pathlib.Path, concurrency: int) -> dict:
    """Idle and busy p99 TTFT per round: the worker stopped (SIGSTOP), then running its batch (SIGCONT)."""
    background = _submit(url, [_body(i, f"bg{concurrency}") for i in range(BACKGROUND)], f"background{concurrency}")
    worker = _worker(url, store, concurrency)
    idle, busy, preempted, ran_throughout = [], [], 0.0, True
    try:
        _wait_until(url, background, ("in_progress",))
        for r in range(ROUNDS):
            worker.send_signal(signal.SIGSTOP)
            time.sleep(2.0)  # its requests in flight (16 tokens each) end; none starts while it is stopped
            idle.append(percentile(asyncio.run(_ttfts(url, PROBES, PROBE_CONCURRENCY, f"idle{concurrency}-{r}")),
                                   0.99))
            worker.send_signal(signal.SIGCONT)
            before_done = _status(url, background)["request_counts"]["completed"]
            while (status := _status(url, background))["request_counts"]["completed"] <= before_done:
                assert status["status"] == "in_progress", f"the background batch ended early: {status}"
                time.sleep(0.05)  # until the worker is answered again
            before = _preempted(metrics_url)
            busy.append(percentile(asyncio.run(_ttfts(url, PROBES, PROBE_CONCURRENCY, f"busy{concurrency}-{r}")),
                                   0.99))
            preempted += _preempted(metrics_url) - before
            status = _status(url, background)
            ran_throughout &= (status["status"] == "in_progress"
                               and status["request_counts"]["completed"] < BACKGROUND)
    finally:
        worker.send_signal(signal.SIGCONT)
        worker.kill()  # the rest of its batch stays in the store, unfinished: nothing else reads it here
        worker.wait(timeout=60)
        httpx.post(f"{url}/v1/batches/{background}/cancel", timeout=30)
    ratios = [b / i for b, i in zip(busy, idle, strict=True)]
    return {"p99_idle_ms": _median(idle) * 1000, "p99_ms": _median(busy) * 1000, "ratio": _median(ratios),
            "ratios": ratios, "ran_throughout": ran_throughout, "preempted": preempted}


def measure(workdir: pathlib.Path) -> dict:
    store = workdir / "batch-store"
    package = publish_demo(demo_model(), workdir, version="bench")
    # In this process's session, with the worker and the probes: one scheduling group for every side, not the server's
    # front-end sharing a group of its own with its pinned, spinning CPU engine (local_server.start_server)
    server = start_server(package, workdir / "server", extra_env={"LLM_SERVING_BATCH_STORE": str(store)},
                          own_session=False)
    try:
        url = server.url
        asyncio.run(_realtime(url, [_body(i, "warm") for i in range(CONCURRENCY)], CONCURRENCY))  # warm-up
        rounds = _throughput_rounds(url, store)
        busy = {c: _ttft_rounds(url, server.metrics_url, store, c) for c in BACKGROUND_CONCURRENCIES}
    finally:
        server.kill()
    ratios = [realtime_s / batch_s for realtime_s, batch_s in rounds]
    return {"rounds": rounds, "throughput_ratio": _median(ratios), "throughput_ratios": ratios, "busy": busy}


def run(out_dir: pathlib.Path) -> dict:
    with tempfile.TemporaryDirectory(prefix="bench-batch-") as tmp:
        m = measure(pathlib.Path(tmp))
    rounds = ", ".join(f"{rt:.1f} vs {b:.1f} s" for rt, b in m["rounds"])
    lines = [
        f"Demo model, greedy chat, {OUT} output tokens. Throughput: {THROUGHPUT_N} requests at concurrency "
        f"{CONCURRENCY}, {ROUNDS} alternating rounds of real-time vs batch (submission to completed, the worker "
        f"warm, at the same concurrency; the end read from the store, not polled over HTTP): {rounds}; "
        f"batch/real-time throughput, median of the rounds' ratios "
        f"**{m['throughput_ratio']:.2f}** (rounds {', '.join(f'{x:.2f}' for x in m['throughput_ratios'])}; target "
        f">= 0.8: **{'met' if m['throughput_ratio'] >= 0.8 else 'missed'}**).",
        "",
        f"Real-time TTFT, {PROBES} streaming probes at concurrency {PROBE_CONCURRENCY}, {ROUNDS} rounds each of the "
        f"worker stopped (idle) and running a {BACKGROUND}-line batch (busy); medians over the rounds:",
        "",
        "| worker concurrency | p99 TTFT idle ms | p99 TTFT busy ms | p99 busy / idle (rounds) | <= 1.2 "
        "| batch ran throughout | batch requests preempted |",
        "| ---: | ---: | ---: | ---: | --- | --- | ---: |",
        *(f"| {c} | {b['p99_idle_ms']:.0f} | {b['p99_ms']:.0f} | {b['ratio']:.2f} "
          f"({', '.join(f'{x:.2f}' for x in b['ratios'])}) | {'met' if b['ratio'] <= 1.2 else 'missed'} | "
          f"{b['ran_throughout']} | {b['preempted']:.0f} |" for c, b in m["busy"].items()),
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
