"""The demo packages beside the demo LLM (docs/architecture.md §3.4, "Model kinds"): the XGBoost ranker and the
ranker pipeline (an ensemble over two Python steps and the ranker), built from examples/ranker.

`llm-serving up --serving-mode standalone` (what `make up MODE=standalone` runs) serves them with the demo LLM on one
Triton, and the serving tests' session Triton (tests/serving/conftest.py) does the same. The ranker is trained here,
at packaging, with the interpreter that has xgboost: `.venv-triton`'s python with the Python backend stub's package
directory on PYTHONPATH (serving_image/triton/local_install.py); training is deterministic (fixed seed and data, one
thread), so the same sources give the same booster, the same package bytes and so the same content-derived version
(dev_packages/versions.py).

The ranker has a second I/O contract, for the rehearsal's versioned rollout (docs/rehearsal.md): `build_ranker(...,
rank=True)` packages the same model with one more output, `rank` (INT32 [n, 1], each row's position by descending
score among its request's rows), appended to examples/ranker/config.pbtxt at packaging; the model computes it when its
config declares it. Same inputs, so an old-format request is answered by both; another I/O fingerprint.
"""

from __future__ import annotations

import json
import os
import subprocess
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from dev_packages.versions import CONTENT_VERSION, build_local_package
from llm_serving.manifest import Backend, ServingMode
from llm_serving.package import PackageSpec, build_package
from llm_serving.repository import REPO_ROOT

RANKER_EXAMPLE = REPO_ROOT / "examples" / "ranker"
RANKER_ID = "ranker"
FEATURES_ID = "ranker-features"
RELEVANCE_ID = "ranker-relevance"
PIPELINE_ID = "ranker-pipeline"
BOOSTER_FILE = "ranker.json"
N_FEATURES = 8
RANK_OUTPUT = "rank"
# What each package's model.py imports beyond the standard library ([python] dependencies, llm_serving/python_deps.py):
# the ranker's xgboost and the scipy xgboost imports (the stub's packages are installed without their dependencies),
# the pipeline steps' numpy. Met by the image's stub and the local one (compat.toml's stub pins).
RANKER_DEPENDENCIES = ("numpy>=1.24", "xgboost==3.0.5", "scipy==1.13.1")
STEP_DEPENDENCIES = ("numpy>=1.24",)
# The output `build_ranker(..., rank=True)` appends to the example's config.pbtxt (protobuf text format: a repeated
# field given again adds to it), computed by examples/ranker/model/model.py when declared.
RANK_OUTPUT_PBTXT = f"""
# The demo ranker's second I/O contract (dev_packages/demo.py, rank=True): each row's 1-based position by
# descending score among the request's rows.
output [
  {{
    name: "{RANK_OUTPUT}"
    data_type: TYPE_INT32
    dims: [ 1 ]
  }}
]
"""


class TrainingError(RuntimeError):
    """examples/ranker/train.py failed; the message holds its output."""


def _stub_python() -> tuple[Path, dict[str, str]]:
    from serving_image.triton.local_install import locate

    python, env = locate().stub_python()
    return python, {**os.environ, **env}


def _train_py(args: list[str], stdin: str | None = None) -> str:
    python, env = _stub_python()
    done = subprocess.run([str(python), str(RANKER_EXAMPLE / "train.py"), *args], env=env, input=stdin,
                          capture_output=True, text=True, timeout=600)
    if done.returncode != 0:
        raise TrainingError(f"examples/ranker/train.py {' '.join(args)} exited with {done.returncode}: "
                            f"{done.stderr.strip()[-2000:]}")
    return done.stdout


def train_ranker(weights: Path) -> Path:
    """Train the ranker into `weights` (a new directory) and return the booster file."""
    _train_py([str(weights)])
    return weights / BOOSTER_FILE


def booster_predictions(booster: Path, features) -> list[float]:
    """The booster's own predictions (xgboost's inplace_predict, outside Triton) for rows of N_FEATURES floats."""
    rows = [[float(v) for v in row] for row in features]
    return json.loads(_train_py(["--predict", str(booster)], json.dumps({"features": rows})))["scores"]


def ranker_config(*, rank: bool = False) -> str:
    """The ranker's config.pbtxt: examples/ranker's, and with `rank` its extra output appended."""
    text = (RANKER_EXAMPLE / "config.pbtxt").read_text()
    return text + RANK_OUTPUT_PBTXT if rank else text


@contextmanager
def _ranker_spec(version: str, *, weights: Path, rank: bool, serving_mode: ServingMode, model_id: str,
                 python_model: Path | None) -> Iterator[PackageSpec]:
    """The ranker's PackageSpec, valid inside the block (its config.pbtxt is written to a temporary directory)."""
    with tempfile.TemporaryDirectory(prefix="ranker-config-") as tmp:
        config = Path(tmp) / "config.pbtxt"
        config.write_text(ranker_config(rank=rank))
        yield PackageSpec(weights, model_id, version, backend=Backend.PYTHON, serving_mode=serving_mode,
                          python_model=python_model or RANKER_EXAMPLE / "model", config_pbtxt=config,
                          python_dependencies=RANKER_DEPENDENCIES)


def build_ranker(out: Path, version: str, *, weights: Path, rank: bool = False,
                 serving_mode: ServingMode = ServingMode.STANDALONE, model_id: str = RANKER_ID,
                 python_model: Path | None = None) -> Path:
    """The ranker's package at `out` (a directory, or a `.tar.gz`) from a trained booster's directory `weights`
    (train_ranker); with `rank`, the second I/O contract (one more output, the same inputs); `python_model` replaces
    examples/ranker's model code (the same I/O)."""
    with _ranker_spec(version, weights=weights, rank=rank, serving_mode=serving_mode, model_id=model_id,
                      python_model=python_model) as spec:
        return build_package(spec, out)


def build_ranker_packages(out: Path, *, version: str | None = None, packed: bool = False,
                          serving_mode: ServingMode = ServingMode.STANDALONE) -> list[Path]:
    """Train the ranker and build its four packages under `out`: the ranker (Python backend, its booster as
    weights), the pipeline's two Python steps and the pipeline (an ensemble naming the three by id and version).
    Without `version`, each package's version is derived from its content (dev_packages/versions.py: what
    `make up` publishes, a new version whenever the bytes change, the serving mode included); the pipeline names its
    steps' versions, so a changed step changes the pipeline's version too. Returns the packages, the ensemble last."""
    out.mkdir(parents=True, exist_ok=True)
    weights = out / "ranker-weights"
    train_ranker(weights)
    pipeline = RANKER_EXAMPLE / "pipeline"

    def build(spec: PackageSpec) -> tuple[Path, str]:
        if version is None:
            built = build_local_package(spec, out, packed=packed)
            return built.path, built.version
        target = out / (f"{spec.model_id}-{version}.tar.gz" if packed else f"{spec.model_id}-{version}")
        return build_package(spec, target), version

    spec_version = version or CONTENT_VERSION
    python = dict(backend=Backend.PYTHON, serving_mode=serving_mode, python_dependencies=STEP_DEPENDENCIES)
    with _ranker_spec(spec_version, weights=weights, rank=False, serving_mode=serving_mode, model_id=RANKER_ID,
                      python_model=None) as spec:
        steps = {RANKER_ID: build(spec)}
    for model_id, step in ((FEATURES_ID, "features"), (RELEVANCE_ID, "relevance")):
        steps[model_id] = build(PackageSpec(None, model_id, spec_version, python_model=pipeline / step / "model.py",
                                            config_pbtxt=pipeline / step / "config.pbtxt", **python))
    ensemble = build(PackageSpec(None, PIPELINE_ID, spec_version, backend=Backend.ENSEMBLE, serving_mode=serving_mode,
                                 ensemble_config=pipeline / "config.pbtxt",
                                 ensemble_steps=tuple((model_id, steps[model_id][1])
                                                      for model_id in (FEATURES_ID, RANKER_ID, RELEVANCE_ID))))
    return [steps[RANKER_ID][0], steps[FEATURES_ID][0], steps[RELEVANCE_ID][0], ensemble[0]]
