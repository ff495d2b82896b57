"""The startup's deferred data checksums (docs/architecture.md §3.4 threat model, §3.7 step 1).

`open_package(..., defer_data=True)` leaves the SHA-256 of safetensors files to its caller (the startup hashes them
while the engine reads the same bytes, and holds readiness until they match) and checks everything else at once:
every other file's checksum and the listing; `pending.check_complete()` checks each deferred file's header accounts
for every byte (the startup runs it in step 1, after the Deployment's identity checks).
Each test builds a real package with real safetensors files and only the defect under test.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest
import torch
from safetensors.torch import save_file

from llm_serving import pod_contract as pc
from llm_serving.file_digest import LOWEST_NICE
from llm_serving.manifest import MANIFEST_NAME
from llm_serving.package import (
    ChecksumsCancelled,
    PackageError,
    PackageSpec,
    PendingChecksums,
    PendingFile,
    build_package,
    open_package,
    write_tarball,
)
from llm_serving.ports import accepts, free_port


@pytest.fixture()
def package(tmp_path: Path) -> Path:
    """A package directory (as on the model cache) with two real safetensors shards, a config and a pickled file."""
    model = tmp_path / "hf-model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"model_type": "llama"}))
    (model / "tokenizer.json").write_text("{}")
    save_file({"a": torch.arange(4096, dtype=torch.float32)}, str(model / "model-00001-of-00002.safetensors"))
    save_file({"b": torch.ones(2048, dtype=torch.float32)}, str(model / "model-00002-of-00002.safetensors"))
    (model / "extra.bin").write_bytes(b"\x80\x04pickled")
    return build_package(PackageSpec(model, "demo", "1"), tmp_path / "pkg")


def _flip(path: Path, offset: int) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0xFF
    path.write_bytes(bytes(data))


def test_only_safetensors_are_deferred_and_they_verify(package: Path):
    opened = open_package(package, defer_data=True)
    opened.pending.check_complete()
    assert sorted(f.rel for f in opened.pending.files) == ["weights/model-00001-of-00002.safetensors",
                                                           "weights/model-00002-of-00002.safetensors"]
    assert opened.pending.bytes == sum((package / f.rel).stat().st_size for f in opened.pending.files)
    opened.pending.verify(threads=2)  # nothing differs: returns
    assert not open_package(package).pending.files  # without defer_data every file is hashed at open


def test_a_tampered_data_file_opens_deferred_and_fails_its_check_naming_it(package: Path):
    shard = package / "weights" / "model-00002-of-00002.safetensors"
    _flip(shard, shard.stat().st_size - 3)  # in the tensor bytes: same size, same header
    opened = open_package(package, defer_data=True)
    with pytest.raises(PackageError, match=r"weights/model-00002-of-00002.safetensors: checksum mismatch"):
        opened.pending.verify(threads=2)
    with pytest.raises(PackageError, match=r"weights/model-00002-of-00002.safetensors: checksum mismatch"):
        open_package(package)


@pytest.mark.parametrize("change", ["truncate", "pad", "header"])
def test_an_incomplete_data_file_is_refused_by_the_cheap_check_naming_it(package: Path, change: str):
    shard = package / "weights" / "model-00001-of-00002.safetensors"
    data = shard.read_bytes()
    shard.write_bytes({"truncate": data[:-100], "pad": data + b"\0" * 8, "header": b"\xff" * 8 + data[8:]}[change])
    opened = open_package(package, defer_data=True)  # its listing and the other files' checksums hold
    with pytest.raises(PackageError, match=r"weights/model-00001-of-00002.safetensors: not a complete safetensors"):
        opened.pending.check_complete()


@pytest.mark.parametrize("name", ["weights/config.json", "weights/extra.bin", "weights/tokenizer.json"])
def test_files_that_are_not_safetensors_are_verified_at_open(package: Path, name: str):
    _flip(package / name, 1)
    with pytest.raises(PackageError, match=f"{name}: checksum mismatch"):
        open_package(package, defer_data=True)


def test_an_unlisted_or_missing_data_file_is_refused_at_open(package: Path):
    shard = package / "weights" / "model-00002-of-00002.safetensors"
    extra = package / "weights" / "model-00003-of-00002.safetensors"
    extra.write_bytes(shard.read_bytes())
    with pytest.raises(PackageError, match="weights/model-00003-of-00002.safetensors: file is not listed"):
        open_package(package, defer_data=True)
    extra.unlink()
    shard.unlink()
    with pytest.raises(PackageError, match="weights/model-00002-of-00002.safetensors: listed in .* but missing"):
        open_package(package, defer_data=True)


def test_the_first_failing_file_in_manifest_order_is_named_and_a_stop_cancels(package: Path):
    for shard in sorted((package / "weights").glob("*.safetensors")):
        _flip(shard, shard.stat().st_size - 1)
    opened = open_package(package, defer_data=True)
    with pytest.raises(PackageError, match=r"^weights/model-00001-of-00002.safetensors: checksum mismatch"):
        opened.pending.verify(threads=2)
    stop = threading.Event()
    stop.set()
    with pytest.raises(ChecksumsCancelled):
        opened.pending.verify(stop=stop)


# The hashing process is held on a FIFO (it blocks opening it until a writer comes), so each state is observed
# while it lasts instead of raced.


def _wait_for(predicate, what: str, timeout: float = 60.0):
    deadline = time.monotonic() + timeout
    while not (found := predicate()):
        assert time.monotonic() < deadline, f"never saw {what}"
        time.sleep(0.05)
    return found


def _hashers(fifo: Path) -> list[psutil.Process]:
    """The live hashing processes over `fifo` (this test's own, whatever another test left behind)."""
    found = []
    for child in psutil.Process().children(recursive=True):
        with contextlib.suppress(psutil.Error):
            argv = child.cmdline()
            if child.status() != psutil.STATUS_ZOMBIE and argv[2:3] and argv[2].endswith("file_digest.py") \
                    and str(fifo) in argv:
                found.append(child)
    return found


@pytest.fixture
def held(tmp_path: Path) -> Iterator[tuple[PendingChecksums, Path, bytes]]:
    """Pending checksums over a FIFO (answered when the test writes it) and a plain file."""
    fifo, plain = tmp_path / "held.safetensors", tmp_path / "plain.safetensors"
    os.mkfifo(fifo)
    data = b"held bytes" * 1000
    plain.write_bytes(b"plain")
    files = (PendingFile("weights/held.safetensors", fifo, hashlib.sha256(data).hexdigest(), len(data)),
             PendingFile("weights/plain.safetensors", plain, hashlib.sha256(b"plain").hexdigest(), 5))
    yield PendingChecksums(files), fifo, data
    for left in _hashers(fifo):  # a failed test's process, still held by the FIFO
        left.kill()


def _verify_in_thread(pending: PendingChecksums, **kwargs) -> tuple[threading.Thread, list[BaseException | None]]:
    outcome: list[BaseException | None] = []

    def run():
        try:
            pending.verify(**kwargs)
            outcome.append(None)
        except BaseException as exc:  # the test asserts on it
            outcome.append(exc)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, outcome


def test_low_priority_hashing_runs_at_nice_19_until_hurried_then_at_the_callers_priority(held):
    pending, fifo, data = held
    hurry = threading.Event()
    thread, outcome = _verify_in_thread(pending, threads=1, low_priority=True, hurry=hurry)
    slow = _wait_for(lambda: _hashers(fifo), "the low-priority hashing process")[0]
    # it lowers itself first thing, before it opens a file (the FIFO holds it until the test writes)
    _wait_for(lambda: slow.nice() == min(19, os.nice(0) + LOWEST_NICE), "the hashing process at nice 19")
    hurry.set()
    fast = _wait_for(lambda: [h for h in _hashers(fifo) if h.pid != slow.pid], "the hashing process hurried")[0]
    assert fast.nice() == os.nice(0)
    assert str(fifo) in fast.cmdline()  # the held file is hashed again; the plain one may have been answered
    _wait_for(lambda: not slow.is_running() or slow.status() == psutil.STATUS_ZOMBIE, "the slow process killed")
    with open(fifo, "wb") as writer:
        writer.write(data)
    thread.join(60)
    assert outcome == [None]


def test_a_hashing_process_that_dies_fails_the_check_and_a_stop_cancels(held):
    pending, fifo, _ = held
    thread, outcome = _verify_in_thread(pending, threads=2)
    _wait_for(lambda: _hashers(fifo), "the hashing process")[0].kill()
    thread.join(60)
    assert isinstance(outcome[0], PackageError)
    assert "the hashing process exited with -9" in str(outcome[0])

    stop = threading.Event()
    thread, outcome = _verify_in_thread(pending, threads=2, stop=stop)
    hasher = _wait_for(lambda: _hashers(fifo), "the hashing process")[0]
    stop.set()
    thread.join(60)
    assert isinstance(outcome[0], ChecksumsCancelled)
    _wait_for(lambda: not hasher.is_running() or hasher.status() == psutil.STATUS_ZOMBIE, "the process killed")


def test_a_tarball_is_hashed_as_it_is_unpacked(package: Path, tmp_path: Path):
    write_tarball(package, tmp_path / "p.tar.gz")
    assert not open_package(tmp_path / "p.tar.gz", tmp_path / "work", defer_data=True).pending.files


def test_the_startup_refuses_an_incomplete_data_file_before_the_engine_starts(package: Path, tmp_path: Path):
    shard = package / "weights" / "model-00001-of-00002.safetensors"
    shard.write_bytes(shard.read_bytes()[:-1])
    port = free_port()
    result = subprocess.run(
        pc.startup_argv(sys.executable, package, workdir=tmp_path / "run", host="127.0.0.1", openai_port=port,
                        metrics_port=free_port(), triton_metrics_port=free_port(), kserve_http_port=free_port(),
                        kserve_grpc_port=free_port()),
        capture_output=True, text=True, timeout=240, env=dict(os.environ, HF_HUB_OFFLINE="1"))
    assert result.returncode == 11 and not accepts(port)
    assert "startup failed at step 1 'unpack-and-verify'" in result.stderr
    assert "weights/model-00001-of-00002.safetensors: not a complete safetensors file" in result.stderr
    assert "install-plugins: starting" not in result.stderr
    assert (package / MANIFEST_NAME).is_file()
