"""Startup time: the serving entrypoint (verify package, plugins, metrics dir, engine, ports) against vLLM's own
OpenAI server starting on the same model with the same engine settings, alternating, in one run."""

from __future__ import annotations

import pathlib
import re
import statistics
import tempfile
import time

from bench.vllm_server import start_vllm_server, stop_vllm_server
from serving_image.local_server import publish_demo, start_server

ROUNDS = 2


def measure(model_dir: pathlib.Path, workdir: pathlib.Path) -> dict:
    package = publish_demo(model_dir, workdir, version="bench-startup")
    ours, theirs, steps = [], [], []
    for i in range(ROUNDS):
        t0 = time.perf_counter()
        server = start_server(package, workdir / f"ours-{i}")
        ours.append(time.perf_counter() - t0)
        log = server.log()
        server.stop()
        steps.append({m.group(1): float(m.group(2)) for m in
                      re.finditer(r"startup step \d/5 ([a-z-]+): done in (\d+\.\d+)s", log)})
        t0 = time.perf_counter()
        proc, _url = start_vllm_server(model_dir, workdir)
        theirs.append(time.perf_counter() - t0)
        stop_vllm_server(proc)
    return {"ours": ours, "vllm": theirs, "steps": steps}


def run(out_dir: pathlib.Path) -> dict:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from serving_image.demo_model import ensure_demo_model

    repo = pathlib.Path(__file__).resolve().parents[1]
    model_dir = ensure_demo_model(repo / ".cache" / "llm-serving" / "models" / "demo-tiny")
    with tempfile.TemporaryDirectory(prefix="bench-startup-") as tmp:
        result = measure(model_dir, pathlib.Path(tmp))
    ours, theirs = statistics.median(result["ours"]), statistics.median(result["vllm"])
    step_names = list(result["steps"][0])
    median_steps = {name: statistics.median(s[name] for s in result["steps"]) for name in step_names}
    lines = [
        f"Process start to ready (our `/health/ready` 200, vLLM's `/health` 200), median of {ROUNDS} alternating "
        "rounds on the demo model (same engine settings).",
        "",
        "| server | median s | runs (s) |",
        "| --- | ---: | --- |",
        f"| llm-serving entrypoint | {ours:.1f} | {', '.join(f'{x:.1f}' for x in result['ours'])} |",
        f"| vLLM's own server | {theirs:.1f} | {', '.join(f'{x:.1f}' for x in result['vllm'])} |",
        "",
        f"Ratio (ours / vLLM's): **{ours / theirs:.2f}**.",
        "",
        "Our steps (median s): " + ", ".join(f"{name} {secs:.2f}" for name, secs in median_steps.items()) + ".",
    ]
    fig, ax = plt.subplots(figsize=(7, 3))
    left = 0.0
    for name, secs in median_steps.items():
        ax.barh(["llm-serving"], [secs], left=left, label=name)
        left += secs
    ax.barh(["vLLM server"], [theirs], color="gray")
    ax.set_xlabel("seconds to ready")
    ax.legend(fontsize=7, loc="lower right")
    fig.tight_layout()
    out_dir = pathlib.Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    plot = out_dir / "startup.png"
    fig.savefig(plot, dpi=120)
    plt.close(fig)
    return {"title": "Startup time vs vLLM's own server", "markdown": "\n".join(lines), "plots": [plot]}
