"""A vLLM general plugin for tests: an engine step gate (shipped in a test wheel; see tests/serving/step_gate.py).

This file is the wheel's whole module, imported by vLLM in the engine's processes: it imports nothing from the
repository. With `LLM_SERVING_TEST_STEP_GATE` set to a directory, vLLM's engine core process (EngineCoreProc),
before every step it takes while it has requests, looks for its gate: the directory `engine-<pid of its parent>`
there (the parent is the Triton Python backend stub that runs the engine, so one server's engines are gated one at
a time). No gate directory: the step runs, as without the plugin. A gate directory: the step waits until it can
take (delete) one grant file from it, or until the gate is removed. Aborts the engine core handled are appended to
`engine-<parent pid>.aborted`, one request id a line, so a test knows when a cancellation reached the engine.

Ordering: vLLM's busy loop handles every client message waiting in its input queue (new requests, aborts)
between two steps; a gated engine therefore still receives aborts, and handles them after the next granted step.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

GATE_ENV = "LLM_SERVING_TEST_STEP_GATE"
POLL_S = 0.002  # how often a gated engine core looks for a grant: its cost is one listdir per poll


def register() -> None:
    root = os.environ.get(GATE_ENV)
    if not root:
        return
    from vllm.v1.engine.core import EngineCore, EngineCoreProc

    if getattr(EngineCoreProc, "_step_gate_installed", False):  # vLLM loads general plugins more than once a process
        return
    step, abort = EngineCoreProc._process_engine_step, EngineCore.abort_requests

    def gated_step(self):
        _take_grant(Path(root, f"engine-{os.getppid()}"))
        return step(self)

    def recorded_abort(self, request_ids):
        result = abort(self, request_ids)
        with open(Path(root, f"engine-{os.getppid()}.aborted"), "a") as record:
            record.writelines(f"{request_id}\n" for request_id in request_ids)
        return result

    EngineCoreProc._process_engine_step = gated_step  # the busy loop's step, taken only while it has requests
    EngineCore.abort_requests = recorded_abort
    EngineCoreProc._step_gate_installed = True


def _take_grant(gate: Path) -> None:
    while True:
        try:
            grants = sorted(os.listdir(gate))
        except FileNotFoundError:  # no gate, or the test opened it
            return
        for name in grants:
            try:
                os.unlink(gate / name)
                return
            except FileNotFoundError:
                continue
        time.sleep(POLL_S)
