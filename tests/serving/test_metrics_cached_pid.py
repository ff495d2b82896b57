"""`write_values_with_cached_pid` (serving_image/metrics/multiproc.py) against real prometheus_client multiprocess
files: the values it creates write without asking the process id, and a forked child still gets files of its own,
merged with the parent's by prometheus_client's own collector. Each case runs in a fresh interpreter, because the
value class is process-wide state of prometheus_client."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

from llm_serving.repository import REPO_ROOT

SCRIPT = textwrap.dedent("""
    import os, sys
    from prometheus_client import CollectorRegistry, Counter, values
    from prometheus_client.multiprocess import MultiProcessCollector
    from serving_image.metrics.multiproc import write_values_with_cached_pid

    print("switched=" + str(write_values_with_cached_pid()))
    counter = Counter("requests", "requests served", registry=None)
    real_getpid, calls = os.getpid, []
    os.getpid = lambda: calls.append(1) or real_getpid()
    for _ in range(100):
        counter.inc()
    os.getpid = real_getpid
    print(f"getpid calls while writing={len(calls)}")
    child = os.fork()
    if child == 0:
        counter.inc(5)  # the child's own file: the parent's 100 are not counted again
        os._exit(0)
    os.waitpid(child, 0)
    registry = CollectorRegistry()
    MultiProcessCollector(registry, path=os.environ["PROMETHEUS_MULTIPROC_DIR"])
    print(f"total={registry.get_sample_value('requests_total')}")
    files = sorted(os.listdir(os.environ["PROMETHEUS_MULTIPROC_DIR"]))
    print(f"files={files == sorted([f'counter_{os.getpid()}.db', f'counter_{child}.db'])}")
""")


def _run(script: str, multiproc_dir: Path | None) -> dict[str, str]:
    """Run `script` in a fresh interpreter, in multiprocess mode when `multiproc_dir` is given; its `key=value`
    lines."""
    env = {k: v for k, v in os.environ.items() if k.lower() != "prometheus_multiproc_dir"}
    if multiproc_dir is not None:
        env["PROMETHEUS_MULTIPROC_DIR"] = str(multiproc_dir)
    env["PYTHONPATH"] = str(REPO_ROOT)
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=60,
                          check=True)
    return dict(line.split("=", 1) for line in done.stdout.strip().splitlines())


def test_values_write_without_asking_the_pid_and_a_forked_child_writes_its_own_file(tmp_path):
    seen = _run(SCRIPT, tmp_path)
    assert seen["switched"] == "True"
    assert seen["getpid calls while writing"] == "0"
    assert float(seen["total"]) == 105.0
    assert seen["files"] == "True"


def test_without_multiprocess_mode_nothing_changes():
    seen = _run("from prometheus_client import values\n"
                "from serving_image.metrics.multiproc import write_values_with_cached_pid\n"
                "print(f'switched={write_values_with_cached_pid()}')\n"
                "print(f'mutex={values.ValueClass is values.MutexValue}')", None)
    assert seen == {"switched": "False", "mutex": "True"}
