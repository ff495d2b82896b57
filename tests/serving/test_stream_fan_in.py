"""serving_image.kserve.stream_fan_in: ModelStreamInfer's fan-in, without a server (the embedded Triton's KServe
tests drive it through gRPC). Each test forces its interleaving with events, never with sleeps."""

from __future__ import annotations

import asyncio
import contextlib

import pytest

from serving_image.kserve.stream_fan_in import fan_in

# a lost wake-up hangs the stream: fail by name well before the suite's 900 s (nothing here waits on anything slow)
pytestmark = pytest.mark.timeout(60)


async def _requests(items, *, after=None):
    for item in items:
        yield item
    if after is not None:
        await after.wait()  # the client's side stays open until the test says so


async def test_every_response_comes_out_each_requests_in_its_order_and_the_stream_ends():
    a_sent = asyncio.Event()

    async def handle(request, emit):
        if request == "a":
            emit("a1")
            a_sent.set()
            await asyncio.sleep(0)
            emit("a2")
        else:
            await a_sent.wait()  # b's responses come between a's
            emit("b1")
            emit("b2")

    got = [r async for r in fan_in(_requests(["a", "b"]), handle)]
    assert sorted(got) == ["a1", "a2", "b1", "b2"]
    assert got.index("a1") < got.index("a2") and got.index("b1") < got.index("b2")


async def test_responses_emitted_while_the_writer_is_held_by_the_consumer_are_all_sent():
    release = asyncio.Event()
    emitted = asyncio.Event()

    async def handle(request, emit):
        emit("first")
        await release.wait()
        for i in range(3):
            emit(f"late{i}")
        emitted.set()

    got = []
    async with contextlib.aclosing(fan_in(_requests(["x"]), handle)) as responses:
        async for response in responses:
            got.append(response)
            if response == "first":  # the consumer holds the writer (gRPC's flow control) while the task emits
                release.set()
                await emitted.wait()
    assert got == ["first", "late0", "late1", "late2"]


async def test_the_stream_stays_open_while_the_client_may_still_send_and_serves_what_it_sends_later():
    more = asyncio.Event()
    close = asyncio.Event()

    async def requests():
        yield "a"
        await more.wait()
        yield "b"
        await close.wait()

    async def handle(request, emit):
        emit(request)

    got = []
    async with contextlib.aclosing(fan_in(requests(), handle)) as responses:
        async for response in responses:
            got.append(response)
            if response == "a":
                more.set()
            if response == "b":
                close.set()
    assert got == ["a", "b"]


async def test_the_client_going_away_cancels_every_running_request_and_their_cleanup_runs():
    started = asyncio.Event()
    cleaned: list[str] = []

    async def handle(request, emit):
        try:
            emit(f"{request} started")
            if request == "b":
                started.set()
            await asyncio.Event().wait()  # a request that would run forever
        finally:
            cleaned.append(request)

    responses = fan_in(_requests(["a", "b"], after=asyncio.Event()), handle)
    got = [await anext(responses)]
    await started.wait()
    got.append(await anext(responses))
    await responses.aclose()  # gRPC closes the handler's generator when the client goes away
    assert sorted(got) == ["a started", "b started"]
    assert sorted(cleaned) == ["a", "b"]


async def test_a_cancelled_writer_cancels_the_requests_too():
    waiting = asyncio.Event()
    cancelled: list[str] = []

    async def handle(request, emit):
        try:
            waiting.set()
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            cancelled.append(request)
            raise

    async def consume():
        async with contextlib.aclosing(fan_in(_requests(["a"], after=asyncio.Event()), handle)) as responses:
            async for _ in responses:
                pass

    consumer = asyncio.ensure_future(consume())
    await waiting.wait()
    consumer.cancel()  # grpc.aio cancels the handler's task when the RPC is cancelled
    with pytest.raises(asyncio.CancelledError):
        await consumer
    assert cancelled == ["a"]
