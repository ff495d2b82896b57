"""The kubelet's part for rehearsed pods: start the container's process, run its startup, readiness and liveness
probes as declared (path, port, period, timeout, thresholds), restart a crashed or unhealthy container with
Kubernetes' back-off, and terminate as Kubernetes does (preStop, SIGTERM, the grace period, then SIGKILL).

A pod is Ready only when its readiness probe says so, after its startup probe succeeded. How a container process is
started is injected (`Launch`): a container of the built image in the rehearsal (container.py), a plain process
in the tests, driven the same way.
"""

from __future__ import annotations

import asyncio
import collections
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from rehearsal.podspec import PodPlan, Probe

BACKOFF_START_S = 10.0  # Kubernetes' CrashLoopBackOff: 10 s, doubled per restart, capped at 5 minutes
BACKOFF_MAX_S = 300.0
LOG_LINES_KEPT = 40

class Container(Protocol):
    """What the kubelet drives: a started container (container.py's ContainerProcess under podman; the tests' own
    processes). `kill_all` ends every process in it."""

    pid: int
    returncode: int | None

    def poll(self) -> int | None: ...
    def send_signal(self, sig: int) -> None: ...
    def kill_all(self) -> None: ...


# plan, log file -> the started container
Launch = Callable[[PodPlan, Path], Container]


def backoff_s(restarts: int, start: float = BACKOFF_START_S, cap: float = BACKOFF_MAX_S) -> float:
    """The wait before the (restarts+1)-th start: 0 for the first start, then start * 2^(restarts-1), capped."""
    if restarts <= 0:
        return 0.0
    return min(cap, start * 2 ** (restarts - 1))


@dataclass
class ProbeState:
    """Consecutive successes/failures of one probe against its thresholds (the kubelet's prober results)."""

    probe: Probe
    successes: int = 0
    failures: int = 0
    passing: bool = False

    def record(self, ok: bool) -> str | None:
        """Record one result; returns "pass" or "fail" when the probe's state flips at a threshold."""
        if ok:
            self.successes, self.failures = self.successes + 1, 0
            if not self.passing and self.successes >= self.probe.success_threshold:
                self.passing = True
                return "pass"
        else:
            self.successes, self.failures = 0, self.failures + 1
            if self.failures >= self.probe.failure_threshold:
                flipped = self.passing or self.failures == self.probe.failure_threshold
                self.passing = False
                return "fail" if flipped else None
        return None


async def http_probe(host: str, probe: Probe) -> tuple[bool, str]:
    """An httpGet probe as the kubelet runs it: any status from 200 to 399 within the timeout is a success."""
    # asyncio.timeout, not wait_for: Python 3.11's wait_for can swallow a cancellation that arrives as the awaited
    # call completes, and a probe loop that lost its cancel probes forever (it hung a test's event loop teardown).
    try:
        async with asyncio.timeout(probe.timeout_s):
            reader, writer = await asyncio.open_connection(host, probe.port)
    except (TimeoutError, OSError) as exc:
        return False, f"connect {host}:{probe.port}: {type(exc).__name__}"
    try:
        writer.write(f"GET {probe.path} HTTP/1.1\r\nHost: {host}:{probe.port}\r\nUser-Agent: kube-probe/1.33\r\n"
                     f"Connection: close\r\n\r\n".encode())
        await writer.drain()
        async with asyncio.timeout(probe.timeout_s):
            line = await reader.readline()
        parts = line.decode("latin-1").split()
        status = int(parts[1]) if len(parts) > 1 and parts[1].isdigit() else 0
        return 200 <= status < 400, f"HTTP {status}"
    except (TimeoutError, OSError) as exc:
        return False, f"{probe.path}: {type(exc).__name__}"
    finally:
        writer.close()


@dataclass
class PodStatus:
    name: str
    address: str
    phase: str = "Pending"  # Pending, Starting, Running, Ready, Restarting, Terminating, Terminated
    ready: bool = False
    restarts: int = 0
    created: float = field(default_factory=time.monotonic)
    ready_after_s: float | None = None  # first time Ready, from creation
    last_cause: str = ""
    events: list[str] = field(default_factory=list)
    logs: collections.deque = field(default_factory=lambda: collections.deque(maxlen=LOG_LINES_KEPT))


class PodRunner:
    """One pod: its container's lifecycle under the kubelet's rules."""

    def __init__(self, plan: PodPlan, address: str, launch: Launch, log_dir: Path,
                 backoff: Callable[[int], float] = backoff_s, on_change: Callable[[], None] = lambda: None):
        self.plan = plan
        self.status = PodStatus(plan.name, address)
        self.launch = launch
        self.log_dir = log_dir
        self.backoff = backoff
        self.on_change = on_change
        self.process: Container | None = None
        self._stopping = asyncio.Event()
        self._log_path: Path | None = None

    # -- events ------------------------------------------------------------------------------------------------

    def _event(self, text: str) -> None:
        self.status.events.append(f"{time.monotonic() - self.status.created:7.1f}s {text}")
        self.on_change()

    def _set(self, phase: str, ready: bool | None = None) -> None:
        self.status.phase = phase
        if ready is not None:
            if ready and not self.status.ready and self.status.ready_after_s is None:
                self.status.ready_after_s = time.monotonic() - self.status.created
            self.status.ready = ready
        self.on_change()

    def _read_logs(self) -> None:
        if self._log_path and self._log_path.exists():
            lines = self._log_path.read_text(errors="replace").splitlines()
            self.status.logs.clear()
            self.status.logs.extend(lines[-LOG_LINES_KEPT:])

    # -- lifecycle ---------------------------------------------------------------------------------------------

    async def run(self) -> None:
        """Until `stop()`: start, probe, restart with back-off."""
        while not self._stopping.is_set():
            wait = self.backoff(self.status.restarts)
            if wait:
                self._set("Restarting", ready=False)
                self._event(f"back-off {wait:.0f}s before restart {self.status.restarts}")
                try:
                    async with asyncio.timeout(wait):
                        await self._stopping.wait()
                    return
                except TimeoutError:
                    pass
            cause = await self._run_container()
            if self._stopping.is_set():
                return
            self.status.restarts += 1
            self.status.last_cause = cause
            self._read_logs()
            self._event(f"container restarted: {cause}")

    async def _run_container(self) -> str:
        self._log_path = self.log_dir / f"{self.plan.name}.{self.status.restarts}.log"
        self._set("Starting", ready=False)
        self.process = self.launch(self.plan, self._log_path)
        self._event(f"container started (pid {self.process.pid})")
        probes = self.plan.probes
        checks = [asyncio.create_task(self._exited())]
        started = asyncio.Event()
        if "startup" in probes:
            checks.append(asyncio.create_task(self._startup(probes["startup"], started)))
        else:
            started.set()
        checks.append(asyncio.create_task(self._after_start(started)))
        stop = asyncio.create_task(self._stopping.wait())
        try:
            done, _ = await asyncio.wait([*checks, stop], return_when=asyncio.FIRST_COMPLETED)
        finally:  # also when run() itself is cancelled: no probe loop outlives its container
            for task in [*checks, stop]:
                if not task.done():
                    task.cancel()
        if stop in done:
            return "stopped"
        cause = next((t.result() for t in done if t is not stop and not t.cancelled()), "unknown")
        await self._kill(f"{cause}")
        self._set("Restarting", ready=False)
        return cause

    async def _exited(self) -> str:
        while self.process.poll() is None:
            await asyncio.sleep(0.2)
        return f"exited with status {self.process.returncode}"

    async def _probe_loop(self, state: ProbeState, on_flip: Callable[[str, str], str | None]) -> str:
        probe = state.probe
        await asyncio.sleep(probe.initial_delay_s)
        while True:
            ok, detail = await http_probe(self.status.address, probe)
            flip = state.record(ok)
            if flip:
                result = on_flip(flip, detail)
                if result is not None:
                    return result
            await asyncio.sleep(probe.period_s)

    async def _startup(self, probe: Probe, started: asyncio.Event) -> str:
        def flip(kind: str, detail: str) -> str | None:
            if kind == "pass":
                self._event("startup probe succeeded")
                started.set()
                return "startup-done"
            return (f"startup probe failed {probe.failure_threshold} times ({detail}) within "
                    f"{probe.initial_delay_s + probe.period_s * probe.failure_threshold:.0f}s")

        result = await self._probe_loop(ProbeState(probe), flip)
        if result == "startup-done":
            await asyncio.Event().wait()  # the liveness/readiness loops take over; never returns
        return result

    async def _after_start(self, started: asyncio.Event) -> str:
        await started.wait()
        self._set("Running")
        probes = self.plan.probes
        tasks = []
        if "readiness" in probes:
            def ready_flip(kind: str, detail: str) -> None:
                self._set("Ready" if kind == "pass" else "Running", ready=kind == "pass")
                self._event(f"readiness probe {'succeeded' if kind == 'pass' else 'failed: ' + detail}")

            tasks.append(asyncio.create_task(self._probe_loop(ProbeState(probes["readiness"]), ready_flip)))
        else:
            self._set("Ready", ready=True)
        if "liveness" in probes:
            probe = probes["liveness"]
            state = ProbeState(probe, passing=True)

            def live_flip(kind: str, detail: str) -> str | None:
                if kind == "fail":
                    return f"liveness probe failed {probe.failure_threshold} times ({detail})"
                return None

            tasks.append(asyncio.create_task(self._probe_loop(state, live_flip)))
        if not tasks:
            await asyncio.Event().wait()
        try:
            done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
        finally:  # also when this task is cancelled (its container stopped): the probe loops end with it
            for task in tasks:
                if not task.done():
                    task.cancel()
        return next(iter(done)).result()

    async def _kill(self, why: str) -> None:
        """Kill after a failed probe: SIGTERM, the grace period, SIGKILL (no preStop on a failed container)."""
        await self._terminate(run_prestop=False)

    async def _terminate(self, run_prestop: bool) -> None:
        process = self.process
        if process is None or process.poll() is not None:
            return
        grace = self.plan.grace_period_s
        started = time.monotonic()
        if run_prestop and self.plan.prestop_sleep_s:
            self._event(f"preStop: sleep {self.plan.prestop_sleep_s:.0f}s")
            await asyncio.sleep(min(self.plan.prestop_sleep_s, grace))
        remaining = max(2.0, grace - (time.monotonic() - started))  # Kubernetes grants a 2 s minimum
        if process.poll() is None:
            self._event("SIGTERM")
            process.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + remaining
        while process.poll() is None and time.monotonic() < deadline:
            await asyncio.sleep(0.2)
        if process.poll() is None:
            self._event(f"SIGKILL after the {grace:.0f}s grace period")
        self._killpg(process)
        self._read_logs()

    @staticmethod
    def _killpg(process: Container) -> None:
        process.kill_all()  # every process the container started

    async def stop(self, fast: bool = False) -> None:
        """Terminate as Kubernetes does: readiness off, preStop, SIGTERM, grace period, SIGKILL."""
        self._stopping.set()
        self._set("Terminating", ready=False)
        if fast and self.process is not None:
            self._killpg(self.process)
        else:
            await self._terminate(run_prestop=True)
        self._set("Terminated", ready=False)
        self._event(f"terminated (exit status {self.process.returncode if self.process else 'never started'})")

    def kill_now(self) -> None:
        if self.process is not None:
            self._killpg(self.process)
