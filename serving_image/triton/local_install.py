"""Where the local Triton Inference Server is: the one module that knows (docs/local-environment.md, "Triton locally").

`make up` / `make test` install PyPI's `nvidia-pytriton` wheel (compat.toml [local.triton]) into `.venv-triton`,
without its dependencies, so `.venv-serving`'s pins are never touched. The wheel bundles:

    <site-packages>/pytriton/tritonserver/bin/tritonserver            the server (2.51.0, release 24.10)
    <site-packages>/pytriton/tritonserver/backends/python/            the Python backend; the Makefile copies the
                                                                      3.11 stub here and installs the stub's numpy
                                                                      (< 2) here, the one directory on the stub's
                                                                      sys.path that this project owns
    <site-packages>/nvidia_pytriton.libs/libtritonserver-*.so         the server library (Triton's C API)

`backend_directory()` composes what `tritonserver --backend-directory` gets locally: NVIDIA's `python` backend and this
project's python-based stand-in for NVIDIA's `vllm` backend (serving_image/triton_stub/backends/vllm). In production
only `--backend-directory` differs (the image's own backends, NVIDIA's vllm_backend among them).

The location is `$LLM_SERVING_TRITON_HOME`, else `.venv-triton` at the repository root.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path

from llm_serving.repository import REPO_ROOT
from serving_image.triton.pins import load_pins
from serving_image.triton_stub import STAND_IN_BACKENDS  # python-based backends written by this project

HOME_ENV = "LLM_SERVING_TRITON_HOME"

DEFAULT_HOME = REPO_ROOT / ".venv-triton"
HOW_TO_INSTALL = ("run `make triton-env` (part of `make up` and `make test`), which installs PyPI's nvidia-pytriton "
                  "wheel into .venv-triton; or set LLM_SERVING_TRITON_HOME to a directory where it is installed")


class TritonNotInstalledError(RuntimeError):
    """The local Triton is missing or incomplete; the message says how to get it."""


@dataclass(frozen=True)
class LocalTriton:
    home: Path  # the virtual environment holding the wheel
    server_root: Path  # .../pytriton/tritonserver
    binary: Path  # tritonserver
    python_backend: Path  # backends/python (libtriton_python.so, the stub, triton_python_backend_utils.py, numpy)
    library: Path  # libtritonserver-*.so (the C API)
    library_dir: Path  # nvidia_pytriton.libs: the library's renamed dependencies (LD_LIBRARY_PATH for in-process use)
    distribution_version: str  # nvidia-pytriton's version
    server_version: str  # the Triton server version this wheel bundles (compat.toml [local.triton])

    def stub_python(self) -> tuple[Path, dict[str, str]]:
        """An interpreter with the stub's packages (numpy < 2, the demo ranker's xgboost and scipy): this venv's
        python with the Python backend's directory on PYTHONPATH (e.g. examples/ranker/train.py runs so)."""
        python = self.home / "bin" / "python"
        if not python.exists():
            raise TritonNotInstalledError(f"{python} is missing: {HOW_TO_INSTALL}")
        return python, {"PYTHONPATH": str(self.python_backend), "PYTHONNOUSERSITE": "1"}

    def backend_directory(self, target: Path) -> Path:
        """A `--backend-directory` for this server: `python` (NVIDIA's Python backend) and every python-based backend
        this project ships (`vllm`, the stand-in), as links, so edits to the stand-in need no reinstall."""
        target.mkdir(parents=True, exist_ok=True)
        entries = {"python": self.python_backend}
        for backend in sorted(STAND_IN_BACKENDS.iterdir()):
            if (backend / "model.py").is_file():
                entries[backend.name] = backend
        for name, source in entries.items():
            link = target / name
            if link.is_symlink() or link.exists():
                if link.is_symlink() and Path(os.readlink(link)) == source:
                    continue
                link.unlink()
            link.symlink_to(source, target_is_directory=True)
        return target


def _site_packages(home: Path) -> Path:
    found = sorted(home.glob("lib/python3*/site-packages"))
    if not found:
        raise TritonNotInstalledError(f"no Triton installation at {home} (no site-packages): {HOW_TO_INSTALL}")
    return found[0]


def _dist_version(site: Path, distribution: str) -> str | None:
    prefix = re.sub(r"[-.]+", "_", distribution)
    for info in site.glob(f"{prefix}-*.dist-info"):
        for line in (info / "METADATA").read_text(errors="replace").splitlines():
            if line.startswith("Version:"):
                return line.split(":", 1)[1].strip()
    return None


def locate(home: Path | None = None) -> LocalTriton:
    """The local Triton, checked: every file is there and the wheel is compat.toml's. Raises TritonNotInstalledError
    naming what is missing and how to get it."""
    home = Path(home or os.environ.get(HOME_ENV) or DEFAULT_HOME)
    pin = load_pins().local_triton
    if not home.is_dir():
        raise TritonNotInstalledError(f"Triton is not installed ({home} does not exist): {HOW_TO_INSTALL}")
    site = _site_packages(home)
    version = _dist_version(site, pin.distribution)
    if version is None:
        raise TritonNotInstalledError(f"{pin.distribution} is not installed in {home}: {HOW_TO_INSTALL}")
    if version != pin.distribution_version:
        raise TritonNotInstalledError(f"{home} holds {pin.distribution} {version}, compat.toml pins "
                                      f"{pin.distribution_version}: rm {home}/.stamp and {HOW_TO_INSTALL}")
    root = site / "pytriton" / "tritonserver"
    binary = root / "bin" / "tritonserver"
    python_backend = root / "backends" / "python"
    libraries = sorted((site / "nvidia_pytriton.libs").glob("libtritonserver*.so"))
    required = {
        "the tritonserver binary": binary,
        "the Python backend": python_backend / "libtriton_python.so",
        f"the Python {pin.python_backend_stub} backend stub (the Makefile copies it from python_backend_stubs/)":
            python_backend / "triton_python_backend_stub",
        "the stub's numpy (< 2, installed into the Python backend's directory)": python_backend / "numpy",
        "the demo ranker's xgboost (installed into the Python backend's directory)": python_backend / "xgboost",
    }
    for what, path in required.items():
        if not path.exists():
            raise TritonNotInstalledError(f"{what} is missing ({path}): {HOW_TO_INSTALL}")
    if not libraries:
        raise TritonNotInstalledError(f"libtritonserver.so is missing from {site / 'nvidia_pytriton.libs'}: "
                                      f"{HOW_TO_INSTALL}")
    return LocalTriton(home=home, server_root=root, binary=binary, python_backend=python_backend,
                       library=libraries[0], library_dir=libraries[0].parent, distribution_version=version,
                       server_version=pin.server_version)
