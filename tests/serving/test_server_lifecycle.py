"""Stopping the `openai`-mode server, as Kubernetes (SIGTERM) and a terminal (Ctrl-C: SIGINT to the whole process
group) stop it. Each test stops a server of its own: the suite's shared server (tests/serving/conftest.py,
`openai_server`) must outlive every other test.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import httpx
import psutil
import pytest

from bench.local_server import Server, publish_demo, start_server
from llm_serving.ports import accepts
from tests.serving.engine_args import EAGER_ENGINE_ARGS

pytestmark = pytest.mark.slow

MODEL = "demo-tiny"
# Long enough that the checks made during the drain run inside it on any machine.
DRAIN_DELAY_S = 15


@pytest.fixture()
def server(demo_model_dir: Path, tmp_path: Path):
    srv = start_server(publish_demo(demo_model_dir, tmp_path, engine_args=EAGER_ENGINE_ARGS), tmp_path / "server",
                       extra_env={"LLM_SERVING_DRAIN_DELAY_S": str(DRAIN_DELAY_S)})
    yield srv
    srv.kill()


def test_sigterm_drains_readiness_first_then_stops_triton_and_exits_zero(server: Server):
    """SIGTERM: readiness turns 503 and new requests get 503 during the drain delay; then Triton stops (the model
    unloads, its engine stops) and the process exits 0 without a traceback."""
    assert httpx.post(f"{server.url}/v1/completions", json={"model": MODEL, "prompt": "before", "max_tokens": 2},
                      timeout=60).status_code == 200
    server.proc.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + DRAIN_DELAY_S
    while httpx.get(f"{server.url}/health/ready", timeout=30).status_code != 503:
        assert time.monotonic() < deadline, "readiness did not turn false"
        time.sleep(0.05)
    refused = httpx.post(f"{server.url}/v1/completions", json={"model": MODEL, "prompt": "late", "max_tokens": 2},
                         timeout=30)
    assert refused.status_code == 503 and refused.json()["error"]["code"] == "not_ready", refused.text
    assert server.proc.wait(timeout=120) == 0
    log = server.log()
    assert "draining for 15.0s before closing the listeners" in log
    assert f"successfully unloaded '{MODEL}'" in log
    assert "Traceback" not in log, log[-3000:]


def test_sigint_to_the_group_stops_everything_without_a_trace(server: Server):
    """Ctrl-C reaches every process of the group at once (the server, Triton's Python backend stub, vLLM's engine
    core and worker): all of them stop, the server exits 0, no traceback (vLLM's AsyncLLM.__del__ used to fail at
    interpreter teardown) and no "leaked shared_memory" warning from the resource tracker (the segments vLLM's engine
    processes leave in that race are reclaimed by the server, serving_image/engine/shm_ledger.py), no port left open."""
    children = psutil.Process(server.proc.pid).children(recursive=True)
    assert any((child.cmdline()[:1] or [""])[0].startswith("VLLM::") for child in children), children
    os.killpg(server.proc.pid, signal.SIGINT)
    assert server.proc.wait(timeout=60) == 0, server.log()[-3000:]
    gone, alive = psutil.wait_procs(children, timeout=30)
    assert alive == []
    log = server.log()
    assert "Traceback" not in log, log[-3000:]
    assert "leaked shared_memory" not in log, log[-3000:]
    for port in server.ports.values():
        assert not accepts(port)
