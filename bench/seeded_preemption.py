"""vLLM's own seeded-sampling bug on CPU, with and without this project's plugin: 48 seeded requests
under forced preemption and chunked prefill on the demo model (bench/scripts/seeded_preemption.py). Without the
plugin (`VLLM_PLUGINS=none-selected`) vLLM's CPU engine dies (`CPU Generator does not use offset`); with it, loaded
by vLLM through its entry point, every request completes.

Not a speed figure: a check of the upstream bug the plugin exists for, kept out of `make test` (it proves vLLM's
behaviour, not ours, and costs an engine start). tests/serving/test_engine_faults.py runs the protected half. When
the unprotected run stops failing, vLLM has fixed the bug and the plugin can go.
"""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys
import tempfile

from bench.report import demo_model, main, result

SCRIPT = pathlib.Path(__file__).resolve().parent / "scripts" / "seeded_preemption.py"
REQUESTS = 48


def run_seeded(model_dir: pathlib.Path, out: pathlib.Path, **env: str) -> dict:
    """One run of the script; what it wrote (completed requests, the engine's error, preemptions seen)."""
    completed = subprocess.run([sys.executable, str(SCRIPT), str(model_dir), str(out)], capture_output=True,
                               text=True, timeout=600, env=dict(os.environ, HF_HUB_OFFLINE="1", **env))
    if not out.exists():
        raise RuntimeError(f"the seeded run wrote no result (exit {completed.returncode}):\n{completed.stderr[-4000:]}")
    return json.loads(out.read_text())


def run(out_dir: pathlib.Path) -> dict:
    with tempfile.TemporaryDirectory(prefix="bench-seeded-") as tmp:
        model = demo_model()
        unprotected = run_seeded(model, pathlib.Path(tmp) / "unprotected.json", VLLM_PLUGINS="none-selected")
        protected = run_seeded(model, pathlib.Path(tmp) / "protected.json")
    still_broken = unprotected["error"] is not None
    lines = [
        f"{REQUESTS} seeded requests, forced preemption and chunked prefill, demo model.",
        "",
        "| run | completed | preemptions | engine error |",
        "| --- | ---: | ---: | --- |",
        *(f"| {name} | {r['completed']} of {REQUESTS} | {r['preemptions']} | {r['error'] or 'none'} |"
          for name, r in (("without the plugin", unprotected), ("with the plugin", protected))),
        "",
        ("vLLM's bug still reproduces: the plugin is still needed." if still_broken else
         "**vLLM's bug no longer reproduces**: check the pinned vLLM's release notes; the plugin may go."),
    ]
    return result("vLLM's seeded sampling under preemption, with and without the plugin", lines, [])


if __name__ == "__main__":
    main(run, __doc__.splitlines()[0])
