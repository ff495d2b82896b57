"""What the remote hop costs a small CPU model: the same call through llm_serving_client, in the caller's
process and over KServe gRPC to the local tritonserver, side by side in one run.

The model is the ranker pipeline's first step (`ranker-features`, examples/ranker/pipeline/features: log1p over an
[n, 8] FP32 tensor, numpy only), one package served by the `standalone` mode's real tritonserver 2.51 and loaded by
the client from the same package. The rounds alternate the two paths, for 1 and 16 rows a call, one call at a time;
bare tritonclient on the same server is the third column, so the library's own cost shows apart from the hop's.
Latency per call, p50 and p99 (nearest rank), in microseconds. The remote path includes what Triton adds on the
way: the model's dynamic batcher waits up to its max_queue_delay (2 ms in the package's config.pbtxt) for company.
"""

from __future__ import annotations

import asyncio
import os
import pathlib
import tempfile
import time

import numpy as np

from bench.report import main, percentile, result
from llm_serving.repository import REPO_ROOT

QUICK = os.environ.get("LLM_SERVING_BENCH_QUICK") == "1"
CALLS = 200 if QUICK else 2000
ROUNDS = 3
ROWS = (1, 16)
MODEL = "ranker-features"
FEATURES = REPO_ROOT / "examples" / "ranker" / "pipeline" / "features"


def _package(out: pathlib.Path) -> pathlib.Path:
    from llm_serving.manifest import Backend, ServingMode
    from llm_serving.package import PackageSpec, build_package

    return build_package(PackageSpec(None, MODEL, "1.0.0", backend=Backend.PYTHON, serving_mode=ServingMode.STANDALONE,
                                     python_model=FEATURES / "model.py", config_pbtxt=FEATURES / "config.pbtxt",
                                     python_dependencies=("numpy>=1.24",)), out / MODEL)


def _outputs(fingerprint: str):
    from llm_serving.stack_outputs import parse_stack_outputs

    ends = {"openai": "https://unused.example/v1", "grpc": "unused.example:443", "kserveHttp": "https://unused.example"}
    return parse_stack_outputs({"schemaVersion": 2, "stack": "bench", "environment": "dev", "region": "local",
                                "models": {MODEL: {
                                    "kind": "python", "strategy": "red-black", "region": "local",
                                    "versions": ["1.0.0"], "activeVersion": "1.0.0", "routeWeights": {"1.0.0": 100},
                                    "replicas": {"1.0.0": 1}, "endpoints": ends, "versionEndpoints": {},
                                    "inProcess": {"versions": {"1.0.0": {"package": "s3://bench/m/", "ioFingerprint":
                                                                         fingerprint}}}}}})


def _timed(call, rows: np.ndarray) -> list[float]:
    times = []
    for _ in range(CALLS):
        started = time.perf_counter()
        call(rows)
        times.append(time.perf_counter() - started)
    return times


async def _start(package: pathlib.Path, workdir: pathlib.Path):
    from llm_serving.package import open_package
    from llm_serving.ports import free_port
    from serving_image.triton.runtime import start_standalone_triton

    ports = {name: free_port() for name in ("http", "grpc", "metrics")}
    triton = await start_standalone_triton([open_package(package)], workdir, http_port=ports["http"],
                                           grpc_port=ports["grpc"], metrics_port=ports["metrics"], host="127.0.0.1")
    return triton, f"127.0.0.1:{ports['grpc']}"


def measure() -> dict:
    import logging

    import tritonclient.grpc as grpcclient

    from llm_serving.package import open_package
    from llm_serving_client import Client, LocalEndpoints

    logging.getLogger("llm_serving_client.calls").setLevel(logging.WARNING)  # the records, not their printing
    with tempfile.TemporaryDirectory(prefix="bench-client-") as tmp:
        package = _package(pathlib.Path(tmp))
        outputs = _outputs(open_package(package).manifest.model.io_fingerprint)
        loop = asyncio.new_event_loop()
        triton, target = loop.run_until_complete(_start(package, pathlib.Path(tmp) / "triton"))
        try:
            local = LocalEndpoints("http://127.0.0.1:9/v1", target)
            remote, here = Client(outputs, local=local), Client(outputs, local=local)
            here.load_in_process(MODEL, "1.0.0", package)
            bare = grpcclient.InferenceServerClient(target)

            def bare_call(rows):
                tensor = grpcclient.InferInput("raw", list(rows.shape), "FP32")
                tensor.set_data_from_numpy(rows)
                return bare.infer(MODEL, [tensor]).as_numpy("features")

            paths = {"in-process": lambda rows: here.infer(MODEL, {"raw": rows}),
                     "KServe gRPC (client library)": lambda rows: remote.infer(MODEL, {"raw": rows}),
                     "KServe gRPC (bare tritonclient)": bare_call}
            samples: dict[int, dict[str, list[float]]] = {n: {p: [] for p in paths} for n in ROWS}
            for n in ROWS:
                rows = np.random.default_rng(n).gamma(2.0, 30.0, size=(n, 8)).astype(np.float32)
                answers = {p: call(rows) for p, call in paths.items()}  # warm-up, and the answers agree
                first = answers["in-process"]["features"]
                assert np.array_equal(first, answers["KServe gRPC (client library)"]["features"])
                assert np.array_equal(first, answers["KServe gRPC (bare tritonclient)"])
                for _ in range(ROUNDS):
                    for p, call in paths.items():
                        samples[n][p] += _timed(call, rows)
            bare.close()
            remote.close()
            here.close()
        finally:
            loop.run_until_complete(triton.shutdown())
            loop.close()
    return {n: {p: {"p50_us": percentile(t, 0.5) * 1e6, "p99_us": percentile(t, 0.99) * 1e6}
                for p, t in by_path.items()} for n, by_path in samples.items()}


def run(out_dir: pathlib.Path) -> dict:
    results = measure()
    lines = [f"`{MODEL}` (numpy log1p over [n, 8] FP32), {CALLS * ROUNDS} calls a path and size, one at a time, the "
             f"paths in turn over {ROUNDS} rounds; the same package in this process and on the local tritonserver "
             "2.51 (`standalone` mode; the model's dynamic batcher waits up to 2 ms for company, part of the hop). "
             "Answers checked identical before timing.", "",
             "| rows a call | path | p50 (µs) | p99 (µs) | p50 / in-process |", "| ---: | --- | ---: | ---: | ---: |"]
    for n, by_path in results.items():
        base = by_path["in-process"]["p50_us"]
        for path, q in by_path.items():
            lines.append(f"| {n} | {path} | {q['p50_us']:.0f} | {q['p99_us']:.0f} | {q['p50_us'] / base:.1f} |")
    return result("Client: in-process vs KServe gRPC", lines, [])


if __name__ == "__main__":
    main(run, __doc__.splitlines()[0])
