"""Hold a running vLLM engine still, so that a test that needs a race forces it instead of hoping for it.

vLLM runs its engine core (and, on CPU, its worker) in child processes of the server. SIGSTOP freezes them: no
step runs, no token is produced, and what the front-end already received still flows to the clients. Whatever a
test does while the engine is held (disconnect, kill, scrape) therefore happens at a known point of the
generation, whatever the machine's speed. SIGCONT lets the engine go on; SIGKILL works on a held process too.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import psutil


def _is_engine_process(process: psutil.Process) -> bool:
    """Not Python's multiprocessing resource tracker, and alive (a zombie or a process gone meanwhile is not)."""
    try:
        return "resource_tracker" not in " ".join(process.cmdline())
    except psutil.Error:
        return False


def _is_engine_host(process: psutil.Process, model: str | None) -> bool:
    """The stand-in backend's engine host process (of `model`'s Triton model, when given)."""
    try:
        command = process.cmdline()
    except psutil.Error:
        return False
    if "serving_image.triton.engine_host" not in command:
        return False
    return model is None or any(f"/{model}/1/" in arg for arg in command)


@dataclass(frozen=True)
class EngineProcesses:
    """The engine's processes under one server process."""

    pids: tuple[int, ...]

    @classmethod
    def of(cls, server_pid: int, model: str | None = None) -> EngineProcesses:
        """The vLLM engine's processes under a server. Over Triton (embedded, or a standalone tritonserver) the
        engine is vLLM's processes under the stand-in backend's engine host (serving_image/triton/engine_host.py,
        under the backend's stub), the host of `model`'s Triton model or the only one; the host itself stays running,
        as the vLLM front-end in the server's process does otherwise. With vLLM in the server's process (vLLM's own
        server), every descendant but Python's multiprocessing resource tracker (not part of the engine)."""
        descendants = psutil.Process(server_pid).children(recursive=True)
        hosts = [p for p in descendants if _is_engine_host(p, model)]
        if len(hosts) > 1:
            raise AssertionError(f"process {server_pid} runs {len(hosts)} engine hosts: name the model")
        if hosts:
            descendants = hosts[0].children(recursive=True)
        pids = tuple(p.pid for p in descendants if _is_engine_process(p))
        if not pids:
            raise AssertionError(f"process {server_pid} has no engine child processes")
        return cls(pids)

    @classmethod
    def in_this_process(cls) -> EngineProcesses:
        """The engine processes that a vLLM engine of this very process (an AsyncLLM, as VllmLocalEngine runs it)
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
