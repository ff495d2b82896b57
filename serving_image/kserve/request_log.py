"""The KServe gRPC front-end's request record: one JSON line per ModelInfer and per request of a ModelStreamInfer, on
the logger `llm_serving.kserve_requests`, the counterpart of the OpenAI front-end's `llm_serving.requests` record.

It carries the caller's trace id (from the `traceparent` gRPC metadata) and experiment arm, so a caller's trace
joins this record as it joins the OpenAI one (docs/clients.md, "Traces and per-stage records"), and its own
stages: when the first and the last response left Triton. It never holds tensors.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import time
from collections.abc import Iterable

from serving_image.request_context import EXPERIMENT_HEADER, count_experiment, experiment_from, trace_id_from

request_log = logging.getLogger("llm_serving.kserve_requests")


def metadata_dict(metadata: Iterable[tuple[str, str | bytes]] | None) -> dict[str, str]:
    return {k.lower(): v.decode() if isinstance(v, bytes) else v for k, v in (metadata or ())}


@dataclasses.dataclass
class KServeRecord:
    rpc: str
    request_id: str
    model: str
    model_version: str  # as the request names it ("" = Triton's policy picks)
    trace_id: str | None
    experiment: str | None
    status: str = "OK"  # the gRPC status code's name; for a request of a stream, OK or ERROR (its error_message)
    duration_s: float = 0.0
    first_response_s: float | None = None
    last_response_s: float | None = None
    _started: float = dataclasses.field(default_factory=time.perf_counter, repr=False)

    @classmethod
    def open(cls, rpc: str, request, metadata: dict[str, str]) -> KServeRecord:
        """Raises ValueError naming the header for a malformed experiment arm (the front-end answers
        INVALID_ARGUMENT)."""
        return cls(rpc, request.id, request.model_name, request.model_version,
                   trace_id_from(metadata.get("traceparent")), experiment_from(metadata.get(EXPERIMENT_HEADER)))

    def response_left(self) -> None:
        now = round(time.perf_counter() - self._started, 4)
        if self.first_response_s is None:
            self.first_response_s = now
        self.last_response_s = now

    def close(self) -> None:
        self.duration_s = round(time.perf_counter() - self._started, 4)
        record = {k: v for k, v in dataclasses.asdict(self).items() if not k.startswith("_")}
        request_log.info(json.dumps(record))
        count_experiment(self.experiment, "kserve_grpc", self.status)
