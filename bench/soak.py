"""Soak: concurrency 32 through the OpenAI API for ten minutes, on the real entrypoint.

Zero failed requests is the requirement; the resident memory of the server's whole process tree (front-end, engine
core, worker) is sampled every few seconds and its growth after warm-up must stay under a stated bound; latency
percentiles are recorded. `LLM_SERVING_SOAK_S` shortens the run (the default is 600 s).
"""

from __future__ import annotations

import asyncio
import os
import pathlib
import random
import statistics
import tempfile
import threading
import time
from dataclasses import dataclass, field

import httpx
import psutil

from bench.local_server import Server, publish_demo, start_server
from bench.report import demo_model, main, percentile, pyplot, result, save_figure

CONCURRENCY = 32
DEFAULT_SECONDS = 600
WARMUP_S = 60
RSS_GROWTH_BOUND_MB = 200  # after warm-up; KV cache and arenas are allocated by then


@dataclass
class SoakResult:
    seconds: float
    requests: int = 0
    failures: list[str] = field(default_factory=list)
    latencies: list[float] = field(default_factory=list)
    rss: list[tuple[float, float]] = field(default_factory=list)  # (t, MiB)

    def percentile(self, q: float) -> float:
        return percentile(self.latencies, q)

    @property
    def rss_growth_mb(self) -> float:
        after = [mb for t, mb in self.rss if t >= min(WARMUP_S, self.seconds / 3)]
        return (max(after) - after[0]) if after else 0.0


def _tree_rss_mb(pid: int) -> float:
    root = psutil.Process(pid)
    total = 0
    for proc in [root, *root.children(recursive=True)]:
        try:
            total += proc.memory_info().rss
        except psutil.NoSuchProcess:
            continue
    return total / 1024 / 1024


async def _load(server: Server, seconds: float, result: SoakResult) -> None:
    deadline = time.monotonic() + seconds
    rng = random.Random(0)

    async def worker(i: int, http: httpx.AsyncClient) -> None:
        while time.monotonic() < deadline:
            stream = rng.random() < 0.5
            body = {"model": "demo-tiny", "max_tokens": rng.randint(16, 128), "temperature": 1.0,
                    "messages": [{"role": "user", "content": f"worker {i} says " + "word " * rng.randint(5, 60)}]}
            if rng.random() < 0.2:
                body["response_format"] = {"type": "json_object"}
            t0 = time.perf_counter()
            try:
                if stream:
                    body["stream"] = True
                    async with http.stream("POST", "/v1/chat/completions", json=body) as response:
                        text = "".join([line async for line in response.aiter_lines()])
                        ok = response.status_code == 200 and text.endswith("[DONE]") and '"error"' not in text
                else:
                    response = await http.post("/v1/chat/completions", json=body)
                    ok = response.status_code == 200
                    text = response.text
            except httpx.HTTPError as exc:
                ok, text = False, repr(exc)
            result.requests += 1
            if ok:
                result.latencies.append(time.perf_counter() - t0)
            else:
                result.failures.append(text[:300])

    async with httpx.AsyncClient(base_url=server.url, timeout=120,
                                 limits=httpx.Limits(max_connections=CONCURRENCY * 2)) as http:
        await asyncio.gather(*(worker(i, http) for i in range(CONCURRENCY)))


def soak(model_dir: pathlib.Path, workdir: pathlib.Path, seconds: float) -> SoakResult:
    server = start_server(publish_demo(model_dir, workdir, version="soak"), workdir / "server")
    result = SoakResult(seconds=seconds)
    stop = threading.Event()
    t0 = time.monotonic()

    def sample() -> None:
        while not stop.is_set():
            result.rss.append((time.monotonic() - t0, _tree_rss_mb(server.proc.pid)))
            stop.wait(5)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    try:
        asyncio.run(_load(server, seconds, result))
    finally:
        stop.set()
        sampler.join()
        server.stop()
    return result


def run(out_dir: pathlib.Path) -> dict:
    seconds = float(os.environ.get("LLM_SERVING_SOAK_S", DEFAULT_SECONDS))
    with tempfile.TemporaryDirectory(prefix="bench-soak-") as tmp:
        outcome = soak(demo_model(), pathlib.Path(tmp), seconds)
    growth_ok = outcome.rss_growth_mb <= RSS_GROWTH_BOUND_MB
    lines = [
        f"{CONCURRENCY} concurrent clients for {seconds:.0f} s through `/v1/chat/completions` (half streaming, a fifth "
        "with `json_object`), on the real entrypoint.",
        "",
        f"- requests: {outcome.requests}, failed: **{len(outcome.failures)}**",
        f"- latency (s): p50 {outcome.percentile(0.5):.3f}, p90 {outcome.percentile(0.9):.3f}, "
        f"p99 {outcome.percentile(0.99):.3f}, mean {statistics.fmean(outcome.latencies or [0]):.3f}",
        f"- resident memory of the server's process tree: start {outcome.rss[0][1]:.0f} MiB, end "
        f"{outcome.rss[-1][1]:.0f} MiB; growth after warm-up {outcome.rss_growth_mb:.0f} MiB "
        f"(bound {RSS_GROWTH_BOUND_MB} MiB: **{'met' if growth_ok else 'exceeded'}**)",
    ]
    if outcome.failures:
        lines += ["", "First failures:", "", *[f"    {f}" for f in outcome.failures[:5]]]
    fig, (ax1, ax2) = pyplot().subplots(1, 2, figsize=(10, 3.5))
    ax1.plot([t for t, _ in outcome.rss], [mb for _, mb in outcome.rss])
    ax1.set_xlabel("s")
    ax1.set_ylabel("RSS of the process tree (MiB)")
    ax2.hist(outcome.latencies, bins=50)
    ax2.set_xlabel("request latency (s)")
    plot = save_figure(fig, out_dir, "soak.png")
    if outcome.failures or not growth_ok:
        raise AssertionError("soak failed: " + "; ".join(lines[2:]))
    return result("Soak: concurrency 32", lines, [plot])


if __name__ == "__main__":
    main(run, __doc__.splitlines()[0])
