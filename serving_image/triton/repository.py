"""Triton model repositories generated from a model package (docs/architecture.md §3.4, §3.9).

    <repository>/<model id>/config.pbtxt
    <repository>/<model id>/1/model.json      vllm backend: the engine arguments
    <repository>/<model id>/1/model.py        python backend: the package's model.py, with the helper modules
                                              beside it in the package

- vllm backend: `backend: "vllm"`, decoupled (the backend asserts it), no Triton batching (vLLM batches), one
  KIND_MODEL instance (vLLM places itself on the GPUs it is given), and the §3.3 tensor contract written out, so
  the I/O fingerprint can be read back from the file. `model.json` holds the package's engine arguments with the
  weights and tokenizer as paths under the package's place on the model cache, and the structured-output backend
  under the engine-argument name of the chosen Triton release's vLLM (it was renamed in vLLM 0.11). A package
  whose tasks include `embed` or `score` gets more models beside it (serving_image/triton/models.py): the pooling
  model (`<id>-embed`, the same backend, `runner: pooling` in its model.json) and the platform's scoring model
  (`<id>-score`, Triton's python backend: serving_image/triton_stub/scoring_model/model.py with engine_in_stub.py
  beside it, and the generation model's model.json).
- python backend: the package's own `config.pbtxt` (explicit I/O, required by the manifest checks) with its name
  set to the model id and `backend: "python"`, and the package's `model.py`. The weights directory is passed as the
  `weights_dir` parameter.
- ensemble: the package's `config.pbtxt` (`platform: "ensemble"`, explicit I/O, `ensemble_scheduling`) with its
  name set to the model id and an empty version directory. Its steps call other packages' models, which must be
  served by the same server with the versions the manifest names (`resolve_ensembles`, before anything starts).

The text is produced by protobuf's text format from Triton's own `ModelConfig` message (tritonclient ships it), so
the result is a config Triton parses. Golden files in tests/serving/golden/ pin the exact output.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path, PurePosixPath
from typing import Any

from google.protobuf import text_encoding, text_format
from tritonclient.grpc import model_config_pb2 as mc

from llm_serving.compat import TritonRelease
from llm_serving.manifest import Backend, Manifest
from llm_serving.tensor_contract import VLLM_INPUTS, VLLM_OUTPUTS, TensorSpec
from serving_image.triton.models import SCORING_INPUTS, SCORING_OUTPUTS, package_models
from serving_image.triton_stub import ENGINE_IN_STUB_PY, SCORING_MODEL_PY  # the stub process's files

VERSION_DIR = "1"
_KSERVE_TO_PBTXT = {"BYTES": mc.TYPE_STRING, "BOOL": mc.TYPE_BOOL, "UINT32": mc.TYPE_UINT32, "FP32": mc.TYPE_FP32}
# The structured-output settings the stand-in's AsyncLlmModel runs with (serving_image/engine/async_llm_model.py), so
# production generates the same JSON: xgrammar, and no whitespace outside strings.
STRUCTURED_BACKEND = {"backend": "xgrammar", "disable_any_whitespace": True}


class RepositoryError(ValueError):
    pass


def _tensor(spec: TensorSpec, cls):
    return cls(name=spec.name, data_type=_KSERVE_TO_PBTXT[spec.datatype], dims=list(spec.shape),
               **({"optional": True} if spec.optional else {}))


def vllm_model_config(model_id: str) -> mc.ModelConfig:
    return mc.ModelConfig(
        name=model_id,
        backend="vllm",
        max_batch_size=0,
        input=[_tensor(t, mc.ModelInput) for t in VLLM_INPUTS],
        output=[_tensor(t, mc.ModelOutput) for t in VLLM_OUTPUTS],
        model_transaction_policy=mc.ModelTransactionPolicy(decoupled=True),
        instance_group=[mc.ModelInstanceGroup(count=1, kind=mc.ModelInstanceGroup.KIND_MODEL)],
    )


def scoring_model_config(name: str) -> mc.ModelConfig:
    """The platform's scoring model (serving_image/triton_stub/scoring_model): Triton's python backend, explicit I/O,
    not decoupled (one response per request: unary ModelInfer), no Triton batching (vLLM batches the prefills)."""
    return mc.ModelConfig(
        name=name,
        backend="python",
        max_batch_size=0,
        input=[_tensor(t, mc.ModelInput) for t in SCORING_INPUTS],
        output=[_tensor(t, mc.ModelOutput) for t in SCORING_OUTPUTS],
        instance_group=[mc.ModelInstanceGroup(count=1, kind=mc.ModelInstanceGroup.KIND_MODEL)],
    )


def pooling_engine_json(engine_json: dict[str, Any]) -> dict[str, Any]:
    """The pooling model's model.json from the generation model's: the same weights as an embedding model, as
    AsyncLlmModel runs its embedder (serving_image/engine/async_llm_model.py); structured outputs do not apply."""
    engine = {k: v for k, v in engine_json.items()
              if k not in ("structured_outputs_config", "guided_decoding_backend",
                           "guided_decoding_disable_any_whitespace")}
    return {**engine, "runner": "pooling", "convert": "embed"}


def _scalar(field, value) -> str:
    if field.enum_type is not None:
        return field.enum_type.values_by_number[value].name
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return '"' + text_encoding.CEscape(value, as_utf8=True) + '"'
    return str(value)


def _format(message, indent: int) -> list[str]:
    """Protobuf text format in the style of Triton's documentation: repeated fields as `[ ... ]` lists (the form
    llm_serving.tensor_contract.pbtxt_io reads back for the I/O fingerprint)."""
    pad = "  " * indent
    lines: list[str] = []
    for field, value in message.ListFields():
        name = field.name
        is_map = field.message_type is not None and field.message_type.GetOptions().map_entry
        if is_map:
            for key in sorted(value):
                entry = field.message_type._concrete_class(key=key)
                if field.message_type.fields_by_name["value"].message_type is not None:
                    entry.value.CopyFrom(value[key])
                else:  # a map of scalars (an ensemble step's input_map / output_map)
                    entry.value = value[key]
                lines += [f"{pad}{name} {{", *_format(entry, indent + 1), f"{pad}}}"]
        elif field.is_repeated and field.message_type is not None:
            lines.append(f"{pad}{name} [")
            for i, item in enumerate(value):
                lines += [f"{pad}  {{", *_format(item, indent + 2), f"{pad}  }}" + ("," if i < len(value) - 1 else "")]
            lines.append(f"{pad}]")
        elif field.is_repeated:
            lines.append(f"{pad}{name}: [ {', '.join(_scalar(field, v) for v in value)} ]")
        elif field.message_type is not None:
            lines += [f"{pad}{name} {{", *_format(value, indent + 1), f"{pad}}}"]
        else:
            lines.append(f"{pad}{name}: {_scalar(field, value)}")
    return lines


def config_text(config: mc.ModelConfig) -> str:
    return "\n".join(_format(config, 0)) + "\n"


def structured_engine_args(args: dict[str, Any], release: TritonRelease) -> dict[str, Any]:
    """The package's engine args with the structured-output backend under the release's argument name."""
    args = dict(args)
    given = dict(STRUCTURED_BACKEND)
    if "structured_outputs_config" in args:
        value = args.pop("structured_outputs_config")
        if not isinstance(value, dict):
            raise RepositoryError("engine.args.structured_outputs_config must be a table (e.g. {backend = ...})")
        given = dict(value)
    for old, new in (("guided_decoding_backend", "backend"),
                     ("guided_decoding_disable_any_whitespace", "disable_any_whitespace")):
        if old in args:
            given[new] = args.pop(old)
    if release.structured_outputs_engine_arg == "structured_outputs_config":
        args["structured_outputs_config"] = given
    elif release.structured_outputs_engine_arg == "guided_decoding_backend":
        args["guided_decoding_backend"] = given.pop("backend")
        if "disable_any_whitespace" in given:
            args["guided_decoding_disable_any_whitespace"] = given.pop("disable_any_whitespace")
        if given:
            raise RepositoryError(f"Triton {release.release}'s vLLM has no engine argument for structured-output "
                                  f"setting(s) {', '.join(sorted(given))}")
    else:
        raise RepositoryError(f"unknown structured_outputs_engine_arg {release.structured_outputs_engine_arg!r}")
    return args


def vllm_engine_json(manifest: Manifest, package_root: PurePosixPath, release: TritonRelease) -> dict[str, Any]:
    engine = manifest.engine
    assert engine is not None
    args = structured_engine_args(engine.args, release)
    args.setdefault("disable_log_stats", False)  # vLLM's metrics feed the merged /metrics (§3.8)
    # The layout the package states ([engine.parallel]), always written: NVIDIA's backend hands model.json to vLLM's
    # engine arguments, and without them vLLM serves on one GPU whatever the pod has.
    args.update(engine.parallel.engine_args())
    return {"model": str(package_root / engine.model), "tokenizer": str(package_root / (engine.tokenizer or
                                                                                          engine.model)), **args}


def python_model_config(manifest: Manifest, config_pbtxt: str, package_root: PurePosixPath) -> mc.ModelConfig:
    config = mc.ModelConfig()
    try:
        text_format.Parse(config_pbtxt, config)
    except text_format.ParseError as exc:
        raise RepositoryError(f"python/config.pbtxt is not a valid Triton model config: {exc}") from exc
    if config.backend not in ("", "python"):
        raise RepositoryError(f"python/config.pbtxt names backend {config.backend!r}; a python-backend package "
                              "runs on Triton's python backend")
    if not config.input or not config.output:
        raise RepositoryError("python/config.pbtxt must declare its inputs and outputs explicitly")
    config.name = manifest.model.id
    config.backend = "python"
    assert manifest.python is not None
    if manifest.python.weights:
        config.parameters["weights_dir"].string_value = str(package_root / manifest.python.weights)
    if manifest.python.execution_env:
        # The package's own environment (llm_serving/python_deps.py), read in place from the package as the weights
        # are: Triton's Python backend unpacks it and runs the stub's Python with its site-packages.
        config.parameters["EXECUTION_ENV_PATH"].string_value = str(package_root / manifest.python.execution_env)
    return config


def ensemble_model_config(manifest: Manifest, config_pbtxt: str) -> mc.ModelConfig:
    config = mc.ModelConfig()
    try:
        text_format.Parse(config_pbtxt, config)
    except text_format.ParseError as exc:
        raise RepositoryError(f"{manifest.model.id}: the ensemble's config.pbtxt is not a valid Triton model config: "
                              f"{exc}") from exc
    if config.platform not in ("", "ensemble") or config.backend:
        raise RepositoryError(f"{manifest.model.id}: an ensemble package's config.pbtxt has platform \"ensemble\" "
                              f"and no backend (got platform {config.platform!r}, backend {config.backend!r})")
    assert manifest.ensemble is not None
    called = [step.model_name for step in config.ensemble_scheduling.step]
    named = [step.id for step in manifest.ensemble.steps]
    if not called or set(called) != set(named):
        raise RepositoryError(f"{manifest.model.id}: the ensemble's steps call {', '.join(called) or 'nothing'}, its "
                              f"manifest names {', '.join(named)}")
    config.name = manifest.model.id
    config.platform = "ensemble"
    return config


def resolve_ensembles(manifests: list[Manifest]) -> dict[str, list[str]]:
    """Check that every ensemble's step models are served beside it, with the versions its manifest names
    (Triton ensembles only call models of their own server). Returns each ensemble's steps as "id version"."""
    served = {m.model.id: m.model.version for m in manifests}
    resolved: dict[str, list[str]] = {}
    for manifest in manifests:
        if manifest.model.backend is not Backend.ENSEMBLE:
            continue
        assert manifest.ensemble is not None
        where = f"ensemble {manifest.model.id} {manifest.model.version}"
        listing = ", ".join(f"{k} {v}" for k, v in sorted(served.items()))
        for step in manifest.ensemble.steps:
            if step.id not in served:
                raise RepositoryError(f"{where}: step model {step.id} {step.version} is not served on this server "
                                      f"(served: {listing}); serve its package beside the ensemble (--with-package)")
            if served[step.id] != step.version:
                raise RepositoryError(f"{where}: step model {step.id} is served at version {served[step.id]}, the "
                                      f"ensemble names version {step.version}")
            if step.id == manifest.model.id:
                raise RepositoryError(f"{where}: an ensemble cannot be its own step")
        resolved[manifest.model.id] = [f"{s.id} {s.version}" for s in manifest.ensemble.steps]
    return resolved


def generate_repository(manifest: Manifest, package_dir: Path, repository: Path, release: TritonRelease,
                        package_root: PurePosixPath | None = None) -> Path:
    """Write the model's directory under `repository` and return it.

    `package_dir` is where the package's files are read from now; `package_root` is where the package lies when
    Triton runs (the model cache path inside the pod); it defaults to `package_dir`.
    """
    root = package_root or PurePosixPath(Path(package_dir).resolve().as_posix())
    model_dir = repository / manifest.model.id
    if model_dir.exists():
        shutil.rmtree(model_dir)
    (model_dir / VERSION_DIR).mkdir(parents=True)
    if manifest.model.backend is Backend.VLLM:
        config = vllm_model_config(manifest.model.id)
        engine_json = vllm_engine_json(manifest, root, release)
        models = package_models(manifest)
        if models.generate is None:  # an embedding package: its id names the pooling model
            engine_json = pooling_engine_json(engine_json)
        (model_dir / VERSION_DIR / "model.json").write_text(json.dumps(engine_json, indent=2, sort_keys=True) + "\n")
        if models.embed is not None and models.embed != models.main:
            _write_extra_model(repository / models.embed, vllm_model_config(models.embed),
                               {"model.json": pooling_engine_json(engine_json)})
        if models.score is not None:
            _write_extra_model(repository / models.score, scoring_model_config(models.score),
                               {"model.json": engine_json}, copies={"model.py": SCORING_MODEL_PY,
                                                                   "engine_in_stub.py": ENGINE_IN_STUB_PY})
    elif manifest.model.backend is Backend.ENSEMBLE:
        assert manifest.ensemble is not None
        config = ensemble_model_config(manifest, (package_dir / manifest.ensemble.config_pbtxt).read_text())
    else:
        assert manifest.python is not None
        config = python_model_config(manifest, (package_dir / manifest.python.config_pbtxt).read_text(), root)
        shutil.copyfile(package_dir / manifest.python.model_py, model_dir / VERSION_DIR / "model.py")
        # The helper modules beside model.py in the package (Triton puts the version directory on sys.path).
        source = PurePosixPath(manifest.python.model_py).parent
        for rel in sorted(manifest.files) if source.parts else ():
            path = PurePosixPath(rel)
            if path.parent.parts[:len(source.parts)] != source.parts or rel in (manifest.python.model_py,
                                                                               manifest.python.config_pbtxt):
                continue
            target = model_dir / VERSION_DIR / path.relative_to(source)
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(package_dir / rel, target)
    (model_dir / "config.pbtxt").write_text(config_text(config))
    return model_dir


def _write_extra_model(model_dir: Path, config: mc.ModelConfig, jsons: dict[str, dict],
                       copies: dict[str, Path] | None = None) -> None:
    """One more model of a package (its pooling or scoring model): config.pbtxt and the version directory's files."""
    if model_dir.exists():
        shutil.rmtree(model_dir)
    (model_dir / VERSION_DIR).mkdir(parents=True)
    for name, content in jsons.items():
        (model_dir / VERSION_DIR / name).write_text(json.dumps(content, indent=2, sort_keys=True) + "\n")
    for name, source in (copies or {}).items():
        shutil.copyfile(source, model_dir / VERSION_DIR / name)
    (model_dir / "config.pbtxt").write_text(config_text(config))
