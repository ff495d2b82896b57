"""The lazy-loading FSx stand-in that the rehearsal and bench/cold_cache.py mount
(rehearsal/lazy_cache.py): its FUSE operations called directly (no mount here: `make test` needs
neither root nor libfuse), with the delay recorded instead of slept."""

from __future__ import annotations

import os

from rehearsal import lazy_cache


def test_the_first_read_of_a_file_pays_the_lazy_load_once(tmp_path, monkeypatch):
    slept: list[float] = []
    monkeypatch.setattr(lazy_cache.time, "sleep", slept.append)
    (tmp_path / "weights.bin").write_bytes(b"\0" * (2 << 20))
    ops = lazy_cache.LazyLoadingCache(tmp_path, mib_s=4.0, first_byte_s=0.25)
    fh = ops.open("/weights.bin", os.O_RDONLY)
    try:
        assert ops.read("/weights.bin", 4096, 0, fh) == b"\0" * 4096
        assert ops.read("/weights.bin", 4096, 4096, fh) == b"\0" * 4096  # resident now: no second load
    finally:
        ops.release("/weights.bin", fh)
    assert slept == [0.25 + 2 / 4.0]
    assert ops.resident == {"/weights.bin"} and ops.loaded_bytes == 2 << 20
    assert ops.getattr("/weights.bin")["st_size"] == 2 << 20
    assert sorted(ops.readdir("/", None)) == [".", "..", "weights.bin"]

