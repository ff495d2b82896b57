"""The embedded Triton's response path (native/triton/response_path.cpp) under AddressSanitizer +
UndefinedBehaviorSanitizer and under ThreadSanitizer.

A standalone C++ driver (native/tests/response_path_driver.cpp) links the path's core against a double of
libtritonserver whose backend threads answer every request (several responses, then a final one; CANCELLED once
cancelled) and release it before, between or after its responses, while a consumer thread drains a small queue (so
Triton's threads wait on it: backpressure) and the main thread cancels requests in flight or finished. The driver
checks every request's responses arrived in order with their text, exactly one final, each request deleted exactly
once and only after its release and final response, no output buffer leaked; any sanitizer report fails the run.
The real library is exercised by tests/serving/test_triton_capi.py through the same core.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

from llm_serving.repository import REPO_ROOT

NATIVE = REPO_ROOT / "native"


def _env() -> dict[str, str]:
    """Without LD_PRELOAD (a sanitizer runtime must come first; vLLM's CPU platform preloads its allocator) and with
    ThreadSanitizer stopping at its first report."""
    env = {k: v for k, v in os.environ.items() if k != "LD_PRELOAD"}
    env["TSAN_OPTIONS"] = "halt_on_error=1 exitcode=66"
    return env


def _build(out: Path, sanitizers: str) -> Path:
    cxx = shutil.which("g++") or shutil.which("c++")
    assert cxx, "a C++ compiler is needed (the package build needs one too)"
    subprocess.run([cxx, "-std=c++17", "-O1", "-g", "-fno-omit-frame-pointer", f"-fsanitize={sanitizers}",
                    "-fno-sanitize-recover=all", f"-I{NATIVE / 'triton'}", str(NATIVE / "triton" / "response_path.cpp"),
                    str(NATIVE / "tests" / "response_path_driver.cpp"), "-pthread", "-o", str(out)],
                   check=True, timeout=300)
    return out


@pytest.fixture(scope="module")
def drivers(tmp_path_factory) -> dict[str, Path]:
    folder = tmp_path_factory.mktemp("response-path")
    return {"asan": _build(folder / "asan", "address,undefined"), "tsan": _build(folder / "tsan", "thread")}


@pytest.mark.parametrize("kind", ["asan", "tsan"])
@pytest.mark.parametrize(("requests", "responses", "capacity", "seed"),
                         [(300, 4, 2, 1), (200, 1, 1, 2), (400, 8, 64, 3)])
def test_every_request_is_answered_in_order_and_deleted_once(drivers, kind, requests, responses, capacity, seed):
    done = subprocess.run([str(drivers[kind]), str(requests), str(responses), str(capacity), str(seed)],
                          capture_output=True, text=True, timeout=300, env=_env())
    assert done.returncode == 0, done.stderr[-4000:]
    assert done.stdout.strip() == f"ok {requests} requests"
