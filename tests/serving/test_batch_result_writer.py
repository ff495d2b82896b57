"""The batch worker's result writer (serving_image/batch/result_writer.py): results stored in chunks, counted only
once stored, the waiting bounded, nothing left unstored at close, a store failure not swallowed. The store is the
real directory store; the waits are forced with events, not timed."""

from __future__ import annotations

import asyncio
import threading

import pytest

from llm_serving.object_store import DirectoryStore
from serving_image.batch.records import LineResult
from serving_image.batch.result_writer import ResultWriter
from serving_image.batch.storage import BatchStorage

BATCH = "batch_w"


def _result(index: int) -> LineResult:
    return LineResult(index=index, custom_id=f"c{index}", kind="output" if index % 2 == 0 else "error", line={})


def _writer(tmp_path, **kwargs) -> tuple[ResultWriter, BatchStorage, list[list[int]]]:
    storage = BatchStorage(DirectoryStore(tmp_path))
    counted: list[list[int]] = []
    writer = ResultWriter(storage, BATCH, on_stored=lambda chunk: counted.append([r.index for r in chunk]), **kwargs)
    return writer, storage, counted


async def test_a_full_chunk_is_stored_at_once_and_counted_after_it_is_stored(tmp_path):
    writer, storage, counted = _writer(tmp_path, max_lines=3, max_wait_s=3600)
    cache_writes: list[int] = []
    for i in range(2):
        await writer.add(_result(i), lambda i=i: cache_writes.append(i))
    assert storage.done_indexes(BATCH) == set() and counted == []  # waiting: neither stored nor counted
    await writer.add(_result(2))
    assert storage.done_indexes(BATCH) == {0, 1, 2} and counted == [[0, 1, 2]]
    assert sorted(cache_writes) == [0, 1]  # the cache entries were written with their chunk
    assert len(list((tmp_path / "batches" / BATCH / "results").iterdir())) == 1
    await writer.add(_result(3))
    await writer.close()  # what still waits is stored at close
    assert storage.done_indexes(BATCH) == {0, 1, 2, 3} and counted == [[0, 1, 2], [3]]


async def test_a_result_waits_at_most_max_wait_s_before_it_is_stored(tmp_path):
    writer, storage, counted = _writer(tmp_path, max_lines=100, max_wait_s=0.01)
    await writer.add(_result(7))
    while not counted:  # stored by the timer, without another add or a close
        await asyncio.sleep(0.01)
    assert storage.done_indexes(BATCH) == {7}
    await writer.close()
    assert counted == [[7]]


async def test_adding_waits_while_a_full_chunk_waits_behind_a_slow_store(tmp_path):
    putting, release = threading.Event(), threading.Event()
    storage = BatchStorage(DirectoryStore(tmp_path))

    def slow_put(chunk: list[LineResult]) -> None:
        putting.set()
        release.wait(timeout=60)
        storage.put_results(BATCH, chunk)

    writer = ResultWriter(storage, BATCH, on_stored=lambda chunk: None, put_chunk=slow_put, max_lines=2,
                          max_wait_s=3600)
    await writer.add(_result(0))
    first_chunk = asyncio.create_task(writer.add(_result(1)))  # full: this add writes the chunk (held by the store)
    await asyncio.to_thread(putting.wait, 60)  # the first chunk is in the store, and stays there until released
    await writer.add(_result(2))  # one waiting: returns at once
    blocked = asyncio.create_task(writer.add(_result(3)))  # a full chunk again: waits for the first to be stored
    await asyncio.sleep(0)  # one turn of the loop: `blocked` runs until it waits (an add that did not wait is done)
    assert not first_chunk.done() and not blocked.done()
    release.set()
    await asyncio.gather(first_chunk, blocked)
    await writer.close()
    assert storage.done_indexes(BATCH) == {0, 1, 2, 3}


async def test_a_store_failure_on_the_timer_stops_the_next_add(tmp_path):
    def failing_put(chunk: list[LineResult]) -> None:
        raise OSError("store unreachable")

    writer = ResultWriter(BatchStorage(DirectoryStore(tmp_path)), BATCH, on_stored=lambda chunk: None,
                          put_chunk=failing_put, max_lines=100, max_wait_s=0.0)
    await writer.add(_result(0))
    while not writer._timer.done():
        await asyncio.sleep(0.01)
    with pytest.raises(OSError, match="store unreachable"):
        await writer.add(_result(1))


async def test_close_finishes_the_chunk_the_timer_is_writing(tmp_path):
    """The race of a resumed run (seen in a fresh clone's suite): the lanes are done and `close` comes while the
    timer is writing its chunk. That chunk's lines are no longer waiting; abandoning its write lost them, and the
    batch completed with fewer results than lines. Forced: the timer's cache write is held until close has begun."""
    writing, release = threading.Event(), threading.Event()

    def held_cache_write() -> None:
        writing.set()
        release.wait(timeout=60)

    writer, storage, counted = _writer(tmp_path, max_lines=100, max_wait_s=0.0)
    await writer.add(_result(0), held_cache_write)
    await asyncio.to_thread(writing.wait, 60)  # the timer has taken [0] and is writing its cache entry
    await writer.add(_result(1))  # waiting behind it
    closing = asyncio.create_task(writer.close())
    await asyncio.sleep(0)  # one turn of the loop: close runs until it waits for the chunk the timer holds
    assert not closing.done() and not release.is_set()  # close waits for the chunk in flight; it does not cancel it
    release.set()
    await closing
    assert storage.done_indexes(BATCH) == {0, 1}
    assert sorted(i for chunk in counted for i in chunk) == [0, 1]


async def test_close_raises_what_the_timers_chunk_raised(tmp_path):
    writing, release = threading.Event(), threading.Event()

    def failing_put(chunk: list[LineResult]) -> None:
        writing.set()
        release.wait(timeout=60)
        raise OSError("store unreachable")

    writer = ResultWriter(BatchStorage(DirectoryStore(tmp_path)), BATCH, on_stored=lambda chunk: None,
                          put_chunk=failing_put, max_lines=100, max_wait_s=0.0)
    await writer.add(_result(0))
    await asyncio.to_thread(writing.wait, 60)
    closing = asyncio.create_task(writer.close())
    await asyncio.sleep(0)
    release.set()
    with pytest.raises(OSError, match="store unreachable"):
        await closing
