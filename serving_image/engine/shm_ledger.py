"""Shared-memory segments that vLLM's engine processes created and left behind at shutdown, reclaimed by the
process that started the engine.

vLLM's engine core creates its message queues to the workers in POSIX shared memory (`ShmRingBuffer`, names
`psm_*`) and unlinks them only when those objects are garbage-collected. At shutdown the engine processes are
terminated before that happens, so the segments outlive them. Python's resource tracker (shared by the engine's
processes and the process that spawned them) then removes them when it exits, and prints "resource_tracker: There
appear to be N leaked shared_memory objects to clean up at shutdown" on every second or third stop.

Instead of silencing that warning, the segments are cleaned up by their owner's owner: every engine process records
the segments it creates in a ledger (a directory named by $LLM_SERVING_SHM_LEDGER, one file per process; vLLM loads
the recording through the `vllm.general_plugins` entry point in every process it starts), and once the engine has
shut down, the process that started it unlinks those still present and tells the resource tracker, which then has
nothing left to report. A segment vLLM unlinked itself is not in /dev/shm any more and is left alone.
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
from pathlib import Path

log = logging.getLogger(__name__)
LEDGER_ENV = "LLM_SERVING_SHM_LEDGER"
_PATCHED_ATTR = "_llm_serving_shm_ledger"
SHM_DIR = Path("/dev/shm")


def record_created_segments() -> bool:
    """In an engine process: append the name of every shared-memory ring buffer this process creates to its ledger
    file. Idempotent; returns True if the recording was installed (only when a ledger is set)."""
    directory = os.environ.get(LEDGER_ENV)
    if not directory:
        return False
    from vllm.distributed.device_communicators import shm_broadcast

    cls = shm_broadcast.ShmRingBuffer
    if getattr(cls, _PATCHED_ATTR, False):
        return False
    original_init = cls.__init__

    def init_and_record(self, *args, **kwargs):
        original_init(self, *args, **kwargs)
        if getattr(self, "is_creator", False):
            with open(Path(directory) / f"{os.getpid()}.names", "a", encoding="utf-8") as ledger:
                ledger.write(self.shared_memory.name + "\n")

    cls.__init__ = init_and_record
    setattr(cls, _PATCHED_ATTR, True)
    return True


class ShmLedger:
    """The ledger of one engine's processes, opened before the engine starts (its processes inherit the variable)
    and reclaimed after it has shut down."""

    def __init__(self) -> None:
        self.directory = Path(tempfile.mkdtemp(prefix="llm-serving-shm-"))
        os.environ[LEDGER_ENV] = str(self.directory)

    def recorded(self) -> list[str]:
        names: list[str] = []
        for ledger in sorted(self.directory.glob("*.names")):
            names += [line for line in ledger.read_text(encoding="utf-8").splitlines() if line]
        return names

    def reclaim(self) -> list[str]:
        """Unlink the recorded segments still present (their engine processes are gone) and unregister them from
        the resource tracker. Returns the names reclaimed."""
        import _posixshmem
        from multiprocessing import resource_tracker

        reclaimed = []
        for name in self.recorded():
            if not (SHM_DIR / name).exists():
                continue  # unlinked by vLLM itself
            try:
                _posixshmem.shm_unlink("/" + name)
            except FileNotFoundError:
                continue
            resource_tracker.unregister("/" + name, "shared_memory")
            reclaimed.append(name)
        if reclaimed:
            log.info("reclaimed %d shared-memory segment(s) the engine processes left behind: %s", len(reclaimed),
                     ", ".join(reclaimed))
        shutil.rmtree(self.directory, ignore_errors=True)
        if os.environ.get(LEDGER_ENV) == str(self.directory):
            del os.environ[LEDGER_ENV]
        return reclaimed
