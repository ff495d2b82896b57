"""The embedded Triton's C++ KServe gRPC front-end (native/triton/kserve_grpc.cpp) under AddressSanitizer +
UndefinedBehaviorSanitizer, on a real local gRPC port.

A standalone driver (native/tests/kserve_grpc_driver.cpp) serves the front-end over the double of libtritonserver
that the response path's driver uses (native/tests/fake_triton.hpp), and its client threads, with grpc++'s generated
stub, send many requests on many streams at once, cancel some streams mid-way, send a request for a missing model
on a stream, requests under a malformed header, unary calls (answered, and refused for a decoupled and a missing
model) and a control RPC. It checks every response's order, text and final flag, each call's ending, one record per
request with its call's trace id, and that every request Triton got was deleted exactly once, after its release and
final response, with no output buffer leaked. Any sanitizer report fails the run.

ThreadSanitizer is not run here: the system's grpc++ is not built with it, so the ordering gRPC gives the
front-end's reactions (its own locks) is invisible to it. The response queue underneath is run under it
(test_response_path_sanitizers.py). The real library and tritonclient exercise the same code through
tests/serving/test_openai_embedded.py and the other suites of the embedded server.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

from llm_serving.repository import REPO_ROOT

NATIVE = REPO_ROOT / "native"


def _flags(*packages: str, kind: str) -> list[str]:
    return subprocess.run(["pkg-config", kind, *packages], check=True, capture_output=True, text=True).stdout.split()


@pytest.fixture(scope="module")
def driver(tmp_path_factory) -> Path:
    cxx = shutil.which("g++") or shutil.which("c++")
    assert cxx, "a C++ compiler is needed (the package build needs one too)"
    folder = tmp_path_factory.mktemp("kserve-grpc")
    subprocess.run(["protoc", f"--descriptor_set_in={NATIVE / 'triton' / 'protos' / 'kserve.binpb'}",
                    f"--cpp_out={folder}", f"--grpc_out={folder}",
                    f"--plugin=protoc-gen-grpc={shutil.which('grpc_cpp_plugin')}", "model_config.proto",
                    "grpc_service.proto"], check=True, timeout=120)
    cflags = _flags("grpc++", "protobuf", kind="--cflags")
    # The generated protobuf code is not this project's: compiled once, without sanitizers (they need not cover it).
    objects = []
    for source in ("model_config.pb.cc", "grpc_service.pb.cc", "grpc_service.grpc.pb.cc"):
        objects.append(folder / source.replace(".cc", ".o"))
        subprocess.run([cxx, "-std=c++17", "-O0", "-c", str(folder / source), f"-I{folder}", *cflags, "-o",
                        str(objects[-1])], check=True, timeout=600)
    out = folder / "driver"
    subprocess.run([cxx, "-std=c++17", "-O1", "-g", "-fno-omit-frame-pointer", "-fsanitize=address,undefined",
                    "-fno-sanitize-recover=all", f"-I{NATIVE / 'triton'}", f"-I{NATIVE / 'tests'}", f"-I{folder}",
                    *cflags, str(NATIVE / "triton" / "response_path.cpp"), str(NATIVE / "triton" / "kserve_grpc.cpp"),
                    str(NATIVE / "tests" / "kserve_grpc_driver.cpp"), *map(str, objects),
                    *_flags("grpc++", "protobuf", kind="--libs"), "-pthread", "-o", str(out)],
                   check=True, timeout=600)
    return out


@pytest.mark.parametrize(("streams", "requests", "responses", "seed"), [(24, 4, 3, 1), (8, 16, 1, 2), (40, 2, 6, 3)])
def test_every_stream_is_answered_in_order_and_every_request_deleted_once(driver, streams, requests, responses,
                                                                          seed):
    env = {k: v for k, v in os.environ.items() if k != "LD_PRELOAD"}  # a sanitizer runtime must come first
    done = subprocess.run([str(driver), str(streams), str(requests), str(responses), str(seed)],
                          capture_output=True, text=True, timeout=300, env=env)
    assert done.returncode == 0, done.stderr[-4000:]
    assert done.stdout.startswith(f"ok {streams} streams"), done.stdout
