"""The batch worker's metrics (prometheus_client), on the pod's merged /metrics.

With PROMETHEUS_MULTIPROC_DIR set (the model pod's metrics directory, which the worker shares when it runs beside
the front-end, and which `make up` and the tests give it) they are written to multiprocess files that the metrics
proxy merges with Triton's and vLLM's (serving_image/metrics/proxy.py): counters and histograms stay after the
worker exits, so a killed worker's lines are still counted. The worker's own `--metrics-port` serves them too.

The per-request metrics of batch work are the served path's own (`nv_*`, vLLM's): batch requests are ordinary
requests to the real-time endpoint, so nothing here counts tokens or requests again.
"""

from __future__ import annotations

from prometheus_client import Counter, Histogram

BATCHES = Counter("llm_serving_batch_batches", "Batches that reached a terminal state", ["endpoint", "status"])
LINES = Counter("llm_serving_batch_lines", "Batch lines answered: output (2xx) or error lines", ["endpoint", "kind"])
BATCH_DURATION = Histogram("llm_serving_batch_duration_seconds", "From a batch's creation to its terminal state",
                           ["endpoint", "status"],
                           buckets=(1, 5, 15, 60, 300, 900, 1800, 3600, 7200, 14400, 43200, 86400))
LINE_DURATION = Histogram("llm_serving_batch_line_duration_seconds",
                          "One line's request to the real-time endpoint, retries (429/503) included", ["endpoint"],
                          buckets=(0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300))
