"""Grant a vLLM engine its steps one at a time, so that a test that needs a race forces it by counting steps.

The engine side is a vLLM general plugin (step_gate_plugin.py, shipped as a wheel in the server's package): with
`GATE_ENV` naming a directory, the engine core takes a step only when it can take a grant from its gate. A test
closes the gate of one engine (`StepGate.closed`), grants steps (`step()`: one step, and returns once the engine
took it) until what it waits for has happened (an output reached its client, an abort reached the engine), acts,
and opens the gate again. How far the engine got is then a number of steps, whatever the machine's speed: unlike
holding the engine with SIGSTOP for slices of time, nothing depends on when the test's or the engine's processes
are scheduled.
"""

from __future__ import annotations

import itertools
import shutil
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from tests.serving import step_gate_plugin
from tests.serving.wheels import make_wheel, wheel_filename

GATE_ENV = step_gate_plugin.GATE_ENV
WHEEL_NAME = "step-gate-plugin"


def write_step_gate_wheel(directory: Path) -> Path:
    """The plugin wheel, for a package's `plugins`; the server must also run with GATE_ENV set."""
    path = directory / wheel_filename(WHEEL_NAME)
    source = Path(step_gate_plugin.__file__).read_text()
    path.write_bytes(make_wheel(WHEEL_NAME, files={"llm_serving_step_gate.py": source},
                                entry_points={"vllm.general_plugins": {"step_gate": "llm_serving_step_gate:register"}}))
    return path


@dataclass
class StepGate:
    """The gate of the engine that the Python backend stub `stub_pid` runs, under the server's GATE_ENV root."""

    root: Path
    stub_pid: int
    _grants: Iterator[int] = field(default_factory=itertools.count, repr=False)

    @property
    def directory(self) -> Path:
        return self.root / f"engine-{self.stub_pid}"

    @classmethod
    @contextmanager
    def closed(cls, root: Path, stub_pid: int) -> Iterator[StepGate]:
        """The engine takes no step (beyond one already running) until granted; opened again however the block
        ends, so that a failing test leaves the shared server's engine running."""
        gate = cls(root, stub_pid)
        gate.directory.mkdir()
        try:
            yield gate
        finally:
            gate.open()

    def open(self) -> None:
        shutil.rmtree(self.directory, ignore_errors=True)

    def step(self, timeout_s: float = 60, unless: Callable[[], bool] = lambda: False) -> bool:
        """Grant one step and return True once the engine has taken it (it is running or done: vLLM returns its
        outputs after the step). With `unless`: if that turns true first, withdraw the grant and return False (an
        engine whose last request was just aborted takes no further step)."""
        grant = self.directory / f"grant-{next(self._grants):06d}"
        grant.touch(exist_ok=False)
        deadline = time.monotonic() + timeout_s
        while grant.exists():
            if unless():
                try:
                    grant.unlink()
                    return False
                except FileNotFoundError:  # taken meanwhile
                    return True
            if time.monotonic() > deadline:
                raise AssertionError(f"the engine did not take its step in {timeout_s} s (does it have a request?)")
            time.sleep(0.002)
        return True

    def step_until(self, reached: Callable[[], bool], pause_s: float = 0.1, limit: int = 200) -> int:
        """Grant steps one at a time until `reached()`, each followed by up to `pause_s` for what it produced to
        travel; return how many steps were taken. The pause only spends time: how far the engine got is bounded by
        `limit` steps, not by how long anything took to travel."""
        taken = 0
        while True:
            deadline = time.monotonic() + (pause_s if taken else 0)
            while not reached():
                if time.monotonic() >= deadline:
                    break
                time.sleep(0.01)
            else:
                return taken
            if taken == limit:
                raise AssertionError(f"not reached after {limit} engine steps")
            taken += self.step(unless=reached)

    def aborted_request_ids(self) -> list[str]:
        """The request ids the engine core handled aborts for, in order."""
        record = self.root / f"engine-{self.stub_pid}.aborted"
        return record.read_text().split() if record.exists() else []
