"""ranker: an XGBoost ranking booster served by Triton's Python backend (examples/ranker).

Triton's dynamic batcher hands `execute` several requests at once; their `features` rows ([n, 8] FP32 each) are
scored together with one `Booster.inplace_predict` and split back per request as `score` ([n, 1] FP32). xgboost comes
from the stub's environment (the Python backend's directory, where the Makefile's triton-env installs it beside the
stub's numpy < 2). The booster file is `ranker.json` in the package's weights (config parameter `weights_dir`).

When config.pbtxt also declares the output `rank` (INT32 [n, 1]; the demo's second I/O contract, version 1.1.0 in
dev_packages/demo.py), each response carries it too: every row's 1-based position among its request's rows
by descending score, ties in row order.
"""

from __future__ import annotations

import json
import os

import numpy as np
import triton_python_backend_utils as pb_utils
import xgboost as xgb

MODEL_FILE = "ranker.json"
RANK_OUTPUT = "rank"


def _error(message: str) -> pb_utils.InferenceResponse:
    return pb_utils.InferenceResponse(output_tensors=[],
                                      error=pb_utils.TritonError(message, pb_utils.TritonError.INVALID_ARG))


class TritonPythonModel:
    def initialize(self, args):
        config = json.loads(args["model_config"])
        parameters = {k: v["string_value"] for k, v in config.get("parameters", {}).items()}
        if "weights_dir" not in parameters:
            raise ValueError("ranker: the package has no weights (config parameter 'weights_dir' is missing)")
        path = os.path.join(parameters["weights_dir"], MODEL_FILE)
        if not os.path.isfile(path):
            raise ValueError(f"ranker: no booster at {path} (train it with examples/ranker/train.py)")
        self.booster = xgb.Booster(model_file=path)
        self.booster.set_param({"nthread": 1})
        declared = [i for i in config["input"] if i["name"] == "features"][0]["dims"]
        self.n_features = int(declared[-1])
        if self.booster.num_features() != self.n_features:
            raise ValueError(f"ranker: the booster takes {self.booster.num_features()} features, config.pbtxt "
                             f"declares {self.n_features}")
        self.with_rank = any(o["name"] == RANK_OUTPUT for o in config["output"])

    def _rows(self, request) -> np.ndarray:
        tensor = pb_utils.get_input_tensor_by_name(request, "features")
        if tensor is None:
            raise ValueError("input 'features' is missing")
        rows = tensor.as_numpy()
        if rows.ndim != 2 or rows.shape[1] != self.n_features:
            raise ValueError(f"input 'features' must be [batch, {self.n_features}], got {list(rows.shape)}")
        bad = np.argwhere(np.isinf(rows))
        if len(bad):
            raise ValueError(f"input 'features' row {bad[0][0]} column {bad[0][1]} is infinite")
        return rows

    def execute(self, requests):
        responses: list = [None] * len(requests)
        batch, owners = [], []
        for i, request in enumerate(requests):
            try:
                rows = self._rows(request)
            except ValueError as exc:
                responses[i] = _error(str(exc))
                continue
            batch.append(rows)
            owners.append((i, len(rows)))
        if batch:
            scores = np.asarray(self.booster.inplace_predict(np.concatenate(batch)), dtype=np.float32).reshape(-1, 1)
            start = 0
            for i, count in owners:
                mine = scores[start:start + count]
                tensors = [pb_utils.Tensor("score", mine)]
                if self.with_rank:
                    tensors.append(pb_utils.Tensor(RANK_OUTPUT, ranks(mine)))
                responses[i] = pb_utils.InferenceResponse(tensors)
                start += count
        return responses


def ranks(scores: np.ndarray) -> np.ndarray:
    """[n, 1] scores -> [n, 1] INT32: each row's 1-based position by descending score, ties in row order."""
    order = np.argsort(-scores.reshape(-1), kind="stable")
    out = np.empty(len(order), dtype=np.int32)
    out[order] = np.arange(1, len(order) + 1, dtype=np.int32)
    return out.reshape(-1, 1)
