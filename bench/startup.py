"""Startup time: the serving entrypoint (verify package, plugins, metrics dir, engine, ports) against vLLM's own
OpenAI server starting on the same model with the same engine settings, alternating, in one run."""

from __future__ import annotations

import pathlib
import re
import statistics
import tempfile
import time

from bench.local_server import publish_demo, start_server
from bench.report import demo_model, main, pyplot, result, save_figure
from bench.vllm_server import start_vllm_server, stop_vllm_server

ROUNDS = 2


def measure(model_dir: pathlib.Path, workdir: pathlib.Path) -> dict:
    package = publish_demo(model_dir, workdir, version="bench-startup")
    ours, theirs, steps = [], [], []
    for i in range(ROUNDS):
        t0 = time.perf_counter()
        # in this process's session, as start_vllm_server starts vLLM's: both sides scheduled alike
        server = start_server(package, workdir / f"ours-{i}", own_session=False)
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
    with tempfile.TemporaryDirectory(prefix="bench-startup-") as tmp:
        runs = measure(demo_model(), pathlib.Path(tmp))
    ours, theirs = statistics.median(runs["ours"]), statistics.median(runs["vllm"])
    step_names = list(runs["steps"][0])
    median_steps = {name: statistics.median(s[name] for s in runs["steps"]) for name in step_names}
    lines = [
        f"Process start to ready (our `/health/ready` 200, vLLM's `/health` 200), median of {ROUNDS} alternating "
        "rounds on the demo model (same engine settings).",
        "",
        "| server | median s | runs (s) |",
        "| --- | ---: | --- |",
        f"| llm-serving entrypoint | {ours:.1f} | {', '.join(f'{x:.1f}' for x in runs['ours'])} |",
        f"| vLLM's own server | {theirs:.1f} | {', '.join(f'{x:.1f}' for x in runs['vllm'])} |",
        "",
        f"Ratio (ours / vLLM's): **{ours / theirs:.2f}**.",
        "",
        "Our steps (median s): " + ", ".join(f"{name} {secs:.2f}" for name, secs in median_steps.items()) + ".",
    ]
    fig, ax = pyplot().subplots(figsize=(7, 3))
    left = 0.0
    for name, secs in median_steps.items():
        ax.barh(["llm-serving"], [secs], left=left, label=name)
        left += secs
    ax.barh(["vLLM server"], [theirs], color="gray")
    ax.set_xlabel("seconds to ready")
    ax.legend(fontsize=7, loc="lower right")
    plot = save_figure(fig, out_dir, "startup.png")
    return result("Startup time vs vLLM's own server", lines, [plot])


if __name__ == "__main__":
    main(run, __doc__.splitlines()[0])
