"""The model-package manifest (`package.toml`, docs/architecture.md §3.4): typed, strict, shared by both planes.

Every table refuses keys it does not know: a misspelt key is an error that names it, never a silently ignored
setting.
"""

from __future__ import annotations

import re
import tomllib
from enum import StrEnum
from pathlib import PurePosixPath
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from llm_serving.pod_contract import ENGINE_MEMORY_BUDGET, engine_memory_shares
from llm_serving.python_deps import parse_requirements

MANIFEST_NAME = "package.toml"
MANIFEST_VERSION = 1
SUPPORTED_MANIFEST_VERSIONS = (MANIFEST_VERSION,)

# Kubernetes label values and S3 keys both accept this; the model id becomes a label (§3.10).
_ID_RE = re.compile(r"^[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?$")
_VERSION_RE = re.compile(r"^[A-Za-z0-9]([A-Za-z0-9._-]{0,61}[A-Za-z0-9])?$")
_SHA256_RE = re.compile(r"^[0-9a-f]{64}$")


class ManifestError(ValueError):
    """A manifest that cannot be used; the message names the key."""


class Backend(StrEnum):
    VLLM = "vllm"
    PYTHON = "python"
    ENSEMBLE = "ensemble"  # a Triton ensemble (platform "ensemble") over other packages' models (§3.4, model kinds)


class ServingMode(StrEnum):
    OPENAI = "openai"  # Triton in-process inside the OpenAI front-end, KServe front-ends on too
    STANDALONE = "standalone"  # Triton alone


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


def _relative_path(value: str, key: str) -> str:
    path = PurePosixPath(value)
    if not value or path.is_absolute() or ".." in path.parts or "\\" in value:
        raise ValueError(f"{key} must be a relative path inside the package, got {value!r}")
    return str(path)


class ModelIdentity(_Strict):
    id: str
    version: str
    backend: Backend
    io_fingerprint: str

    @field_validator("id")
    @classmethod
    def _check_id(cls, v: str) -> str:
        if not _ID_RE.match(v):
            raise ValueError(f"model.id {v!r} must be lowercase letters, digits and '-', at most 63 characters")
        return v

    @field_validator("version")
    @classmethod
    def _check_version(cls, v: str) -> str:
        if not _VERSION_RE.match(v):
            raise ValueError(f"model.version {v!r} must be letters, digits, '.', '_' or '-', at most 63 characters")
        return v


# vLLM's engine arguments for the layout; only [engine.parallel] sets them (one place that states a package's GPUs).
PARALLEL_ENGINE_ARGS = {"tensor": "tensor_parallel_size", "pipeline": "pipeline_parallel_size",
                        "data": "data_parallel_size"}


class ParallelLayout(_Strict):
    """How the engine spreads over GPUs: tensor × pipeline × data parallel = the GPUs one server uses.

    Stated by the package (`[engine.parallel]`: it was built and tested for it) and declared again by the stack for
    each model (`models[].parallel`: the stack names packages only by URI and cannot read them); a pod's GPUs must equal
    `gpus`. The schema and a policy check the stack's side, `llm-serving rollout` and the pod's startup check that the
    two declarations agree (docs/first-update.md, "Engine parallelism"). Omitted: one GPU (1 × 1 × 1)."""

    tensor: int = Field(default=1, ge=1, le=64)
    pipeline: int = Field(default=1, ge=1, le=64)
    data: int = Field(default=1, ge=1, le=64)

    @property
    def gpus(self) -> int:
        return self.tensor * self.pipeline * self.data

    def engine_args(self) -> dict[str, int]:
        """vLLM's engine arguments for this layout (model.json)."""
        return {arg: getattr(self, key) for key, arg in PARALLEL_ENGINE_ARGS.items()}

    def describe(self) -> str:
        return f"tensor {self.tensor} x pipeline {self.pipeline} x data {self.data} = {self.gpus} GPU(s)"


class VllmEngine(_Strict):
    """vLLM engine arguments. `model` and `tokenizer` are paths inside the package (under the model cache root)."""

    model: str = "weights"
    tokenizer: str | None = None
    args: dict[str, Any] = Field(default_factory=dict)
    parallel: ParallelLayout = ParallelLayout()
    # What the model serves: "generate" (completions, chat), "embed" (/v1/embeddings, a pooling engine on the same
    # weights) and "score" (/v1/score, prefill-only scoring: through Triton a Python-backend model of the platform's
    # own with an engine of its own, docs/kserve.md "Embeddings and scoring through Triton").
    tasks: list[Literal["generate", "embed", "score"]] = Field(default_factory=lambda: ["generate"], min_length=1)

    @field_validator("tasks")
    @classmethod
    def _unique_tasks(cls, v: list[str]) -> list[str]:
        if len(set(v)) != len(v):
            raise ValueError(f"engine.tasks lists a task twice: {v}")
        if "score" in v and "generate" not in v:
            # Scoring reads the generative model's prompt log-probabilities: it runs the same weights as a
            # generation engine, and the package's main Triton model is then that generation model.
            raise ValueError(f"engine.tasks {v}: 'score' needs 'generate' (scoring runs the generative model)")
        return v

    @field_validator("model", "tokenizer")
    @classmethod
    def _check_paths(cls, v: str | None, info) -> str | None:
        return None if v is None else _relative_path(v, f"engine.{info.field_name}")

    @field_validator("args")
    @classmethod
    def _check_args(cls, v: dict[str, Any]) -> dict[str, Any]:
        for key in ("model", "tokenizer", "download_dir", "load_format"):
            if key in v:
                raise ValueError(
                    f"engine.args.{key} is not allowed: weights are read from the package on the model cache"
                )
        for key, arg in PARALLEL_ENGINE_ARGS.items():
            if arg in v:
                raise ValueError(f"engine.args.{arg} is not allowed: the parallel layout is [engine.parallel] "
                                 f"{key} = {v[arg]!r}, which the stack and the pod's GPUs are checked against")
        return v

    @model_validator(mode="after")
    def _engines_fit_one_budget(self) -> VllmEngine:
        # One engine per task, on the same GPUs: together they may take what one engine may (pc.ENGINE_MEMORY_BUDGET).
        stated = self.args.get("gpu_memory_utilization")
        if stated is None:
            return self
        if isinstance(stated, bool) or not isinstance(stated, (int, float)) or not 0 < stated <= 1:
            raise ValueError(f"engine.args.gpu_memory_utilization {stated!r}: a fraction in (0, 1]")
        if stated * len(self.tasks) > ENGINE_MEMORY_BUDGET + 1e-9:
            raise ValueError(f"engine.args.gpu_memory_utilization {stated:g}: tasks {', '.join(self.tasks)} start "
                             f"{len(self.tasks)} engines on the same GPUs, each taking it: {stated * len(self.tasks):g}"
                             f" of each GPU's memory, more than the {ENGINE_MEMORY_BUDGET:g} one engine may take; "
                             f"state at most {ENGINE_MEMORY_BUDGET / len(self.tasks):.3g} or leave it out (each engine "
                             f"then gets an equal share)")
        return self

    def memory_shares(self) -> dict[str, float]:
        """Each task's engine's gpu_memory_utilization when the pod states none: the package's own value, or equal
        shares of what one engine may take."""
        shares = engine_memory_shares(self.tasks)
        stated = self.args.get("gpu_memory_utilization")
        return shares if stated is None else dict.fromkeys(self.tasks, float(stated))


class PythonModel(_Strict):
    """A Triton Python-backend model: its `model.py` and `config.pbtxt` inside the package."""

    model_py: str = "python/model.py"
    config_pbtxt: str = "python/config.pbtxt"
    weights: str | None = "weights"
    # What model.py imports, as PEP 508 requirement strings ("xgboost==3.0.5"): met by the image's Python backend
    # stub (compat.toml's stub pins) or by `execution_env` (llm_serving/python_deps.py; docs/architecture.md §3.4).
    dependencies: list[str] = Field(default_factory=list)
    # A conda-pack / venv-pack tarball inside the package that Triton's Python backend runs the model in
    # (EXECUTION_ENV_PATH), and the Python it was packed for, which must be the stub's (recorded at packaging).
    execution_env: str | None = None
    execution_env_python: str | None = None

    @field_validator("model_py", "config_pbtxt", "weights", "execution_env")
    @classmethod
    def _check_paths(cls, v: str | None, info) -> str | None:
        return None if v is None else _relative_path(v, f"python.{info.field_name}")

    @field_validator("dependencies")
    @classmethod
    def _check_dependencies(cls, v: list[str]) -> list[str]:
        parse_requirements(v, "python.dependencies")
        return v

    @model_validator(mode="after")
    def _check_execution_env(self) -> PythonModel:
        if self.execution_env is not None and not self.execution_env.endswith(".tar.gz"):
            raise ValueError(f"python.execution_env {self.execution_env!r} must be a .tar.gz (conda-pack or "
                             "venv-pack), which Triton's Python backend unpacks")
        if (self.execution_env is None) != (self.execution_env_python is None):
            raise ValueError("python.execution_env and python.execution_env_python go together: the environment "
                             "and the Python it was packed for")
        return self


class EnsembleStep(_Strict):
    """A step model of an ensemble: another package, served on the same Triton, named by (id, version)."""

    id: str
    version: str

    @field_validator("id")
    @classmethod
    def _check_id(cls, v: str) -> str:
        return ModelIdentity._check_id(v)

    @field_validator("version")
    @classmethod
    def _check_version(cls, v: str) -> str:
        return ModelIdentity._check_version(v)


class EnsembleModel(_Strict):
    """A Triton ensemble: its `config.pbtxt` (platform "ensemble", explicit I/O, `ensemble_scheduling`) inside the
    package, and the packages its steps call. Startup resolves each step among the packages served beside it."""

    config_pbtxt: str = "ensemble/config.pbtxt"
    steps: list[EnsembleStep] = Field(min_length=1)

    @field_validator("config_pbtxt")
    @classmethod
    def _check_path(cls, v: str) -> str:
        return _relative_path(v, "ensemble.config_pbtxt")

    @field_validator("steps")
    @classmethod
    def _unique_steps(cls, v: list[EnsembleStep]) -> list[EnsembleStep]:
        ids = [step.id for step in v]
        if len(set(ids)) != len(ids):
            raise ValueError(f"ensemble.steps names a model twice: {ids}")
        return v


class Plugin(_Strict):
    wheel: str

    @field_validator("wheel")
    @classmethod
    def _check_wheel(cls, v: str) -> str:
        v = _relative_path(v, "plugins.wheel")
        if not (v.startswith("plugins/") and v.endswith(".whl")):
            raise ValueError(f"plugins.wheel {v!r} must be a .whl file under plugins/")
        return v


class Manifest(_Strict):
    manifest_version: Literal[1]
    model: ModelIdentity
    serving_mode: ServingMode = ServingMode.OPENAI
    engine: VllmEngine | None = None
    python: PythonModel | None = None
    ensemble: EnsembleModel | None = None
    plugins: list[Plugin] = Field(default_factory=list)
    files: dict[str, str] = Field(default_factory=dict)  # path inside the package -> SHA-256 hex

    @field_validator("files")
    @classmethod
    def _check_files(cls, v: dict[str, str]) -> dict[str, str]:
        for path, digest in v.items():
            _relative_path(path, f"files[{path!r}]")
            if not _SHA256_RE.match(digest):
                raise ValueError(f"files[{path!r}] must be a lowercase SHA-256 hex digest, got {digest!r}")
        return v

    @model_validator(mode="after")
    def _check_backend(self) -> Manifest:
        if self.model.backend is Backend.VLLM and self.engine is None:
            raise ValueError("a vllm-backend package needs an [engine] table")
        if self.model.backend is Backend.PYTHON and self.python is None:
            raise ValueError("a python-backend package needs a [python] table")
        if self.model.backend is Backend.VLLM and self.python is not None:
            raise ValueError("[python] is only for python-backend packages (model.backend = 'python')")
        if self.model.backend is Backend.ENSEMBLE and self.ensemble is None:
            raise ValueError("an ensemble package needs an [ensemble] table (its config.pbtxt and steps)")
        if self.model.backend is Backend.ENSEMBLE and (self.engine is not None or self.python is not None):
            raise ValueError("an ensemble package has no [engine] or [python] table: its steps are other packages")
        if self.model.backend is not Backend.ENSEMBLE and self.ensemble is not None:
            raise ValueError("[ensemble] is only for ensemble packages (model.backend = 'ensemble')")
        return self

    @property
    def weights_dir(self) -> str | None:
        if self.engine is not None:
            return self.engine.model
        return self.python.weights if self.python else None

    def to_toml(self) -> str:
        # Imported here: reading a manifest needs only the standard library and pydantic (which vLLM brings), so the
        # image's build-stage probe can import this module on the bare base image (docs/architecture.md §3.10b).
        import tomli_w

        return tomli_w.dumps(self.model_dump(mode="json", exclude_none=True))


def _describe(error: ValidationError) -> str:
    parts = []
    for item in error.errors():
        loc = ".".join(str(p) for p in item["loc"]) or "(root)"
        if item["type"] == "extra_forbidden":
            parts.append(f"{loc}: unknown key")
        elif item["type"] == "missing":
            parts.append(f"{loc}: required key is missing")
        elif item["type"] == "literal_error" and item["loc"] == ("manifest_version",):
            parts.append(f"manifest_version: unknown manifest version {item['input']!r} "
                         f"(supported: {', '.join(map(str, SUPPORTED_MANIFEST_VERSIONS))})")
        else:
            parts.append(f"{loc}: {item['msg'].removeprefix('Value error, ')}")
    return "; ".join(parts)


def parse_manifest(text: str) -> Manifest:
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ManifestError(f"{MANIFEST_NAME} is not valid TOML: {exc}") from exc
    if "manifest_version" not in data:
        raise ManifestError(f"{MANIFEST_NAME}: manifest_version is missing")
    try:
        return Manifest.model_validate(data)
    except ValidationError as exc:
        raise ManifestError(f"{MANIFEST_NAME}: {_describe(exc)}") from exc
