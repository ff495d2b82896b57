"""/v1/embeddings: one vector per input, as floats or as base64 of little-endian float32 (OpenAI's encodings)."""

from __future__ import annotations

import base64
import struct

from fastapi.responses import JSONResponse, Response
from starlette.types import Receive

from serving_image.openai_api.errors import bad_request
from serving_image.openai_api.protocol import EmbeddingRequest
from serving_image.openai_api.request_scope import RequestScope
from serving_image.openai_api.state import ServerState
from serving_image.openai_api.streaming import api_error_from
from serving_image.served_model import ModelUnavailableError, RequestInputError


async def embed(server: ServerState, scope: RequestScope, body: EmbeddingRequest, receive: Receive) -> Response:
    model = server.model
    if model.embedding_dim is None:
        raise bad_request(f"model {model.name} does not serve embeddings (its package's engine.tasks has no "
                          "'embed')", param="model", code="embeddings_not_served")
    if body.dimensions is not None and body.dimensions != model.embedding_dim:
        raise bad_request(f"dimensions {body.dimensions}: this model's embeddings have {model.embedding_dim} "
                          "dimensions and are not truncated", param="dimensions")
    raw = body.input
    items = [raw] if isinstance(raw, str) or (raw and isinstance(raw[0], int)) else list(raw)
    for i, item in enumerate(items):
        if isinstance(item, list) and any(not 0 <= t < model.vocab_size for t in item):
            name = f"input[{i}]" if len(items) > 1 else "input"
            raise bad_request(f"{name}: token ids must be in 0..{model.vocab_size - 1}", param=name)
    # Text is not tokenized here: admission counts about two characters a token.
    scope.admit(sum(len(i) if isinstance(i, list) else len(i) // 2 + 1 for i in items))
    try:
        vectors = await server.served_model.embed(items, scope.request_id)
    except (RequestInputError, ModelUnavailableError) as exc:
        raise api_error_from(exc) from exc
    scope.outcome.output_arrived()  # one answer: first and last output at once
    scope.outcome.prompt_tokens = sum(v.prompt_tokens for v in vectors)
    data = []
    for i, vector in enumerate(vectors):
        if body.encoding_format == "base64":
            value = base64.b64encode(struct.pack(f"<{len(vector.vector)}f", *vector.vector)).decode()
        else:
            value = list(vector.vector)
        data.append({"object": "embedding", "index": i, "embedding": value})
    return JSONResponse({"object": "list", "data": data, "model": model.name,
                         "usage": {"prompt_tokens": scope.outcome.prompt_tokens,
                                   "total_tokens": scope.outcome.prompt_tokens}})
