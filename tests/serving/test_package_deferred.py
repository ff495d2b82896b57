"""The startup's deferred data checksums (docs/architecture.md §3.4 threat model, §3.7 step 1).

`open_package(..., defer_data=True)` leaves the SHA-256 of safetensors files to its caller (the startup hashes them
while the engine reads the same bytes, and holds readiness until they match) and checks everything else at once:
every other file's checksum and the listing; `pending.check_complete()` checks each deferred file's header accounts
for every byte (the startup runs it in step 1, after the Deployment's identity checks).
Each test builds a real package with real safetensors files and only the defect under test.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from llm_serving import pod_contract as pc
from llm_serving.manifest import MANIFEST_NAME
from llm_serving.package import (
    ChecksumsCancelled,
    PackageError,
    PackageSpec,
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


@pytest.mark.parametrize("idle", [True, False])
def test_the_hashing_threads_run_under_sched_idle_when_asked(package: Path, monkeypatch, idle: bool):
    import llm_serving.package as package_module

    seen: dict[str, int] = {}
    real = package_module.sha256_file

    def recording(path, halt):  # the policy of the thread that hashes
        seen[Path(path).name] = os.sched_getscheduler(0)
        return real(path, halt)

    opened = open_package(package, defer_data=True)
    monkeypatch.setattr(package_module, "sha256_file", recording)
    opened.pending.verify(threads=2, idle_priority=idle)
    expected = os.SCHED_IDLE if idle else os.sched_getscheduler(0)
    assert seen == {"model-00001-of-00002.safetensors": expected, "model-00002-of-00002.safetensors": expected}
    assert os.sched_getscheduler(0) != os.SCHED_IDLE  # the caller's own thread keeps its policy


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
