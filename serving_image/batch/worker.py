"""The batch worker: runs every batch in the store through the platform's own served path (docs/batch.md).

It is a client of the model's OpenAI endpoint, not an engine of its own: each request line is POSTed to the
real-time endpoint (the same validation, admission, Triton and vLLM, the same `nv_*` and vLLM metrics and request
log), marked `x-llm-serving-priority: batch` so that the front-end admits it only within the batch share of its
budget (serving_image/openai_api/admission.py), at most `concurrency` at a time. A 429 or 503 (busy, draining,
restarting) and a refused connection are retried, never turned into a result: real-time traffic keeps its room and
a restarting server loses nothing.

Durability: each line's result is stored within a fraction of a second of being known, in chunks
(result_writer.py, storage.py; each result keeps its line index); a worker started again (or another replica) reads
the results already there and sends only the other lines, and finalize merges the results by index. A line in flight
or not yet stored when the worker dies is sent again; every custom_id is in the output exactly once.

Run: `python -m serving_image.batch.worker --store URI --endpoint http://host:9000` (the API key from
LLM_SERVING_BATCH_WORKER_API_KEY).
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import functools
import json
import logging
import os
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta

from llm_serving.batch_cache import CacheSource, ResultCache
from llm_serving.caller_key import key_from_env
from llm_serving.object_store import open_object_store
from llm_serving.pod_contract import ENV_BATCH_KMS_KEY, ENV_BATCH_WORKER_API_KEY, ENV_BATCH_WORKER_API_KEY_FILE
from serving_image.batch import metrics
from serving_image.batch.endpoint import AiohttpEndpoint, Answer, Endpoint, EndpointUnreachable
from serving_image.batch.lines import BadLine, RequestLine, error_line, output_line, parse_line, request_lines
from serving_image.batch.records import (
    TERMINAL,
    BatchErrorItem,
    BatchErrors,
    BatchObject,
    FileObject,
    LineResult,
    StoredBatch,
    StoredFile,
    output_file_id,
)
from serving_image.batch.result_writer import ResultWriter
from serving_image.batch.storage import BatchStorage
from serving_image.openai_api.admission import PRIORITY_HEADER

log = logging.getLogger("llm_serving.batch")

# Test hook: the worker SIGKILLs itself right after storing this many results (tests/serving/test_batch_api.py
# forces a kill at an exact point this way instead of racing a timer).
ENV_KILL_AFTER = "LLM_SERVING_BATCH_WORKER_KILL_AFTER"
RETRY_STATUSES = (429, 502, 503, 504)


@dataclass
class WorkerConfig:
    endpoint_url: str  # the model's OpenAI endpoint, e.g. http://127.0.0.1:9000
    api_key: str | None = None
    concurrency: int = 8
    poll_s: float = 1.0
    progress_every_s: float = 0.5  # how often the batch record's request_counts are written while it runs
    retry_s: float = 0.5
    kill_after: int | None = None
    cache_retention: timedelta | None = None


@dataclass
class _Run:
    """One batch's run in this process."""

    record: StoredBatch
    completed: int = 0
    failed: int = 0
    stop: str | None = None  # "cancelled" or "expired" once the run must stop taking lines
    model_version: str | None = None
    in_flight: set[int] = field(default_factory=set)
    writer: ResultWriter | None = None

    def count(self, stored: list[LineResult]) -> None:
        """Results stored (ResultWriter's on_stored): into request_counts."""
        for result in stored:
            if result.kind == "output":
                self.completed += 1
            else:
                self.failed += 1


class BatchWorker:
    def __init__(self, storage: BatchStorage, config: WorkerConfig, http: Endpoint | None = None):
        self.storage = storage
        self.config = config
        self.cache = ResultCache(storage.store, retention=config.cache_retention)
        headers = {PRIORITY_HEADER: "batch"}
        if config.api_key:
            headers["Authorization"] = f"Bearer {config.api_key}"
        self.http = http or AiohttpEndpoint(config.endpoint_url, headers)
        self.results_written = 0  # in this process, over every batch, counted for ENV_KILL_AFTER only
        self._kill_lock = threading.Lock()

    async def run_forever(self, exit_when_idle: bool = False) -> None:
        while True:
            worked = await self.run_once()
            if not worked and exit_when_idle:
                return
            if not worked:
                await asyncio.sleep(self.config.poll_s)

    async def run_once(self) -> list[str]:
        """Work every active batch to a terminal state; returns their ids."""
        done = []
        for batch_id in self.storage.active_batch_ids():
            await self.process(batch_id)
            done.append(batch_id)
        return done

    async def process(self, batch_id: str) -> None:
        record = self.storage.get_batch(batch_id)
        if record is None or record.batch.status in TERMINAL:
            self.storage.store.delete(f"active/{batch_id}")
            return
        content = self.storage.file_content(record.batch.input_file_id)
        if content is None:
            return self._fail(record, "input_file_missing",
                              f"input file {record.batch.input_file_id} was deleted before the batch ran")
        lines = request_lines(content)
        parsed = [parse_line(i, text, record.batch.endpoint) for i, text in enumerate(lines)]
        if record.batch.status == "validating":
            if not self._validate(record, parsed):
                return
        run = _Run(record)
        run.writer = ResultWriter(self.storage, batch_id, on_stored=run.count,
                                  put_chunk=functools.partial(self._put_chunk, record.batch))
        stored = self.storage.results(batch_id)
        run.completed = sum(1 for r in stored if r.kind == "output")
        run.failed = len(stored) - run.completed
        done = {r.index for r in stored}
        if record.batch.status == "cancelling":
            return self._finalize(run, "cancelled")
        if record.batch.status in ("in_progress",):
            pending = collections.deque(p for p in parsed if p.index not in done)
            if record.batch.expires_at is not None and time.time() >= record.batch.expires_at:
                run.stop = "expired"  # past its window before this run began (a worker down for a day)
            if pending and run.stop is None:
                run.model_version = await self._served_version()
                await self._execute(run, pending)
            if run.stop == "expired":
                # OpenAI's rule: an expired batch's unrun lines are error lines; what it answered is kept.
                answered = self.storage.done_indexes(batch_id)
                for p in parsed:
                    if p.index not in answered:
                        await run.writer.add(self._bad_result(run, BadLine(p.index, p.custom_id, "batch_expired",
                                                                           "the batch expired before this line ran",
                                                                           None)))
            await run.writer.close()
        self._finalize(run, run.stop or "completed")

    # -- validating ---------------------------------------------------------------------------------------------

    def _validate(self, record: StoredBatch, parsed: list[RequestLine | BadLine]) -> bool:
        """Batch-level checks (per-line problems become error lines later): every custom_id once."""
        first_seen: dict[str, int] = {}
        problems = []
        for p in parsed:
            if p.custom_id is None:
                continue
            if p.custom_id in first_seen:
                problems.append(BatchErrorItem(code="duplicate_custom_id", param="custom_id", line=p.index + 1,
                                               message=f"line {p.index + 1}: custom_id '{p.custom_id}' is already "
                                                       f"used by line {first_seen[p.custom_id] + 1}"))
            else:
                first_seen[p.custom_id] = p.index
        batch = record.batch
        if problems:
            batch.errors = BatchErrors(data=problems[:100])
            batch.status, batch.failed_at = "failed", int(time.time())
            self.storage.save_batch(record)
            metrics.BATCHES.labels(batch.endpoint, "failed").inc()
            return False
        batch.request_counts.total = len(parsed)
        batch.status, batch.in_progress_at = "in_progress", int(time.time())
        self.storage.save_batch(record)
        return True

    def _fail(self, record: StoredBatch, code: str, message: str) -> None:
        record.batch.errors = BatchErrors(data=[BatchErrorItem(code=code, message=message)])
        record.batch.status, record.batch.failed_at = "failed", int(time.time())
        self.storage.save_batch(record)
        metrics.BATCHES.labels(record.batch.endpoint, "failed").inc()

    # -- in progress --------------------------------------------------------------------------------------------

    async def _served_version(self) -> str | None:
        """The served model's version (its readiness answer), for the cache key; None while the server is down."""
        try:
            answer = await self.http.get("/health/ready")
            return answer.json().get("version") if answer.status == 200 else None
        except EndpointUnreachable:
            return None

    async def _execute(self, run: _Run, pending: collections.deque) -> None:
        monitor = asyncio.create_task(self._monitor(run))
        try:
            await asyncio.gather(*(self._lane(run, pending) for _ in range(self.config.concurrency)))
            await run.writer.close()  # every answer stored before the counts and before finalize
        finally:
            monitor.cancel()
            await asyncio.gather(monitor, return_exceptions=True)
        self._save_counts(run)

    async def _lane(self, run: _Run, pending: collections.deque) -> None:
        expires_at = run.record.batch.expires_at
        while pending and run.stop is None:
            if expires_at is not None and time.time() >= run.record.batch.expires_at:
                run.stop = "expired"  # checked before every line: none starts after the window (the monitor may lag)
                break
            parsed = pending.popleft()
            run.in_flight.add(parsed.index)
            try:
                answered = await self._run_line(run, parsed)
            finally:
                run.in_flight.discard(parsed.index)
            if answered is not None:
                await run.writer.add(*answered)

    async def _run_line(self, run: _Run, parsed: RequestLine | BadLine) -> tuple[LineResult, Callable | None] | None:
        """The line's result, and the cache write that goes with it (stored before the result, ResultWriter)."""
        if isinstance(parsed, BadLine):
            return self._bad_result(run, parsed), None
        batch = run.record.batch
        started = time.perf_counter()
        while run.stop is None:
            try:
                answer = await self.http.post(batch.endpoint, parsed.body)
            except EndpointUnreachable as exc:  # the server restarting or unreachable: the line waits
                log.warning("batch %s line %d: %s; retrying", batch.id, parsed.index, exc)
                await asyncio.sleep(self.config.retry_s)
                continue
            if answer.status in RETRY_STATUSES:
                await asyncio.sleep(_retry_after(answer, self.config.retry_s))
                continue
            try:
                body = answer.json()
            except ValueError:
                body = {"error": {"message": answer.text[:1000], "type": "server_error", "param": None,
                                  "code": None}}
            metrics.LINE_DURATION.labels(batch.endpoint).observe(time.perf_counter() - started)
            line = output_line(batch.id, parsed.index, parsed.custom_id, answer.status, body)
            ok = answer.status == 200
            if ok and run.model_version is None:
                run.model_version = await self._served_version()
            cache = None
            if ok and run.model_version is not None:
                cache = functools.partial(self.cache.put, batch.model or body.get("model", ""), run.model_version,
                                          batch.endpoint, parsed.body, body,
                                          source=CacheSource(batch_id=batch.id, custom_id=parsed.custom_id))
            return LineResult(index=parsed.index, custom_id=parsed.custom_id, kind="output" if ok else "error",
                              line=line), cache
        return None  # stopped (cancelled or expired) before an answer: not a result

    def _bad_result(self, run: _Run, bad: BadLine) -> LineResult:
        return LineResult(index=bad.index, custom_id=bad.custom_id, kind="error",
                          line=error_line(run.record.batch.id, bad))

    def _put_chunk(self, batch: BatchObject, chunk: list[LineResult]) -> None:
        """One chunk of results into the store (on a worker thread), then counted on /metrics: counted in the same
        thread right after the put, so that a stored line is counted unless the process dies between the two
        statements. With the test hook ENV_KILL_AFTER the process dies right after storing the last allowed result
        (a chunk that would pass it is cut there)."""
        if self.config.kill_after is None:
            self.storage.put_results(batch.id, chunk)
            self._count_lines(batch, chunk)
            return
        with self._kill_lock:
            chunk = chunk[:self.config.kill_after - self.results_written]
            self.storage.put_results(batch.id, chunk)
            self._count_lines(batch, chunk)
            self.results_written += len(chunk)
            if self.results_written >= self.config.kill_after:
                log.warning("%s=%d reached: killing this worker", ENV_KILL_AFTER, self.config.kill_after)
                os.kill(os.getpid(), signal.SIGKILL)

    @staticmethod
    def _count_lines(batch: BatchObject, chunk: list[LineResult]) -> None:
        for result in chunk:
            metrics.LINES.labels(batch.endpoint, result.kind).inc()

    async def _monitor(self, run: _Run) -> None:
        """Every `progress_every_s`: the counts into the record, and whether the batch was cancelled or expired."""
        batch = run.record.batch
        while True:
            await asyncio.sleep(self.config.progress_every_s)
            if await asyncio.to_thread(self.storage.cancel_requested_at, batch.id) is not None:
                run.stop = "cancelled"
            elif batch.expires_at is not None and time.time() >= batch.expires_at:
                run.stop = "expired"
            await asyncio.to_thread(self._save_counts, run)

    def _save_counts(self, run: _Run) -> None:
        counts = run.record.batch.request_counts
        counts.completed, counts.failed = run.completed, run.failed
        self.storage.save_batch(run.record)

    # -- finalizing ---------------------------------------------------------------------------------------------

    def _finalize(self, run: _Run, final: str) -> None:
        """Merge the stored results into the output and error files, then end the batch. Idempotent: the files'
        ids come from the batch, so a finalize interrupted and run again rewrites the same two files."""
        record, batch = run.record, run.record.batch
        now = int(time.time())
        if final == "completed":
            batch.status, batch.finalizing_at = "finalizing", batch.finalizing_at or now
            self.storage.save_batch(record)
        if final == "cancelled":
            batch.cancelling_at = batch.cancelling_at or self.storage.cancel_requested_at(batch.id) or now
        results = self.storage.results(batch.id)  # sorted by index: each line once
        for kind in ("output", "error"):
            chosen = [r.line for r in results if r.kind == kind]
            if not chosen:
                continue
            content = "".join(json.dumps(line) + "\n" for line in chosen).encode()
            file_id = output_file_id(batch.id, kind)
            self.storage.put_file(StoredFile(file=FileObject(id=file_id, bytes=len(content), created_at=now,
                                                             filename=f"{batch.id}_{kind}.jsonl",
                                                             purpose="batch_output"),
                                             owner=record.owner, lines=len(chosen)), content)
            if kind == "output":
                batch.output_file_id = file_id
            else:
                batch.error_file_id = file_id
        batch.request_counts.completed = sum(1 for r in results if r.kind == "output")
        batch.request_counts.failed = len(results) - batch.request_counts.completed
        batch.status = final
        setattr(batch, f"{final}_at", now)
        self.storage.save_batch(record)
        metrics.BATCHES.labels(batch.endpoint, final).inc()
        metrics.BATCH_DURATION.labels(batch.endpoint, final).observe(max(0, now - batch.created_at))
        log.info("batch %s %s: %d completed, %d failed of %d", batch.id, final, batch.request_counts.completed,
                 batch.request_counts.failed, batch.request_counts.total)


def _retry_after(answer: Answer, default: float) -> float:
    value = answer.retry_after or ""
    try:
        return min(max(float(value), 0.05), 30.0)
    except ValueError:
        return default


def _api_key() -> str | None:
    """The key for the model's front-end: ENV_BATCH_WORKER_API_KEY_FILE's content (a Deployment's required Secret),
    else ENV_BATCH_WORKER_API_KEY (a local run). Fails closed: a key file that is named but missing, unreadable or
    empty is an error naming it, never a worker that calls without its key."""
    return key_from_env(ENV_BATCH_WORKER_API_KEY_FILE, ENV_BATCH_WORKER_API_KEY, "the worker's key")


async def _run(worker: BatchWorker, exit_when_idle: bool) -> None:
    try:
        await worker.run_forever(exit_when_idle=exit_when_idle)
    finally:
        await worker.http.aclose()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m serving_image.batch.worker", description=__doc__.split("\n")[0])
    parser.add_argument("--store", required=True, help="the batch store: a directory or s3://bucket/prefix")
    parser.add_argument("--endpoint", required=True, help="the model's OpenAI endpoint, e.g. http://127.0.0.1:9000")
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--poll-s", type=float, default=1.0)
    parser.add_argument("--exit-when-idle", action="store_true", help="stop once no batch is active")
    parser.add_argument("--metrics-port", type=int, default=None, help="serve the worker's own /metrics here")
    parser.add_argument("--cache-retention-days", type=int, default=0, help="0: keep cached answers until deleted")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    if args.concurrency < 1:
        parser.error("--concurrency must be at least 1")
    kill_after = os.environ.get(ENV_KILL_AFTER)
    try:
        api_key = _api_key()
    except ValueError as exc:
        parser.error(str(exc))
    config = WorkerConfig(endpoint_url=args.endpoint, api_key=api_key,
                          concurrency=args.concurrency, poll_s=args.poll_s,
                          kill_after=int(kill_after) if kill_after else None,
                          cache_retention=timedelta(days=args.cache_retention_days) if args.cache_retention_days
                          else None)
    if args.metrics_port:
        from prometheus_client import start_http_server

        start_http_server(args.metrics_port)
    storage = BatchStorage(open_object_store(args.store, kms_key_id=os.environ.get(ENV_BATCH_KMS_KEY)))
    # SIGTERM (the kubelet stopping the pod) ends the worker as Ctrl-C does. The Deployment's command makes this
    # process its container's PID 1, for which the kernel has no default action on SIGTERM: without a handler the
    # worker ignored it and was SIGKILLed at the grace period's end (exit 137 in the rehearsal's containers).
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    try:
        asyncio.run(_run(BatchWorker(storage, config), exit_when_idle=args.exit_when_idle))
    except KeyboardInterrupt:  # SIGTERM, Ctrl-C (make up) or SIGINT: lines in flight are sent again by the next run
        log.info("stopped")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
