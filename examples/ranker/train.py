"""Train the demo ranker (examples/ranker) on fixed synthetic data, deterministically, and write the booster.

    python train.py OUT_DIR                  writes OUT_DIR/ranker.json (XGBoost's JSON model format)
    python train.py --predict MODEL_JSON     reads {"features": [[...], ...]} on stdin, writes the booster's own
                                             predictions ({"scores": [...]}) on stdout (the tests compare with it)

Runs where xgboost is: the Triton Python backend stub's packages (numpy < 2, xgboost, scipy; the Makefile's
triton-env installs them into the backend's directory), i.e. `.venv-triton/bin/python` with that directory on
PYTHONPATH (serving_image/triton/local_install.py, `LocalTriton.stub_python`). Same seed, same data, one thread:
the same model bytes on every run.

The data: 200 queries of 10 candidates each; 8 raw features per candidate (counts and amounts, >= 0); the ranker sees
them as log1p(raw) (what the pipeline's `ranker-features` step computes); relevance 0-3 from a fixed linear score
of the features plus noise. Objective: pairwise ranking within each query (`rank:pairwise`).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np

N_FEATURES = 8
SEED = 20261201
QUERIES, PER_QUERY = 200, 10
ROUNDS = 30
PARAMS = {"objective": "rank:pairwise", "eta": 0.3, "max_depth": 3, "nthread": 1, "seed": 0,
          "tree_method": "exact", "eval_metric": "ndcg@5"}
WEIGHTS = np.array([1.5, -0.8, 0.6, 0.0, 1.1, -0.3, 0.4, 0.9])
MODEL_FILE = "ranker.json"


def features_from_raw(raw: np.ndarray) -> np.ndarray:
    """What the pipeline's preprocessing step does: raw counts and amounts (>= 0) to the ranker's features."""
    return np.log1p(raw).astype(np.float32)


def synthetic_data() -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    rng = np.random.default_rng(SEED)
    raw = rng.exponential(scale=3.0, size=(QUERIES * PER_QUERY, N_FEATURES))
    features = features_from_raw(raw)
    signal = features.astype(np.float64) @ WEIGHTS + rng.normal(0.0, 0.5, size=len(features))
    labels = np.digitize(signal, np.quantile(signal, [0.5, 0.8, 0.95])).astype(np.float32)
    qid = np.repeat(np.arange(QUERIES), PER_QUERY)
    return features, labels, qid


def train(out_dir: Path) -> Path:
    import xgboost as xgb

    features, labels, qid = synthetic_data()
    dtrain = xgb.DMatrix(features, label=labels, qid=qid, nthread=1)
    booster = xgb.train(PARAMS, dtrain, num_boost_round=ROUNDS)
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / MODEL_FILE
    booster.save_model(str(path))
    return path


def predict(model_json: Path, features: list[list[float]]) -> list[float]:
    import xgboost as xgb

    booster = xgb.Booster(model_file=str(model_json))
    booster.set_param({"nthread": 1})
    batch = np.asarray(features, dtype=np.float32).reshape(-1, N_FEATURES)
    return [float(v) for v in np.asarray(booster.inplace_predict(batch), dtype=np.float32).reshape(-1)]


def main(argv: list[str]) -> int:
    if len(argv) == 2 and argv[0] == "--predict":
        request = json.load(sys.stdin)
        json.dump({"scores": predict(Path(argv[1]), request["features"])}, sys.stdout)
        return 0
    if len(argv) != 1 or argv[0].startswith("-"):
        print(__doc__, file=sys.stderr)
        return 2
    print(train(Path(argv[0])))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
