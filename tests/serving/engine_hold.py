"""Hold a running vLLM engine still, so that a test that needs a race forces it instead of hoping for it.

vLLM runs its engine core (and, on CPU, its worker) in child processes of the server. SIGSTOP freezes them: no
step runs, no token is produced, and what the front-end already received still flows to the clients. Whatever a
test does while the engine is held (disconnect, kill, scrape) therefore happens at a known point of the
generation, whatever the machine's speed. SIGCONT lets the engine go on; SIGKILL works on a held process too.
A test that must let the engine run a little and then act counts its steps instead (step_gate.py): a slice of time
between SIGCONT and SIGSTOP is only as short as a loaded machine's scheduler makes it.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import httpx
import psutil
from prometheus_client.parser import text_string_to_metric_families

from serving_image.triton_stub.stub_vllm import SUBMITTED


def _is_engine_process(process: psutil.Process) -> bool:
    """Not Python's multiprocessing resource tracker, and alive (a zombie or a process gone meanwhile is not)."""
    try:
        return "resource_tracker" not in " ".join(process.cmdline())
    except psutil.Error:
        return False


def _command(process: psutil.Process) -> list[str] | None:
    try:
        return process.cmdline()
    except psutil.Error:  # a zombie, or gone meanwhile
        return None


def _runs_vllm(process: psutil.Process) -> bool:
    return any((_command(child) or [""])[:1][0].startswith("VLLM::") for child in process.children())


def engine_stubs(root_pid: int, model: str | None = None, repository: str | None = None) -> list[psutil.Process]:
    """The Python backend stubs under `root_pid` that run a vLLM engine (the stand-in vllm backend's models and the
    scoring model: vLLM runs in the stub's process, its engine core and worker are the stub's children); with
    `model`, the stubs of that Triton model; with `repository`, of a model in that repository (another server under
    the same process may run a stub of the same model)."""
    found = []
    for process in psutil.Process(root_pid).children(recursive=True):
        command = _command(process)
        if not command or len(command) < 2 or not command[0].endswith("triton_python_backend_stub"):
            continue
        if model is not None and f"/{model}/1/" not in command[1]:
            continue
        if repository is not None and not command[1].startswith(repository):
            continue
        if _runs_vllm(process):
            found.append(process)
    return found


def engine_stub(root_pid: int, model: str | None = None, repository: str | None = None) -> psutil.Process:
    """The one stub `engine_stubs` finds."""
    found = engine_stubs(root_pid, model, repository)
    if len(found) != 1:
        raise AssertionError(f"process {root_pid} runs {len(found)} engine stubs (model {model!r}, repository "
                             f"{repository!r}): name the one")
    return found[0]


def submitted(metrics_url: str, model: str) -> float:
    """Generate requests the stand-in backend handed to `model`'s engine since the server started (its
    `llm_serving_engine_requests_submitted_total` on the pod's /metrics, stub_vllm.submitted_counter): a request
    counted there is in the engine, where a cancellation aborts it, held or not."""
    text = httpx.get(metrics_url, timeout=30).text
    return sum(sample.value for family in text_string_to_metric_families(text) if family.name == SUBMITTED
               for sample in family.samples
               if sample.name == f"{SUBMITTED}_total" and sample.labels.get("model") == model)


def wait_submitted(metrics_url: str, model: str, count: float, timeout_s: float = 60.0) -> None:
    """Until `submitted(metrics_url, model)` reaches `count`."""
    deadline = time.monotonic() + timeout_s
    while (seen := submitted(metrics_url, model)) < count:
        if time.monotonic() > deadline:
            raise AssertionError(f"{seen:g} requests submitted to {model}'s engine after {timeout_s:g} s, "
                                 f"expected {count:g}")
        time.sleep(0.05)


@dataclass(frozen=True)
class EngineProcesses:
    """The engine's processes under one server process."""

    pids: tuple[int, ...]

    @classmethod
    def of(cls, server_pid: int, model: str | None = None) -> EngineProcesses:
        """The vLLM engine's processes under a server. Over Triton (embedded, or a standalone tritonserver) the
        engine is vLLM's processes under the Python backend stub that runs it (`engine_stub`), the stub of `model`'s
        Triton model or the only one; the stub itself stays running, as the vLLM front-end in the server's process
        does otherwise. With vLLM in the server's process (vLLM's own server), every descendant but Python's
        multiprocessing resource tracker (not part of the engine)."""
        root = engine_stub(server_pid, model).pid if engine_stubs(server_pid) else server_pid
        pids = tuple(p.pid for p in psutil.Process(root).children(recursive=True) if _is_engine_process(p))
        if not pids:
            raise AssertionError(f"process {server_pid} has no engine child processes")
        return cls(pids)

    @classmethod
    def in_this_process(cls) -> EngineProcesses:
        """The engine processes that a vLLM engine of this very process (an AsyncLLM, as AsyncLlmModel runs it)
        spawned, with their own children. vLLM titles them `VLLM::<role>`; the other children a test session may
        have (finished helpers, a zombie not yet reaped) are left alone."""
        engines = []
        for child in psutil.Process().children():
            try:
                if child.cmdline()[:1] and child.cmdline()[0].startswith("VLLM::"):
                    engines.append(child)
            except psutil.Error:  # gone, or a zombie: not an engine
                continue
        pids = tuple(p.pid for engine in engines for p in (engine, *engine.children(recursive=True))
                     if _is_engine_process(p))
        if not pids:
            raise AssertionError("this process runs no vLLM engine process (none titled VLLM::...)")
        return cls(pids)

    def _signal_and_wait(self, sig: int, stopped: bool) -> None:
        for pid in self.pids:
            os.kill(pid, sig)
        # Signals are delivered asynchronously: wait until the kernel reports every process in the wanted state, so
        # that the caller's next step really happens with the engine held (or running).
        deadline = time.monotonic() + 30
        for pid in self.pids:
            while (psutil.Process(pid).status() == psutil.STATUS_STOPPED) != stopped:
                if time.monotonic() > deadline:
                    raise AssertionError(f"engine process {pid} did not {'stop' if stopped else 'continue'}")
                time.sleep(0.005)

    def hold(self) -> None:
        self._signal_and_wait(signal.SIGSTOP, stopped=True)

    def release(self) -> None:
        self._signal_and_wait(signal.SIGCONT, stopped=False)

    def kill(self) -> None:
        for pid in self.pids:
            os.kill(pid, signal.SIGKILL)

    @contextmanager
    def held(self) -> Iterator[None]:
        self.hold()
        try:
            yield
        finally:
            self.release()
