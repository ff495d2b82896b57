"""vLLM's own OpenAI server on the same model and engine settings as ours: the baseline of the benchmarks."""

from __future__ import annotations

import os
import pathlib
import signal
import subprocess
import sys
import time

import httpx

from bench.local_server import ENGINE_ARGS, READY_POLL_S
from llm_serving.ports import free_port


def start_vllm_server(model_dir: pathlib.Path, workdir: pathlib.Path, *, enforce_eager: bool = False,
                      timeout_s: float = 300, own_session: bool = False) -> tuple[subprocess.Popen, str]:
    port = free_port()
    log = open(workdir / "vllm-server.log", "w")
    # A process group of its own (killpg stops its engine processes too); in the caller's session (the same scheduling
    # group as the benchmark's other sides) unless `own_session`, as local_server.start_server's
    proc = subprocess.Popen(
        [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir),
         "--served-model-name", "demo-tiny", "--host", "127.0.0.1", "--port", str(port),
         "--max-model-len", str(ENGINE_ARGS["max_model_len"]),
         "--kv-cache-memory-bytes", str(ENGINE_ARGS["kv_cache_memory_bytes"]), "--dtype", ENGINE_ARGS["dtype"],
         *(["--enforce-eager"] if enforce_eager else [])],
        stdout=log, stderr=subprocess.STDOUT, env=dict(os.environ, HF_HUB_OFFLINE="1"),
        **({"start_new_session": True} if own_session else {"process_group": 0}))
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            os.killpg(proc.pid, signal.SIGKILL)
            raise RuntimeError(f"vLLM's server exited: {(workdir / 'vllm-server.log').read_text()[-3000:]}")
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        time.sleep(READY_POLL_S)
    os.killpg(proc.pid, signal.SIGKILL)  # the whole group: its engine core and worker too
    raise RuntimeError(f"vLLM's server did not become ready in {timeout_s:.0f} s")


def stop_vllm_server(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGINT)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
