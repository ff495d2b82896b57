"""The batch worker stops on SIGTERM as a pod's container is stopped (serving_image/batch/worker.py main): the
kubelet sends SIGTERM, and the Deployment's command makes the worker its container's PID 1, for which the kernel has
no default action on SIGTERM. Run here as PID 1 of a fresh PID namespace (`unshare --pid --fork`, root), as in the
container: without the worker's own handler it would ignore the signal and wait for the SIGKILL."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
import urllib.request

import pytest

from llm_serving.ports import free_port

pytestmark = pytest.mark.timeout(120)


def _metrics_up(port: int) -> bool:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2) as response:  # noqa: S310
            return response.status == 200
    except OSError:
        return False


def test_sigterm_ends_the_worker_as_pid_1_with_status_0(tmp_path):
    # Runs where the suite runs (root, as make test and the rehearsal need): a missing piece fails, named, never skips.
    assert os.geteuid() == 0, "a PID namespace of its own needs root (make test runs as root)"
    assert shutil.which("unshare"), "unshare (util-linux) is missing"
    port = free_port()
    env = {**os.environ, "LLM_SERVING_BATCH_WORKER_API_KEY": "key"}
    env.pop("LLM_SERVING_BATCH_WORKER_API_KEY_FILE", None)
    worker = subprocess.Popen(
        ["unshare", "--pid", "--fork", "--kill-child", sys.executable, "-m", "serving_image.batch.worker",
         "--store", str(tmp_path / "store"), "--endpoint", "http://127.0.0.1:9", "--metrics-port", str(port)],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 60
        while not _metrics_up(port):  # the worker serves its metrics once it runs
            assert worker.poll() is None, worker.stdout.read()
            assert time.monotonic() < deadline, "the worker never served its metrics"
            time.sleep(0.1)
        inner = subprocess.run(["pgrep", "-P", str(worker.pid)], capture_output=True, text=True).stdout.split()
        assert len(inner) == 1, f"unshare's child: {inner}"
        with open(f"/proc/{inner[0]}/status") as status:
            nspid = [line.split()[1:] for line in status if line.startswith("NSpid:")][0]
        assert nspid[-1] == "1", "the worker is its PID namespace's PID 1"
        os.kill(int(inner[0]), signal.SIGTERM)
        assert worker.wait(timeout=30) == 0, worker.stdout.read()
    finally:
        if worker.poll() is None:
            worker.kill()
            worker.wait()
