"""Reading one request's responses off a KServe v2 `ModelStreamInfer` stream (docs/kserve.md): every response
carries the `triton_final_response` parameter, and a request is done at the response where it is true (the backend
sends it with the last data, or alone with `enable_empty_final_response`). The server sets it
(serving_image/kserve/triton_grpc.py); the served model, the rehearsal's traffic, the benchmarks and the tests read
it, with NVIDIA's tritonclient, through these helpers.

Standard library only, and duck-typed on tritonclient's `InferResult` (`get_response()` gives the
`ModelInferResponse`): nothing here imports tritonclient, so both planes may import it.
"""

from __future__ import annotations

import queue
from collections.abc import AsyncIterable, AsyncIterator, Iterator
from typing import Any

FINAL_PARAMETER = "triton_final_response"


def is_final(result: Any) -> bool:
    """Whether a tritonclient `InferResult` (or a bare `ModelInferResponse`) is its request's last response."""
    response = result.get_response() if hasattr(result, "get_response") else result
    return response.parameters[FINAL_PARAMETER].bool_param


def until_final(responses: queue.Queue, timeout: float, *, finals: int = 1) -> Iterator[tuple[Any, Any]]:
    """The `(result, error)` pairs a blocking tritonclient's stream callback put on `responses`
    (`client.start_stream(callback=lambda result, error: responses.put((result, error)))`), up to and including the
    final response of `finals` requests. Waits at most `timeout` seconds for each pair (queue.Empty when none came);
    an error ends nothing: the caller decides (raise, return, stop reading)."""
    seen = 0
    while True:
        result, error = responses.get(timeout=timeout)
        yield result, error
        if error is None and is_final(result):
            seen += 1
            if seen >= finals:
                return


async def until_final_async(stream: AsyncIterable[tuple[Any, Any]]) -> AsyncIterator[tuple[Any, Any]]:
    """The `(result, error)` pairs of tritonclient's asyncio `stream_infer(...)` up to and including the first final
    response; stops there even though the stream stays open (a client's request side usually does). An error ends
    nothing: the caller decides. Closing the stream (its `cancel()`) stays the caller's job."""
    async for result, error in stream:
        yield result, error
        if error is None and is_final(result):
            return
