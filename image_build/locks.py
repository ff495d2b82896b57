"""The image's lock files (image/locks/*.txt): every Python distribution the image builds install, pinned with its
hashes, written by `make image-lock` from the `.in` files beside them with uv (`uv pip compile --generate-hashes`).

    stand-in-vllm.txt    the stand-in base's vLLM (CPU build) and torch, with everything they need
    serving.txt          what the serving image installs above its base: this project's dependencies (pyproject's
                         base and `serving` extra) minus what the base already holds
    stub.txt             the Python backend stub's packages (compat.toml [triton.stub] install)
    build.txt, sbom.txt  the build backend; the SBOM generator
    stand-in-triton.txt, stand-in-stub.txt, stand-in-cuda.txt   the stand-in bases' Triton, its stub's numpy, CUDA

`serving.txt` is resolved together with the stand-in's vLLM, so the two never disagree; on NGC's base the build's
`pip check` is what proves the same lock against NVIDIA's vLLM (docs/first-update.md).
"""

from __future__ import annotations

import re
import subprocess
import sys
import tomllib
from pathlib import Path

from llm_serving.repository import REPO_ROOT

LOCKS = REPO_ROOT / "image" / "locks"
PYTHON_VERSION = "3.11"
PLATFORM = "x86_64-manylinux_2_36"  # Debian 12's glibc 2.36 (the stand-in base); NGC's Ubuntu 24.04 has 2.39
# The local wheel folder the Makefile's serving environment installs torch's CPU wheel from (the machine's pip
# configuration names it); uv does not read pip's configuration, so it is passed explicitly.
FIND_LINKS = Path("/opt/wheels")
# vLLM's CPU build pulls PyPI's CUDA torchvision/torchaudio/torchcodec, which break `import transformers` beside the
# CPU torch (the Makefile removes them after every install): never part of an image.
NEVER = ("torchvision", "torchaudio", "torchcodec")
HEADER = "# Written by `make image-lock` (image_build/locks.py) from {source}: do not edit by hand.\n"


class LockError(RuntimeError):
    pass


def _uv() -> str:
    uv = Path(sys.executable).parent / "uv"
    if not uv.exists():
        raise LockError(f"uv is not installed in {Path(sys.executable).parent}: `make image-lock` installs it")
    return str(uv)


def compile_lock(sources: list[Path], output: Path, *, no_deps: bool = False, python_version: str = PYTHON_VERSION,
                 universal_hashes: bool = False, exclude: tuple[str, ...] = (),
                 constraints: Path | None = None) -> None:
    argv = [_uv(), "pip", "compile", *map(str, sources), "--generate-hashes", "--output-file", str(output),
            "--no-header", "--quiet", "--python-version", python_version, "--index-strategy", "unsafe-best-match"]
    if not universal_hashes:
        argv += ["--python-platform", PLATFORM]
    if FIND_LINKS.is_dir():
        argv += ["--find-links", str(FIND_LINKS)]
    if no_deps:
        argv.append("--no-deps")
    if constraints is not None:
        argv += ["--constraint", str(constraints)]
    for name in (*NEVER, *exclude):
        argv += ["--no-emit-package", name]
    done = subprocess.run(argv, capture_output=True, text=True)
    if done.returncode != 0:
        raise LockError(f"uv pip compile {' '.join(s.name for s in sources)} failed:\n{done.stderr.strip()}")
    output.write_text(HEADER.format(source=", ".join(f"image/locks/{s.name}" for s in sources)) + output.read_text())


def pinned_names(lock: Path) -> set[str]:
    """The distributions a lock file pins (normalised names)."""
    names = set()
    for line in lock.read_text().splitlines():
        m = re.match(r"^([A-Za-z0-9][A-Za-z0-9._-]*)==", line)
        if m:
            names.add(re.sub(r"[-_.]+", "-", m.group(1)).lower())
    return names


def serving_requirements() -> list[str]:
    """pyproject's base dependencies and `serving` extra: what this project's wheel needs in the image."""
    project = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["project"]
    return [*project["dependencies"], *project["optional-dependencies"]["serving"]]


def tested_versions(path: Path) -> Path:
    """The versions of the environment the test suite runs in (`make image-lock` runs in .venv-serving), as
    constraints: the image gets what `make test` tested, wherever both install the same distribution."""
    done = subprocess.run([sys.executable, "-m", "pip", "freeze", "--exclude-editable"], capture_output=True,
                          text=True, check=True)
    pins = [line for line in done.stdout.splitlines()
            if "==" in line and line.split("==")[0].lower().replace("_", "-") not in (*NEVER, "llm-serving")]
    path.write_text("\n".join(pins) + "\n")
    return path


def write_all() -> None:
    vllm_in = LOCKS / "stand-in-vllm.in"
    serving_in = LOCKS / "serving.in"
    serving_in.write_text("# Written by `make image-lock`: pyproject.toml's dependencies and its `serving` extra.\n"
                          + "\n".join(serving_requirements()) + "\n")
    # One resolution of everything the stand-in image holds (vLLM and the serving code together, as the serving
    # environment installs them), then each lock as its part: the base's vLLM environment, and what the serving
    # image adds above it. Resolved apart, the two would disagree on what both need (protobuf, once).
    combined = LOCKS / ".stand-in-image.txt"
    compile_lock([serving_in, vllm_in], combined, constraints=tested_versions(LOCKS / ".tested.txt"))
    (LOCKS / ".tested.txt").unlink()
    compile_lock([vllm_in], LOCKS / "stand-in-vllm.txt", constraints=combined)
    base = pinned_names(LOCKS / "stand-in-vllm.txt")
    compile_lock([serving_in], LOCKS / "serving.txt", exclude=tuple(sorted(base)), constraints=combined)
    combined.unlink()
    for name in ("stand-in-triton", "stand-in-stub", "stand-in-cuda"):
        compile_lock([LOCKS / f"{name}.in"], LOCKS / f"{name}.txt", no_deps=True)
    # Installed on NGC's Python 3.12 and the stand-in's 3.11: every wheel's hash of the pinned versions.
    compile_lock([LOCKS / "stub.in"], LOCKS / "stub.txt", no_deps=True, universal_hashes=True)
    compile_lock([LOCKS / "build.in"], LOCKS / "build.txt", universal_hashes=True)
    compile_lock([LOCKS / "sbom.in"], LOCKS / "sbom.txt", universal_hashes=True)


def main() -> None:
    try:
        write_all()
    except LockError as exc:
        print(f"image-lock: {exc}", file=sys.stderr)
        raise SystemExit(1) from exc
    print(f"image-lock: wrote {', '.join(sorted(p.name for p in LOCKS.glob('*.txt')))}")


if __name__ == "__main__":
    main()
