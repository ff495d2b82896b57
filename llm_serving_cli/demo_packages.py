"""The demo packages beside the demo LLM (docs/architecture.md §3.4, "Model kinds"): the XGBoost ranker and the
ranker pipeline (an ensemble over two Python steps and the ranker), built from examples/ranker.

`llm-serving up --serving-mode standalone` (what `make up MODE=standalone` runs) serves them with the demo LLM on one
Triton, and the serving tests' session Triton (tests/serving/conftest.py) does the same. The ranker is trained here,
at packaging, with the interpreter that has xgboost: `.venv-triton`'s python with the Python backend stub's package
directory on PYTHONPATH (serving_image/triton/local_install.py); training is deterministic (fixed seed and data, one
thread), so the same sources give the same booster and the same package version.

The ranker has a second I/O contract, for the rehearsal's versioned rollout (docs/rehearsal.md): `build_ranker(...,
rank=True)` packages the same model with one more output, `rank` (INT32 [n, 1], each row's position by descending
score among its request's rows), appended to examples/ranker/config.pbtxt at packaging; the model computes it when its
config declares it. Same inputs, so an old-format request is answered by both; another I/O fingerprint.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import tempfile
from pathlib import Path

from llm_serving.manifest import Backend, ServingMode
from llm_serving.package import PackageSpec, build_package

REPO = Path(__file__).resolve().parents[1]
RANKER_EXAMPLE = REPO / "examples" / "ranker"
RANKER_ID = "ranker"
FEATURES_ID = "ranker-features"
RELEVANCE_ID = "ranker-relevance"
PIPELINE_ID = "ranker-pipeline"
BOOSTER_FILE = "ranker.json"
N_FEATURES = 8
RANK_OUTPUT = "rank"
# The output `build_ranker(..., rank=True)` appends to the example's config.pbtxt (protobuf text format: a repeated
# field given again adds to it), computed by examples/ranker/model/model.py when declared.
RANK_OUTPUT_PBTXT = f"""
# The demo ranker's second I/O contract (llm_serving_cli/demo_packages.py, rank=True): each row's 1-based position by
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


def _sources_digest(*extra: Path) -> str:
    digest = hashlib.sha256()
    files = [p for p in sorted(RANKER_EXAMPLE.rglob("*")) if p.is_file() and "__pycache__" not in p.parts
             and not any(part.startswith(".") for part in p.relative_to(RANKER_EXAMPLE).parts)]
    for path in [*files, *extra]:
        digest.update(path.name.encode())
        digest.update(path.read_bytes())
    return digest.hexdigest()[:10]


def ranker_config(*, rank: bool = False) -> str:
    """The ranker's config.pbtxt: examples/ranker's, and with `rank` its extra output appended."""
    text = (RANKER_EXAMPLE / "config.pbtxt").read_text()
    return text + RANK_OUTPUT_PBTXT if rank else text


def build_ranker(out: Path, version: str, *, weights: Path, rank: bool = False,
                 serving_mode: ServingMode = ServingMode.STANDALONE, model_id: str = RANKER_ID,
                 python_model: Path | None = None) -> Path:
    """The ranker's package at `out` (a directory, or a `.tar.gz`) from a trained booster's directory `weights`
    (train_ranker); with `rank`, the second I/O contract (one more output, the same inputs); `python_model` replaces
    examples/ranker's model code (the same I/O)."""
    with tempfile.TemporaryDirectory(prefix="ranker-config-") as tmp:
        config = Path(tmp) / "config.pbtxt"
        config.write_text(ranker_config(rank=rank))
        return build_package(PackageSpec(weights, model_id, version, backend=Backend.PYTHON,
                                         serving_mode=serving_mode,
                                         python_model=python_model or RANKER_EXAMPLE / "model",
                                         config_pbtxt=config), out)


def build_ranker_packages(out: Path, *, version: str | None = None, packed: bool = False,
                          serving_mode: ServingMode = ServingMode.STANDALONE) -> list[Path]:
    """Train the ranker and build its four packages under `out`: the ranker (Python backend, its booster as
    weights), the pipeline's two Python steps and the pipeline (an ensemble naming the three by id and version).
    The version defaults to a digest of examples/ranker and the booster, so changed sources give a new one.
    Returns the packages, the ensemble last."""
    out.mkdir(parents=True, exist_ok=True)
    weights = out / "ranker-weights"
    booster = train_ranker(weights)
    version = version or f"local-{_sources_digest(booster)}"
    pipeline = RANKER_EXAMPLE / "pipeline"

    def target(model_id: str) -> Path:
        return out / (f"{model_id}-{version}.tar.gz" if packed else f"{model_id}-{version}")

    python = dict(backend=Backend.PYTHON, serving_mode=serving_mode)
    packages = [
        build_ranker(target(RANKER_ID), version, weights=weights, serving_mode=serving_mode),
        build_package(PackageSpec(None, FEATURES_ID, version, python_model=pipeline / "features" / "model.py",
                                  config_pbtxt=pipeline / "features" / "config.pbtxt", **python), target(FEATURES_ID)),
        build_package(PackageSpec(None, RELEVANCE_ID, version, python_model=pipeline / "relevance" / "model.py",
                                  config_pbtxt=pipeline / "relevance" / "config.pbtxt", **python),
                      target(RELEVANCE_ID)),
    ]
    steps = tuple((model_id, version) for model_id in (FEATURES_ID, RANKER_ID, RELEVANCE_ID))
    packages.append(build_package(PackageSpec(None, PIPELINE_ID, version, backend=Backend.ENSEMBLE,
                                              serving_mode=serving_mode, ensemble_config=pipeline / "config.pbtxt",
                                              ensemble_steps=steps), target(PIPELINE_ID)))
    return packages
