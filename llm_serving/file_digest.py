"""Files' SHA-256, in this process or in a process of its own.

`sha256_file` hashes one file here. `python -m llm_serving.file_digest [--nice N] [--threads N] PATH...` hashes many
in a child process and prints `INDEX sha256 HEX` (or `INDEX error MESSAGE`) per file as each completes: the startup
hashes a package's weights there beside the engine's start (llm_serving.package `PendingChecksums.verify`). A process
of its own, not a thread, because a low-priority thread of the server's own process would hold the server's GIL while
the scheduler keeps it waiting, and the server's every thread would wait with it. Imports only the standard library,
so the child starts in tens of milliseconds.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import sys
import threading
from concurrent.futures import ThreadPoolExecutor, as_completed
from pathlib import Path

CHUNK = 1 << 20
LOWEST_NICE = 19


class ChecksumsCancelled(Exception):
    """A hashing stopped by its `stop` event before it had read everything."""


def sha256_file(path: Path | str, stop: threading.Event | None = None) -> str:
    """The file's SHA-256; ChecksumsCancelled as soon as `stop` is set."""
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while chunk := handle.read(CHUNK):
            if stop is not None and stop.is_set():
                raise ChecksumsCancelled(str(path))
            digest.update(chunk)
    return digest.hexdigest()


def _hash_one(path: str) -> str:
    try:
        return f"sha256 {sha256_file(path)}"
    except OSError as exc:
        return f"error {exc.strerror or exc}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m llm_serving.file_digest", description=__doc__.split("\n\n")[0])
    parser.add_argument("--nice", type=int, default=0, help="add this to the process's nice value first (19: lowest)")
    parser.add_argument("--threads", type=int, default=1, help="files hashed at once")
    parser.add_argument("paths", nargs="+")
    args = parser.parse_args(argv)
    if args.nice:
        # A nice value, not SCHED_IDLE: at nice 19 the process gets about 1.5 % of a CPU a nice-0 thread wants (CFS
        # weights 15 and 1024), so it slows nothing, yet it always progresses; SCHED_IDLE can starve behind a CPU
        # kept busy by anything else (a spinning OpenMP pool), and the server's readiness waits for this.
        os.nice(args.nice)
    with ThreadPoolExecutor(max(1, min(args.threads, len(args.paths)))) as pool:
        futures = {pool.submit(_hash_one, path): index for index, path in enumerate(args.paths)}
        for future in as_completed(futures):
            print(f"{futures[future]} {future.result()}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
