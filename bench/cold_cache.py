"""A pod's startup on a cold vs a warm model cache: startup step 1 (unpack-and-verify, which reads every file of the
package) on a lazy-loading stand-in for FSx, before and after the cache warmer ran, in one run.

FSx loads a file's data from S3 on its first read. The stand-in (rehearsal/lazy_cache.py, a FUSE
passthrough the rehearsal mounts too) charges each file's first read `FIRST_BYTE_S + size / MIB_S` once, then
serves it at disk speed. Those two numbers are assumptions, not FSx measurements. What it measures is where that
cost falls: on the pod's startup (cold), or on the warmer before any rollout may name the version (warm). The warmer
and step 1 are the real code (serving_image/cache_warmer.py, serving_image/startup.py). Needs root and /dev/fuse.
"""

from __future__ import annotations

import json
import os
import pathlib
import tempfile
import time

from bench.report import main, pyplot, result, save_figure
from llm_serving import pod_contract as pc
from llm_serving.package import PackageSpec, build_package
from rehearsal.lazy_cache import FIRST_BYTE_S, MIB_S, MountedCache, step_one_seconds
from serving_image.cache_warmer import materialise

QUICK = os.environ.get("LLM_SERVING_BENCH_QUICK") == "1"
WEIGHT_FILES, FILE_MIB = (2, 16) if QUICK else (4, 64)


def _package(root: pathlib.Path) -> pathlib.Path:
    model = root / "hf-model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"model_type": "llama"}))
    for i in range(WEIGHT_FILES):
        (model / f"model-{i:05d}.safetensors").write_bytes(os.urandom(FILE_MIB << 20))
    cache = root / "fsx"
    target = cache / pc.FSX_MODELS_PATH.lstrip("/") / pc.model_cache_key("demo", "1.0.0")
    target.parent.mkdir(parents=True)
    build_package(PackageSpec(model, "demo", "1.0.0"), target)
    return cache


def measure(root: pathlib.Path) -> dict:
    cache = _package(root)
    package_rel = pathlib.Path(pc.FSX_MODELS_PATH.lstrip("/")) / pc.model_cache_key("demo", "1.0.0")
    with MountedCache(cache, root / "cold", MIB_S, FIRST_BYTE_S) as ops:
        cold = step_one_seconds(root / "cold", "demo", "1.0.0", root / "work-cold")
        cold_loaded = ops.loaded_bytes
    with MountedCache(cache, root / "warm", MIB_S, FIRST_BYTE_S) as ops:
        package = root / "warm" / package_rel
        t0 = time.perf_counter()
        materialise(package, (package / "package.toml").read_bytes(), restore=lambda paths: None)
        warmer = time.perf_counter() - t0
        warm = step_one_seconds(root / "warm", "demo", "1.0.0", root / "work-warm")
        warm_loaded = ops.loaded_bytes
    return {"cold_step1_s": cold, "warmer_s": warmer, "warm_step1_s": warm, "bytes": cold_loaded,
            "warm_bytes_loaded_by_warmer": warm_loaded}


def run(out_dir: pathlib.Path) -> dict:
    with tempfile.TemporaryDirectory(prefix="bench-cold-cache-") as tmp:
        m = measure(pathlib.Path(tmp))
    mib = m["bytes"] / 2**20
    lines = [
        f"Startup step 1 (unpack-and-verify: every file read and checksummed) on a {mib:.0f} MiB package, through "
        f"the lazy-loading FSx stand-in (first read of a file: {FIRST_BYTE_S} s + size at {MIB_S:g} MiB/s, both "
        "assumed).",
        "",
        "| cache | step 1 in the pod (s) | cache warmer before rollout (s) |",
        "| --- | ---: | ---: |",
        f"| cold (no warmer) | {m['cold_step1_s']:.2f} | - |",
        f"| warm (warmer ran first) | {m['warm_step1_s']:.2f} | {m['warmer_s']:.2f} |",
        "",
        f"Ratio cold / warm step 1: **{m['cold_step1_s'] / max(m['warm_step1_s'], 1e-9):.1f}x**. At the same assumed "
        f"rate, chat-large's 132 GiB would cost a cold pod {132 * 1024 / MIB_S:.0f} s of lazy loading inside its "
        "startup budget; warm, that time is spent by the warmer before `llm-serving rollout start` accepts the "
        "version.",
    ]
    fig, ax = pyplot().subplots(figsize=(7, 2.6))
    ax.barh(["cold: pod step 1"], [m["cold_step1_s"]], color="tab:red")
    ax.barh(["warm: warmer"], [m["warmer_s"]], color="tab:gray")
    ax.barh(["warm: pod step 1"], [m["warm_step1_s"]], color="tab:green")
    ax.set_xlabel("seconds")
    plot = save_figure(fig, out_dir, "cold_cache.png")
    return result("A pod's startup on a cold vs a warm model cache", lines, [plot])


if __name__ == "__main__":
    main(run, __doc__.splitlines()[0])
