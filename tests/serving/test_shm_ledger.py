"""The shared-memory ledger (serving_image/engine/shm_ledger.py), with Python's real resource tracker: a segment an
engine process created and left behind is reclaimed by the process that started it, and the tracker reports
nothing at exit. Without the reclaim, the same scenario prints the tracker's warning (the check can fail)."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

from llm_serving.repository import REPO_ROOT

SCRIPT = textwrap.dedent('''
    import multiprocessing, os, sys
    from multiprocessing import shared_memory
    from pathlib import Path

    from serving_image.engine.shm_ledger import LEDGER_ENV, ShmLedger

    def create_and_leave():
        # As vLLM's engine core does at shutdown: creates a segment, records it, and exits without unlinking it.
        segment = shared_memory.SharedMemory(create=True, size=4096)
        (Path(os.environ[LEDGER_ENV]) / f"{os.getpid()}.names").write_text(segment.name + "\\n")
        print(segment.name, flush=True)
        os._exit(0)

    if __name__ == "__main__":
        ledger = ShmLedger()
        child = multiprocessing.get_context("spawn").Process(target=create_and_leave)
        child.start()
        child.join()
        if sys.argv[1] == "reclaim":
            print("reclaimed", ",".join(ledger.reclaim()), flush=True)
''')


def _run(tmp_path: Path, mode: str) -> tuple[str, str, str]:
    script = tmp_path / "engine_like.py"
    script.write_text(SCRIPT)
    repo = REPO_ROOT
    result = subprocess.run([sys.executable, str(script), mode], capture_output=True, text=True, timeout=120,
                            cwd=repo, env={"PYTHONPATH": str(repo), "PATH": "/usr/bin:/bin"})
    assert result.returncode == 0, result.stderr
    name = result.stdout.split()[0]
    return name, result.stdout, result.stderr


def test_a_segment_left_by_an_engine_process_is_reclaimed_and_the_tracker_reports_nothing(tmp_path):
    name, out, err = _run(tmp_path, "reclaim")
    assert f"reclaimed {name}" in out
    assert not (Path("/dev/shm") / name).exists()
    assert "leaked shared_memory" not in err, err


def test_without_the_reclaim_the_tracker_reports_the_leak(tmp_path):
    name, _out, err = _run(tmp_path, "leave")
    assert "leaked shared_memory" in err, err
    assert not (Path("/dev/shm") / name).exists()  # the tracker removed it, with its warning
