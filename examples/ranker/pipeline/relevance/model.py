"""ranker-relevance: the ranker pipeline's postprocessing step (examples/ranker/pipeline).

The ranker's pairwise score (`score` [n, 1] FP32) becomes a relevance probability (the logistic of the score,
`relevance`) and a decision (`relevant`: score > 0, i.e. relevance > 0.5).
"""

from __future__ import annotations

import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def _one(self, request) -> pb_utils.InferenceResponse:
        score = pb_utils.get_input_tensor_by_name(request, "score").as_numpy().astype(np.float64)
        relevance = (1.0 / (1.0 + np.exp(-score))).astype(np.float32)
        return pb_utils.InferenceResponse([pb_utils.Tensor("relevance", relevance),
                                           pb_utils.Tensor("relevant", score > 0)])

    def execute(self, requests):
        return [self._one(request) for request in requests]
