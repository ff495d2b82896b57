"""Stores a batch run's line results in chunks: the worker's lanes hand each result over and go on to their next line;
the writer puts what has gathered as one object (storage.BatchStorage.put_results) once MAX_LINES are waiting or the
oldest has waited MAX_WAIT_S, and when the run ends.

Why: one store object per line was most of the worker's CPU (a put is an S3 request in production, a file created and
synced locally: about 0.4-0.7 ms of CPU each on the 2-core machine, where the worker shares the cores the engine
needs; docs/batch.md, "Measured"). The cache entries stay one object a line (each is read by its own content
address) and are written, in parallel threads, before the chunk that holds their results: a worker killed between
the two sends those lines again, under the same cache keys.

Ordering rules:
- A result counts (`on_stored`, the run's request_counts, /metrics) only once its chunk is stored.
- `add` waits while MAX_LINES results wait already and a chunk is being written: memory stays bounded when the
  store is slow.
- `close` stores everything still waiting; the run finalizes only after it. A chunk the timer is writing when
  `close` comes is finished, never abandoned (cancelled mid-write, its lines were taken from the waiting ones and
  stored nowhere), and what it raised is raised by `close`.
- A killed worker loses at most the results not yet stored; a resumed run sends those lines again (their indexes are
  not among the stored ones), so each line is still answered exactly once.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable

from serving_image.batch.records import LineResult
from serving_image.batch.storage import BatchStorage

MAX_LINES = 32  # a chunk: at this worker's rates (100-200 lines/s here) about one object every 0.2 s
MAX_WAIT_S = 0.25  # a result waits at most this long (plus one store put) before it is stored


class ResultWriter:
    def __init__(self, storage: BatchStorage, batch_id: str, *, on_stored: Callable[[list[LineResult]], None],
                 put_chunk: Callable[[list[LineResult]], None] | None = None,
                 max_lines: int = MAX_LINES, max_wait_s: float = MAX_WAIT_S):
        """`put_chunk` stores one chunk on a worker thread (default: storage.put_results); `on_stored` runs on the
        event loop after each chunk is stored."""
        self.storage = storage
        self.batch_id = batch_id
        self.on_stored = on_stored
        self.put_chunk = put_chunk or (lambda chunk: storage.put_results(batch_id, chunk))
        self.max_lines = max_lines
        self.max_wait_s = max_wait_s
        self._waiting: list[tuple[LineResult, Callable[[], object] | None]] = []
        self._oldest = 0.0
        self._lock = asyncio.Lock()  # one chunk written at a time
        self._timer: asyncio.Task | None = None
        self._timer_writing = False  # the timer is in flush(): it holds a chunk taken from the waiting ones
        self._closing = False

    async def add(self, result: LineResult, cache: Callable[[], object] | None = None) -> None:
        """Hand over one result (and its cache write, run before the chunk is stored). Raises what a chunk written on
        the timer raised: a store that fails stops the run (the lines not stored are sent again by the next one)."""
        if self._timer is not None and self._timer.done() and not self._timer.cancelled() \
                and self._timer.exception() is not None:
            raise self._timer.exception()
        if not self._waiting:
            self._oldest = time.monotonic()
        self._waiting.append((result, cache))
        if len(self._waiting) >= self.max_lines:
            await self.flush()
        elif self._timer is None or self._timer.done():
            self._timer = asyncio.create_task(self._flush_when_due())

    async def flush(self) -> None:
        """Store everything waiting now (and what gathers while an earlier chunk is being written)."""
        async with self._lock:
            chunk, self._waiting = self._waiting, []
            if not chunk:
                return
            caches = [cache for _, cache in chunk if cache is not None]
            if caches:
                await asyncio.gather(*(asyncio.to_thread(cache) for cache in caches))
            results = [result for result, _ in chunk]
            await asyncio.to_thread(self.put_chunk, results)
            self.on_stored(results)

    async def close(self) -> None:
        self._closing = True
        timer, self._timer = self._timer, None
        if timer is not None:
            if self._timer_writing:
                await timer  # its chunk is stored (or its failure raised) before anything else
            elif not timer.done():
                timer.cancel()  # only sleeping: what it waited for is stored below
                with contextlib.suppress(asyncio.CancelledError):
                    await timer
            elif not timer.cancelled() and timer.exception() is not None:
                raise timer.exception()
        await self.flush()

    async def _flush_when_due(self) -> None:
        while self._waiting and not self._closing:
            due = self._oldest + self.max_wait_s - time.monotonic()
            if due > 0:
                await asyncio.sleep(due)
                continue
            self._timer_writing = True
            try:
                await self.flush()
            finally:
                self._timer_writing = False
