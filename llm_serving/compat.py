"""The one reader of `serving_image/compat.toml`, the serving image's version pins (docs/architecture.md §3.9).

Every reader of the file goes through `load_compat`: the startup procedure, the image build's probe and the
repository generator (serving_image/triton/pins.py), the stub's pins (llm_serving/python_deps.py), the program's
image base (infra/config.py `triton_pin`) and the image-pin policy (policies/compat.py). The sections and keys below
are the file's contract: each is typed and required, and a key that is missing, of another type or not described
here is refused with a `CompatError` naming the file and the key (`triton.stub.python is missing`), so a typo never
falls back to a default. A section added to the file is added here, with its type.

The file is parsed once per content (a changed file is read again). Standard library only: both virtual
environments, the image's build stage (before this project's wheel is installed) and its probe import it.
"""

from __future__ import annotations

import re
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from types import MappingProxyType
from typing import Any

from llm_serving.repository import REPO_ROOT

# compat.toml is the serving image's file; this module reads it as a file, never by importing the image's code.
COMPAT_PATH = REPO_ROOT / "serving_image" / "compat.toml"
SCHEMA = 1  # the `schema` this reader reads
_RELEASE = re.compile(r"^\d{2}\.\d{2}$")  # Triton's release naming: YY.MM


class CompatError(ValueError):
    """compat.toml cannot be read, is not TOML, or a key is missing, ill-typed or unknown (the message names it)."""


@dataclass(frozen=True)
class TritonRelease:
    """What the repository generator and the startup check need of one Triton release: [triton] (the pinned one)
    or a [[history]] entry."""

    release: str
    vllm_version: str
    vllm_backend_branch: str
    structured_outputs_key: str  # the sampling_parameters key the release's vllm_backend reads
    structured_outputs_engine_arg: str  # the engine argument naming the structured-output backend
    backend_imports: tuple[str, ...]  # the vLLM modules the release's backend imports


@dataclass(frozen=True)
class TritonStub:
    """[triton.stub]: the image's Python backend stub."""

    python: str
    backend_directory: str  # the last entry of the stub's sys.path
    base: Mapping[str, str]  # distribution -> version, the base image's own (never installed or replaced)
    install: Mapping[str, str]  # distribution -> version, installed by the Dockerfile into backend_directory


@dataclass(frozen=True)
class Triton:
    """[triton]: the pinned release of the serving image (with [triton.backend_imports] and [triton.stub])."""

    release: str
    image: str
    python: str
    vllm_version: str  # the public version
    vllm_build: str  # the distribution version as NVIDIA builds it
    vllm_backend_branch: str
    structured_outputs_key: str
    structured_outputs_engine_arg: str
    backend_imports: tuple[str, ...]  # [triton.backend_imports] modules
    stub: TritonStub

    @property
    def image_tag(self) -> str:
        return self.image.rsplit(":", 1)[1]

    def as_release(self) -> TritonRelease:
        return TritonRelease(self.release, self.vllm_version, self.vllm_backend_branch, self.structured_outputs_key,
                             self.structured_outputs_engine_arg, self.backend_imports)


@dataclass(frozen=True)
class LocalTriton:
    """[local.triton]: the tritonserver that runs here (serving_image/triton/local_install.py)."""

    distribution: str
    distribution_version: str
    server_version: str
    release: str
    python_backend_stub: str
    stub_numpy: str
    stub_xgboost: str  # the demo ranker's (examples/ranker), installed beside the stub's numpy
    stub_scipy: str
    relied_on: tuple[str, ...]  # "<name>: <behaviour>", each checked by a test (test_kserve_startup.py)
    differences: tuple[str, ...]

    def relied_on_names(self) -> tuple[str, ...]:
        return tuple(entry.split(":", 1)[0] for entry in self.relied_on)

    def stub_distributions(self) -> dict[str, str]:
        """The local stub's distributions (the `stub_<distribution>` keys) and their versions."""
        return {"numpy": self.stub_numpy, "xgboost": self.stub_xgboost, "scipy": self.stub_scipy}


@dataclass(frozen=True)
class Local:
    """[local]: the vLLM used locally and in CI, and [local.triton]."""

    distribution: str
    vllm_version: str
    differences: tuple[str, ...]  # API differences between the local vLLM and the pinned one
    triton: LocalTriton


@dataclass(frozen=True)
class StandIn:
    """[stand_in]: the bases `make image` builds from Debian's and PyPI's packages in place of NGC's, the
    Dockerfile's build arguments they need (every other argument keeps its production default), and every way they
    differ from NGC's images."""

    debian_suite: str
    python: str
    build_args: Mapping[str, str]
    differences: tuple[str, ...]


@dataclass(frozen=True)
class Compat:
    """The whole file."""

    schema: int
    triton: Triton
    local: Local
    stand_in: StandIn
    history: tuple[TritonRelease, ...]  # [[history]]: earlier releases this project's code knows
    source: Path

    @property
    def pinned(self) -> TritonRelease:
        return self.triton.as_release()

    def releases(self) -> tuple[TritonRelease, ...]:
        return (self.pinned, *self.history)


class _Table:
    """One table of the file, read key by key; `done()` refuses the keys nobody read."""

    def __init__(self, data: Any, where: str, source: Path) -> None:
        if not isinstance(data, Mapping):
            raise CompatError(f"{source}: [{where}] must be a table (got {data!r})")
        self.data, self.where, self.source, self.read = data, where, source, set()

    def _key(self, key: str) -> str:
        return f"{self.where}.{key}" if self.where else key

    def _fail(self, key: str, what: str, value: Any) -> CompatError:
        return CompatError(f"{self.source}: {self._key(key)} must be {what} (got {value!r})")

    def get(self, key: str, table: bool = False) -> Any:
        if key not in self.data:
            name = f"[{self._key(key)}]" if table else self._key(key)
            raise CompatError(f"{self.source}: {name} is missing")
        self.read.add(key)
        return self.data[key]

    def integer(self, key: str) -> int:
        value = self.get(key)
        if not isinstance(value, int) or isinstance(value, bool):
            raise self._fail(key, "an integer", value)
        return value

    def string(self, key: str, pattern: re.Pattern[str] | None = None) -> str:
        value = self.get(key)
        if not isinstance(value, str) or not value:
            raise self._fail(key, "a non-empty string", value)
        if pattern is not None and not pattern.match(value):
            raise self._fail(key, f"a Triton release like '26.08' ({pattern.pattern})", value)
        return value

    def strings(self, key: str) -> tuple[str, ...]:
        value = self.get(key)
        if not isinstance(value, list) or not all(isinstance(v, str) and v for v in value):
            raise self._fail(key, "a list of non-empty strings", value)
        return tuple(value)

    def versions(self, key: str) -> Mapping[str, str]:
        value = self.get(key)
        if not isinstance(value, Mapping) or not all(isinstance(v, str) and v for v in value.values()):
            raise CompatError(f"{self.source}: {self._key(key)} must be a table of distribution = \"version\" "
                              f"(got {value!r})")
        return MappingProxyType(dict(value))

    def table(self, key: str) -> _Table:
        return _Table(self.get(key, table=True), self._key(key), self.source)

    def tables(self, key: str) -> list[_Table]:
        value = self.get(key, table=True)
        if not isinstance(value, list):
            raise self._fail(key, "an array of tables ([[...]])", value)
        return [_Table(entry, f"{self._key(key)}[{i}]", self.source) for i, entry in enumerate(value)]

    def done(self) -> None:
        unknown = sorted(set(self.data) - self.read)
        if unknown:
            raise CompatError(f"{self.source}: {self._key(unknown[0])}: unknown key (llm_serving/compat.py reads "
                              f"{', '.join(sorted(self.read))} here)")


def _normal(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()  # PEP 503


def _release(table: _Table, imports: tuple[str, ...] | None = None) -> TritonRelease:
    return TritonRelease(
        release=table.string("release", _RELEASE),
        vllm_version=table.string("vllm_version"),
        vllm_backend_branch=table.string("vllm_backend_branch"),
        structured_outputs_key=table.string("structured_outputs_key"),
        structured_outputs_engine_arg=table.string("structured_outputs_engine_arg"),
        backend_imports=imports if imports is not None else table.strings("backend_imports"),
    )


def _stub(table: _Table) -> TritonStub:
    stub = TritonStub(python=table.string("python"), backend_directory=table.string("backend_directory"),
                      base=table.versions("base"), install=table.versions("install"))
    table.done()
    both = sorted({_normal(n) for n in stub.base} & {_normal(n) for n in stub.install})
    if both:
        raise CompatError(f"{table.source}: triton.stub: {both[0]} is in both base and install; the image's own "
                          "version is never replaced")
    return stub


def _triton(table: _Table) -> Triton:
    imports = table.table("backend_imports")
    modules = imports.strings("modules")
    imports.done()
    pinned = _release(table, modules)
    triton = Triton(release=pinned.release, image=table.string("image"), python=table.string("python"),
                    vllm_version=pinned.vllm_version, vllm_build=table.string("vllm_build"),
                    vllm_backend_branch=pinned.vllm_backend_branch,
                    structured_outputs_key=pinned.structured_outputs_key,
                    structured_outputs_engine_arg=pinned.structured_outputs_engine_arg,
                    backend_imports=modules, stub=_stub(table.table("stub")))
    table.done()
    if ":" not in triton.image or not triton.image_tag.startswith(triton.release):
        raise CompatError(f"{table.source}: triton.image {triton.image!r} is not release {triton.release!r}")
    return triton


def _local(table: _Table) -> Local:
    t = table.table("triton")
    local_triton = LocalTriton(
        distribution=t.string("distribution"), distribution_version=t.string("distribution_version"),
        server_version=t.string("server_version"), release=t.string("release", _RELEASE),
        python_backend_stub=t.string("python_backend_stub"), stub_numpy=t.string("stub_numpy"),
        stub_xgboost=t.string("stub_xgboost"), stub_scipy=t.string("stub_scipy"),
        relied_on=t.strings("relied_on"), differences=t.strings("differences"))
    t.done()
    local = Local(distribution=table.string("distribution"), vllm_version=table.string("vllm_version"),
                  differences=table.strings("differences"), triton=local_triton)
    table.done()
    return local


def _stand_in(table: _Table) -> StandIn:
    stand_in = StandIn(debian_suite=table.string("debian_suite"), python=table.string("python"),
                       build_args=table.versions("build_args"), differences=table.strings("differences"))
    table.done()
    return stand_in


@lru_cache(maxsize=16)
def _parse(source: Path, text: str) -> Compat:
    try:
        doc = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise CompatError(f"{source}: not valid TOML: {exc}") from exc
    root = _Table(doc, "", source)
    schema = root.integer("schema")
    if schema != SCHEMA:
        raise CompatError(f"{source}: schema {schema} is not read here (llm_serving/compat.py reads schema {SCHEMA})")
    triton, local = _triton(root.table("triton")), _local(root.table("local"))
    history = []
    for entry in root.tables("history"):
        history.append(_release(entry))
        entry.done()
    stand_in = _stand_in(root.table("stand_in"))
    compat = Compat(schema=schema, triton=triton, local=local, stand_in=stand_in, history=tuple(history),
                    source=source)
    root.done()
    return compat


def load_compat(path: Path | str | None = None) -> Compat:
    """The file at `path` (default: the serving image's), typed and checked. Raises CompatError naming the file
    and the key."""
    source = Path(path) if path else COMPAT_PATH
    try:
        text = source.read_text()
    except OSError as exc:
        raise CompatError(f"{source}: cannot read the version pins: {exc}") from exc
    return _parse(source, text)
