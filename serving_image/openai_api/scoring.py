"""/v1/score, the platform's extension: the log-probability of each candidate continuation of a prompt."""

from __future__ import annotations

from fastapi.responses import JSONResponse, Response
from starlette.types import Receive

from serving_image.openai_api.protocol import ScoreRequest
from serving_image.openai_api.request_scope import RequestScope
from serving_image.openai_api.state import ServerState
from serving_image.openai_api.streaming import api_error_from
from serving_image.served_model import ModelUnavailableError, RequestInputError


async def score(server: ServerState, scope: RequestScope, body: ScoreRequest, receive: Receive) -> Response:
    # Counted before tokenizing: about two characters a token for the prompt, a token a character for the
    # candidates (at most as many tokens as characters).
    scope.admit(len(body.prompt) // 2 + sum(len(c) for c in body.candidates))
    try:
        scores = await server.served_model.score(body.prompt, body.candidates, scope.request_id)
    except (RequestInputError, ModelUnavailableError) as exc:
        raise api_error_from(exc) from exc
    scope.outcome.output_arrived()  # one answer: first and last output at once
    return JSONResponse({
        "id": scope.request_id, "object": "score", "model": server.model.name,
        "data": [{"index": i, "candidate": c, "logprob": s.logprob, "tokens": s.tokens}
                 for i, (c, s) in enumerate(zip(body.candidates, scores, strict=True))],
    })
