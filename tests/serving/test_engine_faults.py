"""Faults of the engine itself (issue #10): a request the CPU engine is known to die on, and an engine that dies
mid-stream under the real entrypoint."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import psutil
import pytest

from serving_image.local_server import publish_demo, start_server

SCRIPT = Path(__file__).parent / "scripts" / "seeded_preemption.py"


def _run_seeded(model_dir: Path, **env) -> dict:
    result = subprocess.run([sys.executable, str(SCRIPT), str(model_dir)], capture_output=True, text=True,
                            timeout=600, env=dict(os.environ, HF_HUB_OFFLINE="1", **env))
    lines = [line for line in result.stdout.splitlines() if line.startswith("RESULT ")]
    assert lines, f"no result (exit {result.returncode}):\n{result.stderr[-4000:]}"
    return json.loads(lines[-1].removeprefix("RESULT "))


def test_seeded_requests_under_preemption_no_longer_kill_the_engine(demo_model_dir: Path):
    """48 seeded requests with forced preemption and chunked prefill: without the plugin the engine dies
    (`CPU Generator does not use offset`); with it (loaded by vLLM through its entry point) all complete."""
    unprotected = _run_seeded(demo_model_dir, VLLM_PLUGINS="none-selected")
    assert unprotected["error"] is not None and unprotected["completed"] == 0, unprotected
    protected = _run_seeded(demo_model_dir)
    assert protected["error"] is None, protected
    assert protected["completed"] == 48
    assert protected["preemptions"] > 0, "the scenario must really preempt seeded requests"


@pytest.fixture()
def server(demo_model_dir: Path, tmp_path: Path):
    srv = start_server(publish_demo(demo_model_dir, tmp_path), tmp_path / "server")
    yield srv
    srv.kill()


def test_engine_killed_mid_stream(server, demo_model_dir: Path):
    """Kill the engine core under live streams: every caller gets an error within seconds,
    readiness turns false, and the server exits non-zero so Kubernetes restarts it. Nothing hangs, and no stream
    ends as if it had finished (a truncated answer passed off as whole is the failure this guards against)."""
    body = {"model": "demo-tiny", "prompt": "a long story", "max_tokens": 1900, "stream": True,
            "logit_bias": {"1": -100}}
    outcomes: dict[int, str] = {}
    started = threading.Barrier(9)

    def stream(i: int) -> None:
        try:
            with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=30) as response:
                lines = response.iter_lines()
                next(lines)
                started.wait(timeout=60)
                events = [json.loads(line[6:]) for line in lines if line.startswith("data: {")]
                outcomes[i] = "error" if "error" in events[-1] else f"completed: {events[-1]}"
        except (httpx.HTTPError, threading.BrokenBarrierError) as exc:
            outcomes[i] = f"error: {type(exc).__name__}"

    # vLLM's engine core and its worker: every child of the server but Python's resource tracker. Found before the
    # streams start: walking /proc while eight threads parse events starves this thread of the GIL for seconds,
    # long enough for the streams to finish before the kill.
    engine = [p.pid for p in psutil.Process(server.proc.pid).children(recursive=True)
              if "resource_tracker" not in " ".join(p.cmdline())]
    assert engine
    readiness: list[int] = []
    threads = [threading.Thread(target=stream, args=(i,)) for i in range(8)]
    for thread in threads:
        thread.start()
    started.wait(timeout=60)

    def watch_readiness() -> None:
        while True:
            try:
                readiness.append(httpx.get(f"{server.url}/health/ready", timeout=2).status_code)
            except httpx.HTTPError:
                return
            time.sleep(0.05)

    watcher = threading.Thread(target=watch_readiness)
    killed_at = time.monotonic()
    for pid in engine:
        os.kill(pid, signal.SIGKILL)  # one system call each: psutil's checks read /proc under the same GIL
    watcher.start()
    for thread in threads:
        thread.join(timeout=30)
    assert all(not t.is_alive() for t in threads), "a caller hung after the engine died"
    assert time.monotonic() - killed_at < 30
    assert sorted(outcomes) == list(range(8))
    # 1900 tokens each take seconds; the kill follows the first tokens within milliseconds.
    assert all(o.startswith("error") for o in outcomes.values()), outcomes
    code = server.proc.wait(timeout=60)
    assert code != 0
    assert "engine died" in server.log()
    watcher.join(timeout=10)
    if 503 in readiness:  # once not ready, never ready again
        assert 200 not in readiness[readiness.index(503):]
