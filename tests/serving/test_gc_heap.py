"""`freeze_startup_heap` (serving_image/gc_heap.py) in a fresh interpreter (a freeze is process-wide state of the
collector): startup's garbage is collected before the freeze, what survived is out of the collector's sight, and the
collector still works for everything allocated after it."""

from __future__ import annotations

import subprocess
import sys
import textwrap

from llm_serving.repository import REPO_ROOT

SCRIPT = textwrap.dedent("""
    import gc, weakref
    from serving_image.gc_heap import freeze_startup_heap

    class Node:
        pass

    def cycle():
        a, b = Node(), Node()
        a.other, b.other = b, a
        return a

    gc.disable()  # nothing collects behind the test's back: only the calls below do
    old = cycle()
    gc.collect()  # survived a full collection: in the oldest generation, where a young collection never looks
    dead_before = weakref.ref(old)
    del old  # startup's garbage: a cycle nothing points to any more
    kept = cycle()  # what startup leaves alive
    frozen = freeze_startup_heap()
    print(f"garbage before the freeze collected={dead_before() is None}")
    print(f"frozen={frozen > 0 and gc.get_freeze_count() == frozen}")
    print(f"kept out of the collector's sight={not any(o is kept for o in gc.get_objects())}")
    dead_after = weakref.ref(cycle())
    gc.collect()
    print(f"garbage after the freeze collected={dead_after() is None}")
""")


def test_freeze_collects_startup_garbage_then_hides_what_survived():
    root = REPO_ROOT
    proc = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, cwd=root, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines() == ["garbage before the freeze collected=True", "frozen=True",
                                        "kept out of the collector's sight=True",
                                        "garbage after the freeze collected=True"]
