"""One bidirectional stream, many requests: ModelStreamInfer's fan-in for the KServe gRPC front-end that fronts the
embedded Triton (triton_grpc.py), kept apart because its ordering and cancellation rules are a job of their own.

Each request read from the client's stream is handled by its own task, which emits its responses as they come;
responses of different requests interleave in one outgoing stream, each request's in the order it emitted them.
When the client goes away, every task still running is cancelled (its own cleanup aborts its request), and nothing
is left behind.

`emit` is a plain call that appends to the stream's outbox and wakes the writer: a request's task never waits on
the write (gRPC's flow control holds the writer, the engine's pacing bounds what waits), and the writer sends
everything that waits once it wakes. An asyncio.Queue here was 8 % of the front-end's samples that held the GIL
(py-spy under bench.kserve's load, 2026-12-06).
"""

from __future__ import annotations

import asyncio
import collections
from collections.abc import AsyncIterable, AsyncIterator, Awaitable, Callable
from typing import TypeVar

Request = TypeVar("Request")
Response = TypeVar("Response")
Emit = Callable[[Response], None]


async def fan_in(requests: AsyncIterable[Request],
                 handle: Callable[[Request, Emit], Awaitable[None]]) -> AsyncIterator[Response]:
    """Yield every response that `handle(request, emit)` emits, for every request, as they come; ends when the
    client's stream has ended and every request has been answered."""
    loop = asyncio.get_running_loop()
    outbox: collections.deque = collections.deque()
    tasks: set[asyncio.Task] = set()
    wake: asyncio.Future | None = None
    reading = True

    def wake_writer() -> None:
        if wake is not None and not wake.done():
            wake.set_result(None)

    def emit(response) -> None:
        outbox.append(response)
        wake_writer()

    async def reader() -> None:
        nonlocal reading
        try:
            async for request in requests:
                task = loop.create_task(handle(request, emit))
                tasks.add(task)
                task.add_done_callback(tasks.discard)
            while tasks:
                await asyncio.gather(*list(tasks), return_exceptions=True)
        finally:
            reading = False
            wake_writer()

    read = loop.create_task(reader())
    try:
        while True:
            while outbox:
                yield outbox.popleft()
            if not reading:
                break
            wake = loop.create_future()
            try:
                await wake
            finally:
                wake = None
    finally:
        read.cancel()
        for task in list(tasks):
            task.cancel()  # the client went away: each task's own cleanup aborts its request
        await asyncio.gather(read, *tasks, return_exceptions=True)
