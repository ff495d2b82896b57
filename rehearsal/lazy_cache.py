"""A stand-in for FSx for Lustre's lazy loading (no FSx here): the rehearsal's model-cache step
(rehearsal/model_cache.py) and `make bench` (bench/cold_cache.py) mount it.

A read-only FUSE passthrough of a directory. A file counts as *released* (its metadata imported, its data still in
S3) until it has been read once. The first read of a released file costs the lazy load from S3: `first_byte_s`,
plus its size at `mib_s`, charged once per file. After that the file is *resident* and reads cost what the
underlying disk costs. The delay model is this module's assumption, not a measurement of FSx (the defaults,
FIRST_BYTE_S and MIB_S). A file is loaded at most once, as a Lustre HSM restore is, and concurrent first readers
wait for the same load. The view allows other users (`allow_other`): the rehearsal's containers, which run as
another uid, read through it.

`step_one_seconds` times what the view is there to show: a pod's startup step 1 (unpack-and-verify, which reads
every file of the package) on a model cache.

Needs root, /dev/fuse, libfuse2 (Debian's package) and fusepy (the `local` extra): never the serving image's.
"""

from __future__ import annotations

import errno
import os
import threading
import time
from pathlib import Path

from llm_serving import pod_contract as pc

MIB_S = 100.0  # assumed lazy-load throughput per file from S3
FIRST_BYTE_S = 0.05  # assumed per-file latency of a lazy load


def _fuse():
    try:
        import fuse
    except (ImportError, OSError) as err:  # fusepy absent, or libfuse.so.2 absent (fusepy raises OSError)
        raise RuntimeError(f"the lazy-loading FSx stand-in needs fusepy and libfuse2 ({err}); `make rehearse` "
                           f"and `make bench` install both") from None
    return fuse


class LazyLoadingCache:
    """The FUSE operations: passthrough reads of `source`, the first read of each file delayed as a lazy load."""

    def __init__(self, source: Path, mib_s: float, first_byte_s: float):
        self.source = Path(source)
        self.mib_s = mib_s
        self.first_byte_s = first_byte_s
        self.resident: set[str] = set()
        self.loaded_bytes = 0
        self._locks: dict[str, threading.Lock] = {}
        self._guard = threading.Lock()

    def _real(self, path: str) -> str:
        return str(self.source / path.lstrip("/"))

    def _load(self, path: str) -> None:
        if path in self.resident:
            return
        with self._guard:
            lock = self._locks.setdefault(path, threading.Lock())
        with lock:
            if path in self.resident:
                return
            size = os.path.getsize(self._real(path))
            time.sleep(self.first_byte_s + size / (self.mib_s * 2**20))
            self.loaded_bytes += size
            self.resident.add(path)

    # -- fusepy's Operations, by name (read-only) ----------------------------------------------------------------

    def __call__(self, op: str, *args):
        method = getattr(self, op, None)
        if method is None:
            raise _fuse().FuseOSError(errno.ENOSYS)
        return method(*args)

    def init(self, path: str) -> None:
        return None

    def destroy(self, path: str) -> None:
        return None

    def access(self, path: str, amode: int) -> int:
        if amode & os.W_OK:
            raise _fuse().FuseOSError(errno.EROFS)
        return 0

    def flush(self, path: str, fh: int) -> int:
        return 0

    def opendir(self, path: str) -> int:
        return 0

    def releasedir(self, path: str, fh: int) -> int:
        return 0

    def getattr(self, path: str, fh=None) -> dict:
        try:
            st = os.lstat(self._real(path))
        except FileNotFoundError:
            raise _fuse().FuseOSError(errno.ENOENT) from None
        keys = ("st_atime", "st_ctime", "st_gid", "st_mode", "st_mtime", "st_nlink", "st_size", "st_uid")
        return {k: getattr(st, k) for k in keys}

    def readdir(self, path: str, fh) -> list[str]:
        return [".", "..", *os.listdir(self._real(path))]

    def open(self, path: str, flags: int) -> int:
        if flags & (os.O_WRONLY | os.O_RDWR):
            raise _fuse().FuseOSError(errno.EROFS)
        return os.open(self._real(path), os.O_RDONLY)

    def read(self, path: str, size: int, offset: int, fh: int) -> bytes:
        self._load(path)
        return os.pread(fh, size, offset)

    def release(self, path: str, fh: int) -> int:
        os.close(fh)
        return 0

    def statfs(self, path: str) -> dict:
        st = os.statvfs(self._real(path))
        return {k: getattr(st, k) for k in ("f_bavail", "f_bfree", "f_blocks", "f_bsize", "f_favail", "f_ffree",
                                             "f_files", "f_flag", "f_frsize", "f_namemax")}


class MountedCache:
    """`with MountedCache(source, mountpoint, ...) as cache:` the lazy-loading view of `source` at `mountpoint`."""

    def __init__(self, source: Path, mountpoint: Path, mib_s: float, first_byte_s: float):
        self.ops = LazyLoadingCache(source, mib_s, first_byte_s)
        self.mountpoint = Path(mountpoint)
        self._thread: threading.Thread | None = None

    def __enter__(self) -> LazyLoadingCache:
        fuse = _fuse()
        self.mountpoint.mkdir(parents=True, exist_ok=True)
        self._thread = threading.Thread(
            target=lambda: fuse.FUSE(self.ops, str(self.mountpoint), foreground=True, ro=True, nothreads=False,
                                     allow_other=True), daemon=True)
        self._thread.start()
        deadline = time.monotonic() + 30
        while not os.path.ismount(self.mountpoint):
            if time.monotonic() > deadline or not self._thread.is_alive():
                raise RuntimeError(f"the lazy-loading FSx stand-in did not mount at {self.mountpoint}")
            time.sleep(0.05)
        return self.ops

    def __exit__(self, *exc) -> None:
        import subprocess

        subprocess.run(["umount", str(self.mountpoint)], check=False)
        if self._thread is not None:
            self._thread.join(timeout=10)


def step_one_seconds(cache_root: Path, model_id: str, version: str, workdir: Path) -> float:
    """Seconds of startup step 1 (unpack-and-verify) for (model_id, version) on the model cache at `cache_root`, as
    a pod that mounts it at its model-cache mount runs it."""
    from serving_image import startup

    package = cache_root / pc.FSX_MODELS_PATH.lstrip("/") / pc.model_cache_key(model_id, version)
    config = startup.StartupConfig(package=package, workdir=workdir, multiproc_dir=workdir / "prometheus",
                                   expected=startup.PodExpectation(model_cache=cache_root))
    t0 = time.perf_counter()
    startup._unpack(config)
    return time.perf_counter() - t0
