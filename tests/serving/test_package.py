"""Model packages (docs/architecture.md §3.4): building, verifying, and refusing hostile packages.

Every hostile package is built for real (tarfile, zipfile) with only the one defect under test; a refusal must name
the offending entry and leave the target directory exactly as it was.
"""

from __future__ import annotations

import hashlib
import io
import json
import tarfile
from pathlib import Path, PurePosixPath

import pytest

from llm_serving.manifest import MANIFEST_NAME, Backend, ParallelLayout, ServingMode, parse_manifest
from llm_serving.package import PackageError, PackageSpec, build_package, open_package
from llm_serving.tensor_contract import VLLM_IO_FINGERPRINT
from tests.serving.wheels import make_wheel

CONFIG_PBTXT = """
name: "ranker"
backend: "python"
input [
  { name: "query" data_type: TYPE_STRING dims: [ 1 ] },
  { name: "candidates" data_type: TYPE_STRING dims: [ -1 ] }
]
output [
  { name: "scores" data_type: TYPE_FP32 dims: [ -1 ] }
]
instance_group [ { kind: KIND_CPU } ]
"""


@pytest.fixture()
def model_dir(tmp_path: Path) -> Path:
    """A minimal Hugging Face-shaped directory (the package code never loads it)."""
    root = tmp_path / "hf-model"
    root.mkdir()
    (root / "config.json").write_text(json.dumps({"model_type": "llama"}))
    (root / "model.safetensors").write_bytes(b"\x00" * 4096)
    (root / "tokenizer.json").write_text("{}")
    return root


def _wheel(name: str, *, files: dict[str, str] | None = None, requires: list[str] | None = None) -> bytes:
    return make_wheel(name, files=files or {f"{name}/__init__.py": "def register():\n    pass\n"}, requires=requires,
                      entry_points={"vllm.general_plugins": {name: f"{name}:register"}})


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _manifest(files: dict[str, bytes], **overrides) -> str:
    lines = [f"manifest_version = {overrides.pop('manifest_version', 1)}", ""]
    lines += ["[model]", 'id = "demo"', 'version = "1"', 'backend = "vllm"',
              f'io_fingerprint = "{overrides.pop("fingerprint", VLLM_IO_FINGERPRINT)}"', ""]
    lines += ["[engine]", 'model = "weights"', ""]
    lines += ["[files]"] + [f'"{name}" = "{_sha(data)}"' for name, data in files.items()]
    return "\n".join(lines) + "\n"


BASE_FILES = {"weights/config.json": b'{"model_type": "llama"}', "weights/model.safetensors": b"\x00" * 64}


def _tarball(path: Path, files: dict[str, bytes], *, manifest: str | None = None,
             extra: list[tuple[tarfile.TarInfo, bytes | None]] = ()) -> Path:
    with tarfile.open(path, "w:gz") as tar:
        entries = dict(files)
        if manifest is not None:
            entries = {MANIFEST_NAME: manifest.encode(), **entries}
        for name, data in entries.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
        for info, data in extra:
            tar.addfile(info, io.BytesIO(data) if data is not None else None)
    return path


def _refused(tarball: Path, workdir: Path, *needles: str) -> str:
    before = sorted(p.relative_to(workdir.parent) for p in workdir.parent.rglob("*"))
    with pytest.raises(PackageError) as info:
        open_package(tarball, workdir)
    message = str(info.value)
    for needle in needles:
        assert needle in message, message
    after = sorted(p.relative_to(workdir.parent) for p in workdir.parent.rglob("*"))
    # Nothing extracted anywhere: the work directory holds no file of the package.
    assert [p for p in after if p not in before and p.name != workdir.name] == []
    if workdir.exists():
        assert list(workdir.rglob("*")) == []
    return message


# -- building ------------------------------------------------------------------------------------------------------


def test_build_writes_manifest_with_checksum_of_every_file(model_dir: Path, tmp_path: Path):
    plugin = tmp_path / "myplugin-0.1-py3-none-any.whl"
    plugin.write_bytes(_wheel("myplugin"))
    out = build_package(PackageSpec(model_dir, "demo", "1.0.0", engine_args={"max_model_len": 256},
                                    plugins=(plugin,), serving_mode=ServingMode.STANDALONE), tmp_path / "pkg")
    manifest = parse_manifest((out / MANIFEST_NAME).read_text())
    assert manifest.model.id == "demo" and manifest.model.version == "1.0.0"
    assert manifest.model.backend is Backend.VLLM and manifest.serving_mode is ServingMode.STANDALONE
    assert manifest.model.io_fingerprint == VLLM_IO_FINGERPRINT
    assert manifest.engine.args == {"max_model_len": 256}
    assert [p.wheel for p in manifest.plugins] == ["plugins/myplugin-0.1-py3-none-any.whl"]
    on_disk = {p.relative_to(out).as_posix() for p in out.rglob("*") if p.is_file()} - {MANIFEST_NAME}
    assert set(manifest.files) == on_disk
    for rel, digest in manifest.files.items():
        assert _sha((out / rel).read_bytes()) == digest
    assert open_package(out).manifest == manifest


def test_tarball_builds_are_reproducible_and_open(model_dir: Path, tmp_path: Path):
    first = build_package(PackageSpec(model_dir, "demo", "1"), tmp_path / "a.tar.gz")
    second = build_package(PackageSpec(model_dir, "demo", "1"), tmp_path / "b.tar.gz")
    assert first.read_bytes() == second.read_bytes()
    verified = open_package(first, tmp_path / "work")
    assert verified.root == tmp_path / "work" / "demo-1"
    assert (verified.weights_path / "model.safetensors").read_bytes() == b"\x00" * 4096


def test_python_backend_fingerprint_follows_its_tensor_io(model_dir: Path, tmp_path: Path):
    model_py = tmp_path / "model.py"
    model_py.write_text("class TritonPythonModel:\n    pass\n")
    pbtxt = tmp_path / "config.pbtxt"
    pbtxt.write_text(CONFIG_PBTXT)
    spec = PackageSpec(model_dir, "ranker", "1", backend=Backend.PYTHON, python_model=model_py, config_pbtxt=pbtxt)
    first = parse_manifest((build_package(spec, tmp_path / "p1") / MANIFEST_NAME).read_text())
    pbtxt.write_text(CONFIG_PBTXT.replace("TYPE_FP32", "TYPE_FP16"))
    second = parse_manifest((build_package(spec, tmp_path / "p2") / MANIFEST_NAME).read_text())
    assert first.model.io_fingerprint != second.model.io_fingerprint != VLLM_IO_FINGERPRINT
    assert first.python.model_py == "python/model.py"


def test_build_refuses_a_plugin_that_pins_vllm(model_dir: Path, tmp_path: Path):
    plugin = tmp_path / "sneaky-0.1-py3-none-any.whl"
    plugin.write_bytes(_wheel("sneaky", requires=["vllm==0.6.0"]))
    with pytest.raises(PackageError, match=r"sneaky-0.1-py3-none-any.whl: pins vllm"):
        build_package(PackageSpec(model_dir, "demo", "1", plugins=(plugin,)), tmp_path / "pkg")
    assert not (tmp_path / "pkg").exists()


def test_the_parallel_layout_is_stated_in_engine_parallel_and_written_to_model_json(model_dir: Path,
                                                                                     tmp_path: Path):
    """[engine.parallel] is the one place a package states its GPUs: the generated model.json hands it to vLLM, and
    the same setting as a raw engine argument is refused, naming the table to use."""
    from serving_image.triton.pins import load_pins
    from serving_image.triton.repository import vllm_engine_json

    out = build_package(PackageSpec(model_dir, "demo", "1", parallel=ParallelLayout(tensor=4, pipeline=2)),
                        tmp_path / "pkg")
    manifest = parse_manifest((out / MANIFEST_NAME).read_text())
    assert manifest.engine.parallel.gpus == 8
    engine_json = vllm_engine_json(manifest, PurePosixPath("/models/demo/1"), load_pins().release())
    assert (engine_json["tensor_parallel_size"], engine_json["pipeline_parallel_size"],
            engine_json["data_parallel_size"]) == (4, 2, 1)
    with pytest.raises(PackageError, match=r"engine.args.tensor_parallel_size is not allowed: the parallel layout "
                                           r"is \[engine.parallel\] tensor = 8"):
        build_package(PackageSpec(model_dir, "demo", "2", engine_args={"tensor_parallel_size": 8}), tmp_path / "p2")


def test_build_refuses_bad_identity_naming_the_key(model_dir: Path, tmp_path: Path):
    with pytest.raises(PackageError, match=r"model.id 'Demo_Model'"):
        build_package(PackageSpec(model_dir, "Demo_Model", "1"), tmp_path / "pkg")


# -- hostile packages ----------------------------------------------------------------------------------------------


def test_valid_handmade_tarball_opens(tmp_path: Path):
    tarball = _tarball(tmp_path / "ok.tar.gz", BASE_FILES, manifest=_manifest(BASE_FILES))
    assert open_package(tarball, tmp_path / "work").manifest.model.id == "demo"


def test_refuses_checksum_mismatch(tmp_path: Path):
    tampered = dict(BASE_FILES, **{"weights/model.safetensors": b"\x01" * 64})
    tarball = _tarball(tmp_path / "p.tar.gz", tampered, manifest=_manifest(BASE_FILES))
    _refused(tarball, tmp_path / "work", "weights/model.safetensors", "checksum mismatch")


def test_refuses_checksum_mismatch_in_a_directory_package(model_dir: Path, tmp_path: Path):
    out = build_package(PackageSpec(model_dir, "demo", "1"), tmp_path / "pkg")
    (out / "weights" / "model.safetensors").write_bytes(b"corrupted")
    with pytest.raises(PackageError, match=r"weights/model.safetensors: checksum mismatch"):
        open_package(out)


def test_refuses_absolute_path(tmp_path: Path):
    files = dict(BASE_FILES, **{"/etc/cron.d/evil": b"* * * * * root sh\n"})
    tarball = _tarball(tmp_path / "p.tar.gz", files, manifest=_manifest(BASE_FILES))
    _refused(tarball, tmp_path / "work", "/etc/cron.d/evil", "absolute path")
    assert not Path("/etc/cron.d/evil").exists()


def test_refuses_dotdot(tmp_path: Path):
    files = dict(BASE_FILES, **{"weights/../../escaped.txt": b"gotcha"})
    tarball = _tarball(tmp_path / "p.tar.gz", files, manifest=_manifest(BASE_FILES))
    _refused(tarball, tmp_path / "work", "weights/../../escaped.txt", "'..'")
    assert not (tmp_path / "escaped.txt").exists()


@pytest.mark.parametrize("target", ["/etc/passwd", "../../outside", "../.."])
def test_refuses_symlink_that_escapes(tmp_path: Path, target: str):
    link = tarfile.TarInfo("weights/tokenizer.json")
    link.type, link.linkname = tarfile.SYMTYPE, target
    tarball = _tarball(tmp_path / "p.tar.gz", BASE_FILES, manifest=_manifest(BASE_FILES), extra=[(link, None)])
    _refused(tarball, tmp_path / "work", "weights/tokenizer.json", "leaves the package")


def test_refuses_hardlink_that_escapes(tmp_path: Path):
    link = tarfile.TarInfo("weights/hard")
    link.type, link.linkname = tarfile.LNKTYPE, "/etc/shadow"
    tarball = _tarball(tmp_path / "p.tar.gz", BASE_FILES, manifest=_manifest(BASE_FILES), extra=[(link, None)])
    _refused(tarball, tmp_path / "work", "weights/hard", "leaves the package")


def test_accepts_symlink_that_stays_inside(tmp_path: Path):
    link = tarfile.TarInfo("weights/alias.safetensors")
    link.type, link.linkname = tarfile.SYMTYPE, "model.safetensors"
    tarball = _tarball(tmp_path / "p.tar.gz", BASE_FILES, manifest=_manifest(BASE_FILES), extra=[(link, None)])
    root = open_package(tarball, tmp_path / "work").root
    assert (root / "weights" / "alias.safetensors").read_bytes() == BASE_FILES["weights/model.safetensors"]


def test_refuses_symlink_that_escapes_a_directory_package(model_dir: Path, tmp_path: Path):
    out = build_package(PackageSpec(model_dir, "demo", "1"), tmp_path / "pkg")
    (out / "weights" / "escape").symlink_to("/etc/passwd")
    with pytest.raises(PackageError, match=r"weights/escape: link to '/etc/passwd' leaves the package"):
        open_package(out)


@pytest.mark.parametrize("kind", [tarfile.CHRTYPE, tarfile.BLKTYPE, tarfile.FIFOTYPE])
def test_refuses_device_files(tmp_path: Path, kind: bytes):
    device = tarfile.TarInfo("weights/dev")
    device.type, device.devmajor, device.devminor = kind, 1, 3
    tarball = _tarball(tmp_path / "p.tar.gz", BASE_FILES, manifest=_manifest(BASE_FILES), extra=[(device, None)])
    _refused(tarball, tmp_path / "work", "weights/dev", "device or fifo")


def test_refuses_missing_manifest(tmp_path: Path):
    tarball = _tarball(tmp_path / "p.tar.gz", BASE_FILES)
    _refused(tarball, tmp_path / "work", "package.toml", "missing manifest")


def test_refuses_unknown_manifest_version(tmp_path: Path):
    tarball = _tarball(tmp_path / "p.tar.gz", BASE_FILES, manifest=_manifest(BASE_FILES, manifest_version=7))
    _refused(tarball, tmp_path / "work", "manifest_version", "unknown manifest version 7")


def test_refuses_unknown_manifest_key(tmp_path: Path):
    manifest = _manifest(BASE_FILES).replace('[engine]\n', '[engine]\nquantisation = "int4"\n')
    tarball = _tarball(tmp_path / "p.tar.gz", BASE_FILES, manifest=manifest)
    _refused(tarball, tmp_path / "work", "engine.quantisation: unknown key")


def test_refuses_unlisted_and_missing_files(tmp_path: Path):
    unlisted = dict(BASE_FILES, **{"weights/extra.bin": b"?"})
    _refused(_tarball(tmp_path / "u.tar.gz", unlisted, manifest=_manifest(BASE_FILES)), tmp_path / "work",
             "weights/extra.bin", "not listed")
    missing = {"weights/config.json": BASE_FILES["weights/config.json"]}
    _refused(_tarball(tmp_path / "m.tar.gz", missing, manifest=_manifest(BASE_FILES)), tmp_path / "work",
             "weights/model.safetensors", "missing from the package")


def test_refuses_wrong_io_fingerprint(tmp_path: Path):
    manifest = _manifest(BASE_FILES, fingerprint="sha256:" + "0" * 64)
    _refused(_tarball(tmp_path / "p.tar.gz", BASE_FILES, manifest=manifest), tmp_path / "work", "io_fingerprint")


@pytest.mark.parametrize(
    ("name", "data", "needle"),
    [
        ("plugins/vllm-0.6.0-py3-none-any.whl", _wheel("vllm"), "bundles vllm"),
        ("plugins/torch-2.0.0-py3-none-any.whl", _wheel("torch"), "bundles torch"),
        ("plugins/helper-0.1-py3-none-any.whl", _wheel("helper", requires=["torch>=2.0"]), "pins torch"),
        ("plugins/helper-0.1-py3-none-any.whl", _wheel("helper", requires=["tritonserver==2.50"]),
         "pins tritonserver"),
        ("plugins/helper-0.1-py3-none-any.whl",
         _wheel("helper", files={"helper/__init__.py": "", "vllm/__init__.py": "# forked vllm"}), "bundles the 'vllm'"),
        ("requirements.txt", b"numpy\nvllm==0.5.4  # the one we like\n", "pins vllm"),
        ("weights/vllm/model_executor/custom.py", b"print('patched')\n", "bundles vllm"),
        ("torch.py", b"raise SystemExit\n", "bundles torch.py"),
    ],
    ids=["vllm-wheel", "torch-wheel", "wheel-pins-torch", "wheel-pins-tritonserver", "wheel-bundles-vllm",
         "requirements-pin-vllm", "weights-bundle-vllm", "top-level-torch-py"],
)
def test_refuses_bundled_or_pinned_engine(tmp_path: Path, name: str, data: bytes, needle: str):
    files = dict(BASE_FILES, **{name: data})
    tarball = _tarball(tmp_path / "p.tar.gz", files, manifest=_manifest(files))
    message = _refused(tarball, tmp_path / "work", needle)
    assert name in message


def test_an_unpinned_requirement_on_vllm_is_allowed(tmp_path: Path):
    wheel = _wheel("helper", requires=["vllm", "numpy>=1.0"])
    files = dict(BASE_FILES, **{"plugins/helper-0.1-py3-none-any.whl": wheel})
    opened = open_package(_tarball(tmp_path / "p.tar.gz", files, manifest=_manifest(files)), tmp_path / "work")
    # accepted and unpacked: a plugin may depend on vLLM, only not pin or bundle it
    assert (opened.root / "plugins" / "helper-0.1-py3-none-any.whl").read_bytes() == wheel
