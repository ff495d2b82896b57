"""One version of a Python-backend package run in the caller's process, as Triton's Python backend runs it.

Loading checks what Triton and the pod's startup would: every file against the package's checksums and its I/O
fingerprint against the manifest (llm_serving.package.open_package), the identity and fingerprint the stack outputs
name, the kind (only `python`: a GPU model or an LLM never runs in a client), and the package's declared Python
dependencies against this process's environment (llm_serving.python_deps, the check the stub's pins get). Then the
package's own `model.py` is imported with `triton_python_backend_utils` answered by the small equivalent beside this
module, and `initialize` gets its config.pbtxt as the JSON Triton hands it (the name, backend and `weights_dir` the
server's repository sets: serving_image/triton/repository.py `python_model_config`, held equal by a test).

A call is one request holding the call's rows: what the model receives from Triton's dynamic batcher, within its
`max_batch_size`.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import sys
from collections.abc import Mapping
from pathlib import Path, PurePosixPath

import numpy as np
from google.protobuf import json_format, text_format
from packaging.utils import canonicalize_name
from tritonclient.grpc import model_config_pb2 as mc

from llm_serving.manifest import Backend
from llm_serving.package import PackageError, VerifiedPackage, open_package
from llm_serving.python_deps import DependencyError, StubEnvironment, parse_requirements
from llm_serving_client.errors import CallError, InvalidRequest, ServerError
from llm_serving_client.inprocess import pb_utils
from llm_serving_client.tensor import ModelIO, TensorSpec

UTILS_MODULE = "triton_python_backend_utils"


class InProcessError(ValueError):
    """A package that cannot run in this process; the message names the model, the version and what is wrong."""


def this_environment() -> StubEnvironment:
    """The distributions this interpreter sees, in the shape the stub's pins are checked in."""
    dists = {canonicalize_name(d.metadata["Name"]): d.version for d in importlib.metadata.distributions()
             if d.metadata["Name"]}
    return StubEnvironment(where="this process's environment", python=f"{sys.version_info[0]}.{sys.version_info[1]}",
                           distributions=dists)


def model_config(package: VerifiedPackage) -> mc.ModelConfig:
    """The package's config.pbtxt as the server's repository serves it (the same three fields set)."""
    manifest = package.manifest
    config = mc.ModelConfig()
    text_format.Parse((package.root / manifest.python.config_pbtxt).read_text(), config)
    config.name = manifest.model.id
    config.backend = "python"
    if manifest.python.weights:
        config.parameters["weights_dir"].string_value = str(PurePosixPath(package.root) / manifest.python.weights)
    return config


def _io(config: mc.ModelConfig) -> ModelIO:
    batch = (-1,) if config.max_batch_size > 0 else ()

    def specs(items) -> dict[str, TensorSpec]:
        return {t.name: TensorSpec(t.name, mc.DataType.Name(t.data_type).removeprefix("TYPE_").replace(
            "STRING", "BYTES"), batch + tuple(int(d) for d in t.dims)) for t in items}
    return ModelIO(specs(config.input), specs(config.output))


class InProcessModel:
    def __init__(self, source: Path, *, model_id: str, version: str, io_fingerprint: str,
                 workdir: Path | None = None):
        self.model_id, self.version = model_id, version
        where = f"model {model_id!r} version {version!r}"
        try:
            package = open_package(Path(source), workdir)
        except PackageError as exc:
            raise InProcessError(f"{where}: the package at {source} does not verify: {exc}") from None
        manifest = package.manifest
        if manifest.model.backend != Backend.PYTHON:
            raise InProcessError(f"{where}: a {manifest.model.backend.value} package never runs in the caller's "
                                 f"process (only a python one, on CPU)")
        if (manifest.model.id, manifest.model.version) != (model_id, version):
            raise InProcessError(f"{where}: the package at {source} is {manifest.model.id} {manifest.model.version}")
        if manifest.model.io_fingerprint != io_fingerprint:
            raise InProcessError(f"{where}: the package's I/O fingerprint {manifest.model.io_fingerprint} is not the "
                                 f"one the stack serves ({io_fingerprint})")
        try:
            this_environment().check(parse_requirements(manifest.python.dependencies, "python.dependencies"), where)
        except DependencyError as exc:
            raise InProcessError(f"{exc}; install them in the caller's environment to run it in-process") from None
        self.config = model_config(package)
        self.io = _io(self.config)
        self.max_batch_size = self.config.max_batch_size
        self._model = self._load(package.root / manifest.python.model_py, package)

    def _load(self, model_py: Path, package: VerifiedPackage):
        present = sys.modules.get(UTILS_MODULE)
        if present is not None and present is not pb_utils:
            raise InProcessError(f"model {self.model_id!r}: another {UTILS_MODULE} is imported in this process (a "
                                 f"Triton stub's?); the in-process runner provides its own")
        sys.modules[UTILS_MODULE] = pb_utils  # the name model.py imports; its module keeps the binding
        name = f"llm_serving_inprocess_{self.model_id.replace('-', '_')}_{self.version.replace('.', '_')}"
        spec = importlib.util.spec_from_file_location(name, model_py)
        module = importlib.util.module_from_spec(spec)
        sys.path.insert(0, str(model_py.parent))  # helper modules beside model.py, as the backend's path has them
        try:
            spec.loader.exec_module(module)
        finally:
            sys.path.remove(str(model_py.parent))
        model = module.TritonPythonModel()
        config_json = json_format.MessageToJson(self.config, preserving_proto_field_name=True)
        if hasattr(model, "initialize"):
            model.initialize({"model_config": config_json, "model_instance_kind": "CPU",
                              "model_instance_name": f"{self.model_id}_0_0", "model_instance_device_id": "0",
                              "model_repository": str(model_py.parent), "model_version": "1",
                              "model_name": self.model_id})
        self.config_json = json.loads(config_json)
        return model

    def execute(self, inputs: Mapping[str, np.ndarray], outputs: list[str]) -> dict[str, np.ndarray]:
        if self.max_batch_size:
            for name, array in inputs.items():
                if array.shape and array.shape[0] > self.max_batch_size:
                    raise InvalidRequest(f"has {array.shape[0]} rows; the model takes at most {self.max_batch_size} "
                                         f"a request (max_batch_size)", model=self.model_id, version=self.version,
                                         field=name)
        request = pb_utils.InferenceRequest([pb_utils.Tensor(n, a) for n, a in inputs.items()])
        (response,) = self._model.execute([request])
        if response.has_error():
            error = response.error()
            kind: type[CallError] = InvalidRequest if error.code() == pb_utils.TritonError.INVALID_ARG \
                else ServerError
            raise kind(error.message(), model=self.model_id, version=self.version)
        answer = {t.name(): t.as_numpy() for t in response.output_tensors()}
        missing = [o for o in outputs if o not in answer]
        if missing:
            raise ServerError(f"the model's execute returned no {missing[0]!r}", model=self.model_id,
                              version=self.version, field=missing[0])
        return {o: answer[o] for o in outputs}

    def close(self) -> None:
        if hasattr(self._model, "finalize"):
            self._model.finalize()
