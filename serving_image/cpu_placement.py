"""Keeping the serving processes off the cores that vLLM's CPU worker has bound itself to.

vLLM's CPU backend binds each worker's OpenMP threads to cores of their own (`VLLM_CPU_OMP_THREADS_BIND=auto`, its
default) and keeps the rest "reserved" for everything else: its scheduler (the engine core), the front-end
(vllm/utils/ompmultiprocessing.py, `reserve_cpu_num`). It binds only its own threads, though; the kernel still puts
any other runnable thread on a worker's core, and then the worker waits for it in the middle of a forward pass.
On this 2-core machine (worker bound to core 0) the platform's front (the server process with Triton's threads,
and the Python backend stubs) does about 370 µs of CPU per token at concurrency 1, in several wake-ups: measured
side by side, the median time per output token was 1.42-1.54 ms unplaced and 1.33-1.36 ms with the front kept on
core 1, where vLLM's own server measured 1.29-1.34 either way (docs/kserve.md, "Where the front runs").

So once startup is complete, the startup procedure moves the threads of the serving processes to the cores no
engine thread is bound to. The rules, in the order they are applied:
- The engine's cores are those a thread of vLLM's processes is bound to (a strict subset of `allowed`).
- Only a thread whose affinity is every core the process may use (`allowed`) is moved: a thread something bound
  on purpose keeps its binding (a server below this one that placed its own front already, for one).
- vLLM's own processes are never moved (vLLM titles them `VLLM::<role>`): its engine core and workers keep the
  placement vLLM gave them. The process the placement starts from (the server process) is always a front process.
- Nothing moves when no thread is bound (`VLLM_CPU_OMP_THREADS_BIND=nobind`, and every GPU node: vLLM's GPU
  workers bind no cores), or when the bound cores are all the cores there are.
Threads a moved thread starts later inherit its placement, and so would a process one of them starts: a model loaded
later gets a new stub from a moved Triton thread. So the startup procedure records the cores it was given before
anything starts ($LLM_SERVING_ENGINE_CPUS, inherited by Triton and its stubs), and the thread that starts a vLLM
engine widens itself back to them first (`restore_engine_cpus`): vLLM's processes, and the cores its CPU worker picks,
never depend on when the engine started.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger("llm_serving.cpu_placement")

ENV_FRONT_PLACEMENT = "LLM_SERVING_FRONT_PLACEMENT"
ENV_ENGINE_CPUS = "LLM_SERVING_ENGINE_CPUS"
PLACEMENT_MODES = ("auto", "off")
# vLLM titles its processes so (vllm.utils.system_utils.set_process_title)
VLLM_TITLE_PREFIX = "VLLM::"
PROC = Path("/proc")


@dataclass(frozen=True)
class Placement:
    """What the placement found and did: the cores engine threads are bound to, the cores the front now runs on
    (None: left to the kernel, and why), and how many threads of how many processes moved."""

    bound_cpus: frozenset[int]
    front_cpus: frozenset[int] | None
    reason: str
    moved_threads: int = 0
    front_processes: int = 0


def placement_mode(environ: dict[str, str] | os._Environ = os.environ) -> str:
    """$LLM_SERVING_FRONT_PLACEMENT: `auto` (the default) or `off`; anything else is refused, naming it."""
    mode = environ.get(ENV_FRONT_PLACEMENT, "auto")
    if mode not in PLACEMENT_MODES:
        raise ValueError(f"{ENV_FRONT_PLACEMENT}={mode!r}: must be one of {', '.join(PLACEMENT_MODES)}")
    return mode


def front_cpus(allowed: frozenset[int], bound: frozenset[int]) -> tuple[frozenset[int] | None, str]:
    """Where the front should run: the allowed cores no engine thread is bound to; None (and why) when that is no
    placement at all."""
    if not bound:
        return None, "no engine thread is bound to a core"
    rest = allowed - bound
    if not rest:
        return None, f"engine threads are bound to every allowed core ({_cores(allowed)})"
    return rest, f"engine threads are bound to cores {_cores(bound)}"


def _cores(cpus: frozenset[int]) -> str:
    return ",".join(str(c) for c in sorted(cpus))


def _children_by_parent() -> dict[int, list[int]]:
    children: dict[int, list[int]] = {}
    for entry in PROC.iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:  # gone meanwhile
            continue
        # the command name (field 2) may hold spaces and parentheses: the fields after the last ')' are plain
        ppid = int(stat[stat.rindex(")") + 2:].split()[1])
        children.setdefault(ppid, []).append(int(entry.name))
    return children


def process_tree(root: int) -> list[int]:
    """root and every process below it."""
    children = _children_by_parent()
    tree, todo = [], [root]
    while todo:
        pid = todo.pop()
        tree.append(pid)
        todo.extend(children.get(pid, ()))
    return tree


def process_title(pid: int) -> str:
    """The process's title: its command line's first word (vLLM rewrites it to `VLLM::<role>`); "" once it is gone."""
    try:
        return (PROC / str(pid) / "cmdline").read_bytes().split(b"\0")[0].decode(errors="replace")
    except OSError:
        return ""


def threads(pid: int) -> list[int]:
    """The process's thread ids ([] once it is gone)."""
    try:
        return [int(t) for t in os.listdir(PROC / str(pid) / "task")]
    except OSError:
        return []


def _affinity(tid: int) -> frozenset[int] | None:
    try:
        return frozenset(os.sched_getaffinity(tid))
    except OSError:  # the thread ended
        return None


def keep_front_off_engine_cores(root: int | None = None) -> Placement:
    """Apply the rules of this module's docstring to root's process tree (default: this process)."""
    root = os.getpid() if root is None else root
    allowed = _affinity(root)
    if allowed is None:
        return Placement(frozenset(), None, f"process {root} is gone")
    front, engine = [], []
    for pid in process_tree(root):
        (engine if pid != root and process_title(pid).startswith(VLLM_TITLE_PREFIX) else front).append(pid)
    # the engine's cores: what vLLM's own threads are bound to (a front thread bound elsewhere, such as a server below
    # this one that placed itself already, says nothing about where the engine computes)
    bound = frozenset().union(*(a for pid in engine for t in threads(pid)
                                if (a := _affinity(t)) is not None and a < allowed))
    cpus, reason = front_cpus(allowed, bound)
    if cpus is None:
        return Placement(bound, None, reason)
    moved = 0
    for pid in front:
        for tid in threads(pid):
            if _affinity(tid) != allowed:
                continue
            try:
                os.sched_setaffinity(tid, cpus)
            except ProcessLookupError:
                continue
            moved += 1
    return Placement(bound, cpus, reason, moved, len(front))


def remember_engine_cpus(environ: dict[str, str] | os._Environ = os.environ) -> frozenset[int]:
    """Record this process's cores for the engines it starts ($LLM_SERVING_ENGINE_CPUS), unless a parent recorded
    them already; returns what is recorded."""
    if ENV_ENGINE_CPUS not in environ:
        environ[ENV_ENGINE_CPUS] = _cores(frozenset(os.sched_getaffinity(0)))
    return engine_cpus(environ)


def engine_cpus(environ: dict[str, str] | os._Environ = os.environ) -> frozenset[int]:
    """The cores $LLM_SERVING_ENGINE_CPUS records (a comma-separated list of core numbers); a value that is not one
    is refused, naming the variable."""
    value = environ.get(ENV_ENGINE_CPUS, "")
    try:
        cpus = frozenset(int(part) for part in value.split(","))
    except ValueError:
        raise ValueError(f"{ENV_ENGINE_CPUS}={value!r}: must be a comma-separated list of core numbers, "
                         "such as 0,1") from None
    if any(c < 0 for c in cpus):
        raise ValueError(f"{ENV_ENGINE_CPUS}={value!r}: core numbers are not negative")
    return cpus


def restore_engine_cpus(environ: dict[str, str] | os._Environ = os.environ) -> frozenset[int] | None:
    """Before a vLLM engine starts, on the thread that starts it: that thread back on the cores the startup procedure
    was given (its processes inherit them). None, and nothing changed, outside a server ($LLM_SERVING_ENGINE_CPUS
    unset)."""
    if ENV_ENGINE_CPUS not in environ:
        return None
    cpus = engine_cpus(environ)
    try:
        os.sched_setaffinity(0, cpus)
    except OSError:  # EINVAL: none of them is a core this process may use
        raise ValueError(f"{ENV_ENGINE_CPUS}={environ[ENV_ENGINE_CPUS]!r}: none of these cores is available to this "
                         f"process (it may use {_cores(frozenset(os.sched_getaffinity(0)))})") from None
    return cpus


def describe(placement: Placement) -> str:
    """The startup log's line for a placement."""
    if placement.front_cpus is None:
        return f"serving processes left where the kernel puts them: {placement.reason}"
    return (f"serving processes kept off the engine's cores: {placement.reason}, so {placement.moved_threads} "
            f"threads of {placement.front_processes} processes now run on cores {_cores(placement.front_cpus)}")
