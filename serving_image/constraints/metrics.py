"""The constraint processor's metrics (prometheus_client), on the pod's merged /metrics.

The processor runs in vLLM's engine-core process. With PROMETHEUS_MULTIPROC_DIR set (every model pod, `make up`,
the tests; the startup procedure sets it before anything imports prometheus_client) the values go to multiprocess
files that the metrics proxy merges with Triton's and vLLM's (serving_image/metrics/proxy.py), like vLLM's own.
Counters are totals since the pod started (an engine that exits leaves its files); the high-water mark of rows is a
gauge in multiprocess mode `max`, the highest any engine process of the pod reached.

Cheap on the hot path: one counter increment per step (plus one per constrained row added), and the native core's
running totals (stalls, rebuilds, rescued) and the device path's step counts become increments only when they moved.
No file or log is written per step beyond prometheus_client's own memory-mapped value.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from prometheus_client import Counter, Gauge

if TYPE_CHECKING:
    from serving_image.constraints.machines import ConstraintRows

ADDED = Counter("llm_serving_constraint_requests_added",
                "Constrained requests added to the engine's batch (a preempted request counts again when it is "
                "added back)")
READDED = Counter("llm_serving_constraint_requests_readded",
                  "Constrained requests added back with output already generated (preempted requests resuming; "
                  "model runner V1)")
STEPS = Counter("llm_serving_constraint_steps", "Engine steps that masked the logits of constrained rows")
MAX_ROWS = Gauge("llm_serving_constraint_max_rows", "Most constrained rows masked in one step",
                 multiprocess_mode="max")
STALLS = Counter("llm_serving_constraint_stalls",
                 "Constrained rows masked whose sample the engine discarded (a partially prefilled row): the row did "
                 "not advance")
REBUILDS = Counter("llm_serving_constraint_rebuilds",
                   "Constrained rows whose output history shrank or changed, rebuilt by replaying it")
RESCUED = Counter("llm_serving_constraint_rescued",
                  "Constrained rows whose allowed tokens another logits processor had all masked, given back at logit "
                  "0 (masking on the CPU; the GPU kernel counts them on the device)")
KERNEL_STEPS = Counter("llm_serving_constraint_kernel_steps", "Steps whose CUDA logits the fused kernel masked")
TORCH_STEPS = Counter("llm_serving_constraint_torch_steps",
                      "Steps whose logits off the CPU torch operations masked (no kernel: see the log's reason)")


class ProcessorMetrics:
    """One processor's counts, exported: the rows' running totals become counter increments after each step."""

    def __init__(self, rows: ConstraintRows):
        self._rows = rows
        self._seen = (0, 0, 0, 0, 0)  # stalls, rebuilds, rescued, kernel_steps, torch_steps already counted

    def added(self, readded: bool) -> None:
        ADDED.inc()
        if readded:
            READDED.inc()

    def stepped(self, rows: int) -> None:
        """After an apply that had constrained rows (`rows` of them masked; the rows synced before it)."""
        global _max_rows
        STEPS.inc()
        if rows > _max_rows:
            _max_rows = rows
            MAX_ROWS.set(rows)
        rows = self._rows
        core = rows.core
        now = (core.stalls, core.rebuilds, core.rescued, rows.kernel_steps, rows.torch_steps)
        if now != self._seen:
            for counter, before, after in zip(_TOTALS, self._seen, now, strict=True):
                if after > before:
                    counter.inc(after - before)
            self._seen = now


_TOTALS = (STALLS, REBUILDS, RESCUED, KERNEL_STEPS, TORCH_STEPS)
_max_rows = 0  # the gauge's value in this process (every processor of the process)
