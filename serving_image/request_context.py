"""What a caller's request says about its context, read the same way by every front-end (OpenAI, KServe gRPC): the
W3C trace context (`traceparent`, whose trace id the request records carry, so a caller's trace joins the server's
record) and the experiment arm (`x-llm-serving-experiment: <experiment>=<arm>`, docs/clients.md, "Experiments"),
which the records carry and `llm_serving_experiment_requests_total` counts on the pod's merged /metrics.

The counter is a prometheus_client one: with PROMETHEUS_MULTIPROC_DIR set (every model pod, `make up`, the tests) it
is written to the multiprocess files the metrics proxy merges (serving_image/metrics/proxy.py).
"""

from __future__ import annotations

import logging
import re

from prometheus_client import Counter

# W3C Trace Context's `traceparent` header: a version (two lowercase hex digits, not ff), a 32-hex-digit trace id and a
# 16-hex-digit parent id (neither all zeros), flags; a later version may add fields after those (version 00 adds
# none). The record keeps the trace id, so that a caller's trace and this server's record join.
_TRACEPARENT = re.compile(r"^([0-9a-f]{2})-([0-9a-f]{32})-([0-9a-f]{16})-[0-9a-f]{2}(-.*)?$")

EXPERIMENT_HEADER = "x-llm-serving-experiment"
# The stack's experiment and arm names (infra/config.py ExperimentConfig, ArmConfig): bounded label values.
_EXPERIMENT = re.compile(r"^([a-z0-9]([a-z0-9-]{0,62}[a-z0-9])?)=([a-z0-9]([a-z0-9_-]{0,30}[a-z0-9])?)$")

EXPERIMENT_REQUESTS = Counter("llm_serving_experiment_requests", "Requests that carried an experiment's arm "
                              "(x-llm-serving-experiment), by outcome", ["experiment", "arm", "protocol", "status"])


def trace_id_from(traceparent: str | None) -> str | None:
    """The trace id of a `traceparent` header, or None without one. A header not in Trace Context's form is not an
    error of the request: Trace Context says to ignore it (and start a new trace), so the record says null."""
    match = _TRACEPARENT.match((traceparent or "").strip())
    if not match:
        return None
    version, trace_id, parent_id, rest = match.groups()
    if version == "ff" or (version == "00" and rest) or set(trace_id) == {"0"} or set(parent_id) == {"0"}:
        return None
    return trace_id


def experiment_from(value: str | None) -> str | None:
    """`<experiment>=<arm>` from the header, or None without one. A malformed value is the caller's error (ValueError
    naming the header): unlike a trace context, an arm that cannot be read would silently lose the request from its
    experiment's figures."""
    if value is None:
        return None
    if not _EXPERIMENT.match(value.strip()):
        raise ValueError(f"header {EXPERIMENT_HEADER}: {value!r} is not '<experiment>=<arm>' (lowercase names as the "
                         f"stack declares them)")
    return value.strip()


def count_experiment(experiment: str | None, protocol: str, status: str) -> None:
    if experiment is not None:
        name, _, arm = experiment.partition("=")
        EXPERIMENT_REQUESTS.labels(name, arm, protocol, status).inc()


def log_record(logger: logging.Logger, line: str) -> None:
    """One request record's line at INFO on `logger`, as `logger.info(line)` logs it (the same handlers, filters and
    format), without logging's caller lookup: `findCaller` walks the stack for a file and line that no record's
    format prints (under bench.kserve's load, 4 % of the KServe front-end's samples that held the GIL, 2026-12-06)."""
    if logger.isEnabledFor(logging.INFO):
        logger.handle(logger.makeRecord(logger.name, logging.INFO, "(unknown file)", 0, line, None, None))
