"""What the request handlers of one OpenAI front-end share, kept on `app.state.server`.

The handlers are module-level functions (app.py, generation.py, ...), not closures over `create_app`'s arguments:
each one finds the engine, the limits and the admission counters here, and opens the scope of its request from here.
The request metrics are Triton's own (it counts every request the engine sends it), not kept here.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from fastapi import Request

from serving_image.openai_api.admission import Admission, APIConfig
from serving_image.openai_api.protocol import Endpoint
from serving_image.openai_api.request_scope import RequestScope
from serving_image.served_model import ModelInfo, ServedModel


@dataclass(frozen=True)
class ServerState:
    served_model: ServedModel
    config: APIConfig
    admission: Admission  # the requests and tokens in flight, over every endpoint
    is_draining: Callable[[], bool]  # True once the server is shutting down: readiness and new requests get 503

    @property
    def model(self) -> ModelInfo:
        """The served model."""
        return self.served_model.info

    def open_request(self, endpoint: Endpoint) -> RequestScope:
        return RequestScope(endpoint, self.model, self.admission)


def server_state(request: Request) -> ServerState:
    return request.app.state.server
