"""A serving process that gives up kills every descendant, including one orphaned before the kill
(serving_image/descendants.py): a stub's engine process whose parent died first would otherwise be re-parented to
init and outlive the pod's process, holding its output pipes.

The orphan is made before the kill, deterministically: a shell starts `sleep` in the background and exits, and the
process waits for the shell's exit before it kills. The test reads the process's output through pipes, as the
startup's tests and a container runtime do: EOF comes only when every holder of the pipe is gone.
"""

from __future__ import annotations

import subprocess
import sys

import pytest

SCRIPT = """
import subprocess, sys
from serving_image.descendants import adopt_orphans, kill_descendants
adopted = adopt_orphans() if sys.argv[1] == "adopt" else False
shell = subprocess.Popen(["sh", "-c", "sleep 600 & echo $!"], stdout=subprocess.PIPE, text=True)
orphan = int(shell.stdout.readline())
shell.wait()  # the shell is gone: `sleep` is an orphan now, holding this process's stdout and stderr
print(orphan, adopted, flush=True)
kill_descendants(timeout_s=5)
sys.exit(11)
"""


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


@pytest.mark.parametrize("mode", ["adopt", "no-adopt"])
def test_an_orphaned_descendant_is_killed_only_when_adopted(mode: str):
    process = subprocess.Popen([sys.executable, "-c", SCRIPT, mode], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                               text=True)
    orphan, adopted = process.stdout.readline().split()
    orphan = int(orphan)
    try:
        assert process.wait(timeout=60) == 11
        if mode == "adopt":
            assert adopted == "True"
            # EOF on both pipes: no descendant holds them
            out, err = process.communicate(timeout=60)
            assert not _alive(orphan), err
        else:  # without the subreaper the orphan went to init and survives the kill: what the module prevents
            assert _alive(orphan)
    finally:
        if _alive(orphan):
            subprocess.run(["kill", "-9", str(orphan)], check=False)
