"""The image's version pins (`serving_image/compat.toml`, docs/architecture.md §3.9) as the image build, the
repository generator and the startup procedure use them, and the startup version check.

The file is read by llm_serving/compat.py, its one reader (the policy pack, the program and the stub's pins read it
there too); this module only arranges what that reader returns.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from llm_serving.compat import CompatError, LocalTriton, TritonRelease, load_compat


class PinError(RuntimeError):
    """compat.toml is unusable, or the running vLLM is not the pinned one."""


@dataclass(frozen=True)
class Pins:
    pinned: TritonRelease
    image: str
    vllm_build: str
    local_distribution: str
    local_vllm_version: str
    local_differences: tuple[str, ...]
    history: tuple[TritonRelease, ...]
    source: Path
    local_triton: LocalTriton

    def release(self, name: str | None = None) -> TritonRelease:
        """The pinned release, or an earlier one this project knows (for generating older repositories)."""
        if name is None or name == self.pinned.release:
            return self.pinned
        for entry in self.history:
            if entry.release == name:
                return entry
        known = ", ".join([self.pinned.release, *(h.release for h in self.history)])
        raise PinError(f"{self.source}: Triton release {name!r} is not described (known: {known})")


def load_pins(path: Path | None = None) -> Pins:
    try:
        compat = load_compat(path)
    except CompatError as exc:
        raise PinError(str(exc)) from exc
    return Pins(
        pinned=compat.pinned,
        image=compat.triton.image,
        vllm_build=compat.triton.vllm_build,
        local_distribution=compat.local.distribution,
        local_vllm_version=compat.local.vllm_version,
        local_differences=compat.local.differences,
        history=compat.history,
        source=compat.source,
        local_triton=compat.local.triton,
    )


def public_version(version: str) -> str:
    """'0.27.1+b1082979.nv26.8' -> '0.27.1' (NVIDIA's builds carry a local version label)."""
    return version.split("+", 1)[0]


def check_vllm(installed: str, runtime: str, pins: Pins) -> str:
    """Refuse a vLLM that is not the pinned one. `runtime` is 'triton' in the image, 'local' elsewhere.

    Returns a one-line description for the startup log; raises PinError naming both versions otherwise.
    """
    if runtime == "triton":
        expected, what = pins.pinned.vllm_version, f"Triton {pins.pinned.release}"
    elif runtime == "local":
        expected, what = pins.local_vllm_version, f"the local engine ({pins.local_distribution})"
    else:
        raise PinError(f"unknown runtime {runtime!r} (expected 'triton' or 'local')")
    if public_version(installed) != public_version(expected):
        raise PinError(f"vLLM {installed} is installed but {pins.source.name} pins vLLM {expected} for {what}; "
                       "a package cannot change the image's vLLM")
    return f"vLLM {installed} matches the pin for {what}"
