"""serving_image/cpu_placement.py: the serving processes moved off the cores an engine's threads are bound to, on a
real process tree: a root standing for the server process, a child standing for a Python backend stub, and one
titled as vLLM titles its worker (`VLLM::Worker`, with setproctitle, as vLLM sets it) whose main thread is bound to
one core as vLLM's CPU worker binds its OpenMP threads. The real placement of a real server is checked on the
suite's shared server (test_startup.py)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from llm_serving.repository import REPO_ROOT
from serving_image import cpu_placement as cp

ALL = frozenset(os.sched_getaffinity(0))
needs_two_cores = pytest.mark.skipif(len(ALL) < 2, reason="a placement needs a core left over for the front")

# Each process of the tree: start a second thread, bind (or not) its main thread (the second keeps every core), title
# itself, then report ready.
PROCESS = textwrap.dedent("""
    import os, sys, threading, time
    title, bind, ready = sys.argv[1], sys.argv[2], sys.argv[3]
    threading.Thread(target=time.sleep, args=(600,), daemon=True).start()
    if bind:
        os.sched_setaffinity(0, {int(c) for c in bind.split(",")})
    if title:
        import setproctitle
        setproctitle.setproctitle(title)
    open(ready, "w").close()
    time.sleep(600)
""")
ROOT = textwrap.dedent("""
    import subprocess, sys, time
    script, children = sys.argv[1], sys.argv[2:]
    procs = [subprocess.Popen([sys.executable, "-c", script, *children[i:i + 3]]) for i in range(0, len(children), 3)]
    open(children[-1] + ".root", "w").close()
    time.sleep(600)
""")


def _tree(tmp_path: Path, children: list[tuple[str, str]]) -> subprocess.Popen:
    """A root process with one child per (title, bound cores), each ready (bound and titled) when this returns."""
    args = []
    for i, (title, bind) in enumerate(children):
        args += [title, bind, str(tmp_path / f"ready-{i}")]
    root = subprocess.Popen([sys.executable, "-c", ROOT, PROCESS, *args])
    deadline = time.monotonic() + 60
    while not all((tmp_path / f"ready-{i}").exists() for i in range(len(children))):
        assert root.poll() is None, "the process tree failed to start"
        assert time.monotonic() < deadline, "the process tree did not come up in 60 s"
        time.sleep(0.05)
    return root


def _affinities(pid: int) -> list[frozenset[int]]:
    return sorted((frozenset(os.sched_getaffinity(t)) for t in cp.threads(pid)), key=sorted)


def _children(root: subprocess.Popen) -> dict[str, int]:
    """The root's children by title: "VLLM::Worker", or "" for the untitled (stub-like) one."""
    children = {}
    for pid in cp.process_tree(root.pid)[1:]:
        title = cp.process_title(pid)
        children[title if title.startswith(cp.VLLM_TITLE_PREFIX) else ""] = pid
    return children


@pytest.fixture
def cleanup():
    roots: list[subprocess.Popen] = []
    yield roots.append
    for root in roots:
        for pid in reversed(cp.process_tree(root.pid)):
            try:
                os.kill(pid, 9)
            except ProcessLookupError:
                pass
        root.wait()


@needs_two_cores
def test_front_moves_off_the_bound_core_and_vllm_processes_keep_theirs(tmp_path, cleanup):
    engine_core = min(ALL)
    root = _tree(tmp_path, [("", ""), ("VLLM::Worker", str(engine_core))])
    cleanup(root)
    children = _children(root)
    stub, worker = children[""], children["VLLM::Worker"]
    worker_before = _affinities(worker)
    assert worker_before == sorted([frozenset({engine_core}), ALL], key=sorted)

    placement = cp.keep_front_off_engine_cores(root.pid)

    front = ALL - {engine_core}
    assert placement.bound_cpus == {engine_core}
    assert placement.front_cpus == front
    assert placement.front_processes == 2
    # every thread of the root and the stub-like child moved, and nothing else
    assert _affinities(root.pid) == [front] * len(_affinities(root.pid))
    assert _affinities(stub) == [front, front]
    assert placement.moved_threads == len(cp.threads(root.pid)) + 2
    # vLLM's process untouched: its bound thread, and its unbound one too
    assert _affinities(worker) == worker_before
    assert f"bound to cores {engine_core}" in cp.describe(placement)


@needs_two_cores
def test_a_thread_bound_on_purpose_keeps_its_binding_and_is_not_the_engines(tmp_path, cleanup):
    # a front process's own bound thread (a server below that placed its front already) is neither moved nor taken
    # for the engine's cores; the engine's are those its worker bound
    first, last = min(ALL), max(ALL)
    root = _tree(tmp_path, [("", str(last)), ("VLLM::Worker", str(first))])
    cleanup(root)
    stub = _children(root)[""]
    placement = cp.keep_front_off_engine_cores(root.pid)
    assert placement.bound_cpus == {first} and placement.front_cpus == ALL - {first}
    assert _affinities(stub) == sorted([frozenset({last}), ALL - {first}], key=sorted)


def test_nothing_moves_when_no_thread_is_bound(tmp_path, cleanup):
    # VLLM_CPU_OMP_THREADS_BIND=nobind, and every GPU node
    root = _tree(tmp_path, [("", ""), ("VLLM::Worker", "")])
    cleanup(root)
    placement = cp.keep_front_off_engine_cores(root.pid)
    assert placement.front_cpus is None and placement.moved_threads == 0
    assert cp.describe(placement) == ("serving processes left where the kernel puts them: no engine thread is bound "
                                      "to a core")
    assert all(a == ALL for pid in cp.process_tree(root.pid) for a in _affinities(pid))


def test_front_cpus_is_the_rest_of_the_allowed_cores():
    assert cp.front_cpus(frozenset({0, 1, 2, 3}), frozenset({0, 1}))[0] == {2, 3}
    assert cp.front_cpus(frozenset({0, 1}), frozenset()) == (None, "no engine thread is bound to a core")
    assert cp.front_cpus(frozenset({0, 1}), frozenset({0, 1})) == (
        None, "engine threads are bound to every allowed core (0,1)")


def test_placement_mode_refuses_what_it_cannot_read():
    assert cp.placement_mode({}) == "auto"
    assert cp.placement_mode({cp.ENV_FRONT_PLACEMENT: "off"}) == "off"
    with pytest.raises(ValueError, match=r"LLM_SERVING_FRONT_PLACEMENT='on': must be one of auto, off"):
        cp.placement_mode({cp.ENV_FRONT_PLACEMENT: "on"})


def test_engine_cpus_are_recorded_once_and_read_back():
    environ: dict[str, str] = {}
    assert cp.remember_engine_cpus(environ) == ALL
    environ[cp.ENV_ENGINE_CPUS] = "0"
    assert cp.remember_engine_cpus(environ) == {0}  # a parent's record wins: the stubs read the server's
    with pytest.raises(ValueError, match=r"LLM_SERVING_ENGINE_CPUS='0-1': must be a comma-separated list"):
        cp.engine_cpus({cp.ENV_ENGINE_CPUS: "0-1"})
    assert cp.restore_engine_cpus({}) is None


def test_recorded_cores_this_process_cannot_use_are_refused_by_name():
    unusable = max(os.cpu_count() or 1, *ALL) + 64
    with pytest.raises(ValueError, match=rf"LLM_SERVING_ENGINE_CPUS='{unusable}': none of these cores is available"):
        cp.restore_engine_cpus({cp.ENV_ENGINE_CPUS: str(unusable)})
    assert frozenset(os.sched_getaffinity(0)) == ALL  # nothing changed


@needs_two_cores
def test_the_thread_that_starts_an_engine_gets_the_recorded_cores_back():
    # a stub started by a moved Triton thread inherits the front's cores; its engine's processes must not
    script = textwrap.dedent(f"""
        import os
        from serving_image import cpu_placement as cp
        os.sched_setaffinity(0, {{{max(ALL)}}})
        print(sorted(cp.restore_engine_cpus({{cp.ENV_ENGINE_CPUS: "{",".join(map(str, sorted(ALL)))}"}})),
              sorted(os.sched_getaffinity(0)))
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True,
                         cwd=REPO_ROOT).stdout.split("]")
    assert out[0] + "]" == str(sorted(ALL)) and out[1].strip() + "]" == str(sorted(ALL))


def test_startup_refuses_a_placement_setting_it_cannot_read(tmp_path):
    # before anything starts (no package is even opened): exit status 2, naming the variable and the value
    from llm_serving import pod_contract as pc

    done = subprocess.run(pc.startup_argv(sys.executable, tmp_path / "no-package", workdir=tmp_path / "run"),
                          capture_output=True, text=True, timeout=240,
                          env={**os.environ, cp.ENV_FRONT_PLACEMENT: "pinned"})
    assert done.returncode == 2, done.stderr[-2000:]
    assert "LLM_SERVING_FRONT_PLACEMENT='pinned': must be one of auto, off" in done.stderr
    assert "startup step" not in done.stderr


def test_a_sigterm_while_the_process_settles_drains_instead_of_killing():
    # The ports are open before the heap freeze and the placement run (startup.serve_until_stopped's `settle`): a
    # SIGTERM then (forced here, from inside `settle`) must reach the procedure's handler: drain, exit status 0.
    script = textwrap.dedent("""
        import asyncio, os, signal
        from serving_image import startup

        class Engine:
            dead_reason = None
            async def shutdown(self):
                print("engine shut down")

        started = startup.Started(package=None, served_model=Engine(), timings=[])
        def settle():
            os.kill(os.getpid(), signal.SIGTERM)
            print("settled")
        code = asyncio.run(startup.serve_until_stopped(started, 0.0, settle))
        print("exit", code, "draining", started.draining)
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120,
                          cwd=REPO_ROOT)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split() == ["settled", "engine", "shut", "down", "exit", "0", "draining", "True"]
