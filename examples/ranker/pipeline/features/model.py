"""ranker-features: the ranker pipeline's preprocessing step (examples/ranker/pipeline).

Raw candidate features (counts and amounts, `raw` [n, 8] FP32, each >= 0) become the ranker's features:
log1p(raw), the transformation the ranker was trained on (examples/ranker/train.py, `features_from_raw`).
"""

from __future__ import annotations

import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def _one(self, request) -> pb_utils.InferenceResponse:
        raw = pb_utils.get_input_tensor_by_name(request, "raw").as_numpy()
        bad = np.argwhere(~(raw >= 0))  # negative, NaN
        if len(bad):
            r, c = bad[0]
            return pb_utils.InferenceResponse(output_tensors=[], error=pb_utils.TritonError(
                f"input 'raw' row {r} column {c} is {raw[r, c]}: raw features are counts and amounts (>= 0)",
                pb_utils.TritonError.INVALID_ARG))
        return pb_utils.InferenceResponse([pb_utils.Tensor("features", np.log1p(raw).astype(np.float32))])

    def execute(self, requests):
        return [self._one(request) for request in requests]
