"""Who may call, and how much work is let in: bearer API keys and admission limits.

Admission is bounded instead of queueing without limit: past `max_concurrent_requests` requests in flight, or
`max_inflight_tokens` tokens (prompt plus the most it may generate, over all requests in flight), a request gets 429
with `Retry-After`, so a client backs off and a load balancer can send it elsewhere.

Batch work (serving_image/batch/worker.py, docs/batch.md) marks its requests with `PRIORITY_HEADER: batch` and is
admitted only within `batch_admission_share` of both budgets, and (`batch_yields_to_realtime`) only while no
real-time request is in flight: whatever the batches do, the rest stays for real-time traffic. This is the lever
that works in production, where NVIDIA's vLLM backend passes no request priority to vLLM. Any client may send the
header: it can only lower its own priority.

Batch generations already running when a real-time request is admitted are preempted
(`batch_preempted_by_realtime`): each is told to stop (`watch_preemption`'s callback), aborts its generation requests
and answers 503 `preempted_by_realtime` with `Retry-After`, and the batch worker sends the line again later. Why
stop work already done: the engine steps every running sequence together, so on a shared engine each batch sequence
still running makes every real-time step slower (bench.batch measured real-time p99 TTFT at 2.5-6.6x beside a
batch with admission alone). What it costs is the preempted lines' partial work, only while real-time traffic
arrives; an idle platform runs batches at full speed.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from prometheus_client import Counter

from llm_serving import pod_contract as pc
from serving_image.api_keys import bearer_token, key_matches, load_api_keys
from serving_image.openai_api.errors import APIError

__all__ = ["APIConfig", "Admission", "bearer_token", "check_api_key", "key_matches", "load_api_keys"]

ENV_API_KEYS = pc.ENV_API_KEYS  # comma-separated
ENV_API_KEYS_FILE = pc.ENV_API_KEYS_FILE  # one key per line, '#' comments; or a directory, one key per file
ENV_REQUIRE_API_KEYS = pc.ENV_REQUIRE_API_KEYS  # "1": keys required, and checked on the KServe ports too
PRIORITY_HEADER = "x-llm-serving-priority"  # "batch" or "realtime" (the default)
ENV_BATCH_SHARE = "LLM_SERVING_BATCH_ADMISSION_SHARE"  # a fraction in (0, 1]
ENV_BATCH_YIELDS = "LLM_SERVING_BATCH_YIELDS_TO_REALTIME"  # 1 (default) or 0
ENV_BATCH_PREEMPTED = "LLM_SERVING_BATCH_PREEMPTED_BY_REALTIME"  # 1 (default) or 0
BATCH_PREEMPTED = Counter("llm_serving_batch_preempted", "Batch requests stopped (503, sent again by the batch "
                          "worker) to make room for a real-time request")
ENV_LIMITS = {
    "max_body_bytes": "LLM_SERVING_MAX_BODY_BYTES",
    "max_concurrent_requests": "LLM_SERVING_MAX_CONCURRENT_REQUESTS",
    "max_inflight_tokens": "LLM_SERVING_MAX_INFLIGHT_TOKENS",
}


@dataclass(frozen=True)
class APIConfig:
    api_keys: tuple[str, ...] = ()  # empty: no authentication (never so with `required`)
    # ENV_REQUIRE_API_KEYS (every model pod): the keys are required, and checked on every serving port.
    required: bool = False
    max_body_bytes: int = 8 * 1024 * 1024
    max_concurrent_requests: int = 512
    max_inflight_tokens: int = 4_000_000
    retry_after_s: int = 1
    batch_admission_share: float = 0.25  # of max_concurrent_requests and max_inflight_tokens, for batch requests
    # Batch requests wait (429) while any real-time request is in flight: batch work takes idle capacity only.
    # Measured on CPU (bench.batch): a share alone leaves real-time p99 TTFT at 2-3.5x beside a batch.
    batch_yields_to_realtime: bool = True
    # Batch generations in flight stop (503, retried by the worker) when a real-time request is admitted.
    batch_preempted_by_realtime: bool = True

    @classmethod
    def from_env(cls, environ: Mapping[str, str] = os.environ) -> APIConfig:
        keys, required = load_api_keys(environ)
        limits = {}
        for field, variable in ENV_LIMITS.items():
            if variable in environ:
                value = environ[variable]
                if not value.isdigit() or int(value) < 1:
                    raise ValueError(f"{variable}={value!r}: expected a positive integer")
                limits[field] = int(value)
        if ENV_BATCH_SHARE in environ:
            value = environ[ENV_BATCH_SHARE]
            try:
                share = float(value)
            except ValueError:
                share = -1.0
            if not 0 < share <= 1:
                raise ValueError(f"{ENV_BATCH_SHARE}={value!r}: expected a fraction in (0, 1]")
            limits["batch_admission_share"] = share
        for variable, field in ((ENV_BATCH_YIELDS, "batch_yields_to_realtime"),
                                (ENV_BATCH_PREEMPTED, "batch_preempted_by_realtime")):
            if variable in environ:
                value = environ[variable]
                if value not in ("0", "1"):
                    raise ValueError(f"{variable}={value!r}: expected 1 or 0")
                limits[field] = value == "1"
        return cls(api_keys=keys, required=required, **limits)


def check_api_key(config: APIConfig, authorization: str | None) -> None:
    """Raise 401 unless the bearer token is one of the keys. Every key is compared, each in constant time."""
    if not config.api_keys:
        if config.required:  # from_env refuses this; a config built by hand is held to it too
            raise APIError(401, "No API key is configured on this server", code="invalid_api_key")
        return
    token = bearer_token(authorization)
    if token is None:
        raise APIError(401, "Missing API key: send 'Authorization: Bearer <key>'", code="invalid_api_key")
    if not key_matches(config.api_keys, token):
        raise APIError(401, "Incorrect API key provided", code="invalid_api_key")


class Admission:
    """Counts requests and tokens in flight; the event loop is single-threaded, so plain integers suffice."""

    def __init__(self, config: APIConfig):
        self.config = config
        self.requests = 0
        self.tokens = 0
        self.batch_requests = 0  # of the above, those of batch work
        self.batch_tokens = 0
        self.preempted = 0  # batch requests told to make room for real time, since the start
        # Batch work that stops when a real-time request is admitted: request id -> what tells it to stop.
        self._preemptible: dict[str, Callable[[], None]] = {}

    @property
    def batch_limits(self) -> tuple[int, int]:
        """The most requests and tokens batch work may hold: its share, but always room for one request."""
        share = self.config.batch_admission_share
        return (max(1, int(self.config.max_concurrent_requests * share)),
                max(1, int(self.config.max_inflight_tokens * share)))

    def admit(self, tokens: int, batch: bool = False) -> int:
        if batch:
            max_requests, max_tokens = self.batch_limits
            realtime = self.requests - self.batch_requests
            if self.config.batch_yields_to_realtime and realtime:
                raise self._busy(f"{realtime} real-time requests in flight: batch work waits for idle capacity")
            if self.batch_requests + 1 > max_requests:
                raise self._busy(f"{self.batch_requests} batch requests in flight (batch share {max_requests})")
            # A request larger than the whole share is still let in when no other batch request is in flight:
            # otherwise it could never run (the total budget below still bounds it).
            if self.batch_tokens + tokens > max_tokens and self.batch_requests:
                raise self._busy(f"{self.batch_tokens} batch tokens in flight (batch share {max_tokens})")
        if self.requests + 1 > self.config.max_concurrent_requests:
            raise self._busy(f"{self.requests} requests in flight (limit {self.config.max_concurrent_requests})")
        if self.tokens + tokens > self.config.max_inflight_tokens:
            if tokens > self.config.max_inflight_tokens:
                raise APIError(400, f"the request needs up to {tokens} tokens (prompt plus max tokens for every "
                                    f"choice); this server admits at most {self.config.max_inflight_tokens}",
                               param="max_tokens", code="request_too_large")
            raise self._busy(f"{self.tokens} tokens in flight (limit {self.config.max_inflight_tokens})")
        self.requests += 1
        self.tokens += tokens
        if batch:
            self.batch_requests += 1
            self.batch_tokens += tokens
        elif self._preemptible and self.config.batch_preempted_by_realtime:
            self._preempt_batch_work()
        return tokens

    def watch_preemption(self, request_id: str, stop: Callable[[], None]) -> None:
        """Batch work `request_id` can be stopped: `stop` is called (once, on the event loop, from inside the
        admission of a real-time request) when real time needs the engine. `unwatch_preemption` when it ends."""
        if self.config.batch_preempted_by_realtime:
            self._preemptible[request_id] = stop

    def unwatch_preemption(self, request_id: str) -> None:
        self._preemptible.pop(request_id, None)

    def _preempt_batch_work(self) -> None:
        stopping, self._preemptible = self._preemptible, {}
        for stop in stopping.values():
            stop()
        self.preempted += len(stopping)
        BATCH_PREEMPTED.inc(len(stopping))

    def release(self, tokens: int, batch: bool = False) -> None:
        self.requests -= 1
        self.tokens -= tokens
        if batch:
            self.batch_requests -= 1
            self.batch_tokens -= tokens

    def preempted_error(self) -> APIError:
        """The answer of batch work stopped for real time: 503 with Retry-After (the worker sends the line again)."""
        error = APIError(503, "Preempted: a real-time request needed the engine; batch work is sent again later "
                              f"(retry after {self.config.retry_after_s}s)",
                         type_="service_unavailable", code="preempted_by_realtime")
        error.headers = {"Retry-After": str(self.config.retry_after_s)}
        return error

    def _busy(self, why: str) -> APIError:
        error = APIError(429, f"Server busy: {why}; retry after {self.config.retry_after_s}s",
                         type_="rate_limit_error", code="server_busy")
        error.headers = {"Retry-After": str(self.config.retry_after_s)}
        return error
