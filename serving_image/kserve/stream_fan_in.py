"""One bidirectional stream, many requests: ModelStreamInfer's fan-in for the KServe gRPC front-end that fronts the
embedded Triton (triton_grpc.py), kept apart because its ordering and cancellation rules are a job of their own.

Each request read from the client's stream is handled by its own task, which emits its responses as they come;
responses of different requests interleave in one outgoing stream. When the client goes away, every task still
running is cancelled (its own cleanup aborts its request), and nothing is left behind.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterable, AsyncIterator, Awaitable, Callable
from typing import TypeVar

Request = TypeVar("Request")
Response = TypeVar("Response")
Emit = Callable[[Response], Awaitable[None]]


async def fan_in(requests: AsyncIterable[Request],
                 handle: Callable[[Request, Emit], Awaitable[None]]) -> AsyncIterator[Response]:
    """Yield every response that `handle(request, emit)` emits, for every request, as they come; ends when the
    client's stream has ended and every request has been answered."""
    queue: asyncio.Queue = asyncio.Queue()
    tasks: set[asyncio.Task] = set()
    done = object()

    async def reader() -> None:
        try:
            async for request in requests:
                task = asyncio.create_task(handle(request, queue.put))
                tasks.add(task)
                task.add_done_callback(tasks.discard)
            while tasks:
                await asyncio.gather(*list(tasks), return_exceptions=True)
        finally:
            await queue.put(done)

    read = asyncio.create_task(reader())
    try:
        while True:
            item = await queue.get()
            if item is done:
                break
            yield item
    finally:
        read.cancel()
        for task in list(tasks):
            task.cancel()  # the client went away: each task's own cleanup aborts its request
        await asyncio.gather(read, *tasks, return_exceptions=True)
