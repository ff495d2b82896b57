"""The image's version pins (`serving_image/compat.toml`, docs/architecture.md §3.9), typed, and the startup
version check.

The policy pack reads the same file through `policies.compat` (three keys only); this module reads all of it for the
image build, the repository generator and the startup procedure.
"""

from __future__ import annotations

import tomllib
from dataclasses import dataclass
from pathlib import Path

COMPAT_PATH = Path(__file__).resolve().parents[1] / "compat.toml"


class PinError(RuntimeError):
    """compat.toml is unusable, or the running vLLM is not the pinned one."""


@dataclass(frozen=True)
class TritonRelease:
    release: str
    vllm_version: str
    vllm_backend_branch: str
    structured_outputs_key: str  # the sampling_parameters key the release's vllm_backend reads
    structured_outputs_engine_arg: str  # the engine argument naming the structured-output backend
    backend_imports: tuple[str, ...]


@dataclass(frozen=True)
class LocalTriton:
    """compat.toml [local.triton]: the tritonserver that runs here (serving_image/triton/local_install.py)."""

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
    local_triton: LocalTriton | None = None

    def release(self, name: str | None = None) -> TritonRelease:
        """The pinned release, or an earlier one this project knows (for generating older repositories)."""
        if name is None or name == self.pinned.release:
            return self.pinned
        for entry in self.history:
            if entry.release == name:
                return entry
        known = ", ".join([self.pinned.release, *(h.release for h in self.history)])
        raise PinError(f"{self.source}: Triton release {name!r} is not described (known: {known})")


def _need(table: dict, key: str, where: str, source: Path):
    if key not in table:
        raise PinError(f"{source}: {where}.{key} is missing")
    return table[key]


def load_pins(path: Path | None = None) -> Pins:
    source = Path(path or COMPAT_PATH)
    try:
        doc = tomllib.loads(source.read_text())
    except (OSError, tomllib.TOMLDecodeError) as exc:
        raise PinError(f"{source}: cannot read the version pins: {exc}") from exc
    triton = _need(doc, "triton", "(root)", source)
    local = _need(doc, "local", "(root)", source)
    imports = _need(_need(triton, "backend_imports", "triton", source), "modules", "triton.backend_imports", source)
    pinned = TritonRelease(
        release=_need(triton, "release", "triton", source),
        vllm_version=_need(triton, "vllm_version", "triton", source),
        vllm_backend_branch=_need(triton, "vllm_backend_branch", "triton", source),
        structured_outputs_key=_need(triton, "structured_outputs_key", "triton", source),
        structured_outputs_engine_arg=_need(triton, "structured_outputs_engine_arg", "triton", source),
        backend_imports=tuple(imports),
    )
    history = tuple(
        TritonRelease(
            release=_need(h, "release", f"history[{i}]", source),
            vllm_version=_need(h, "vllm_version", f"history[{i}]", source),
            vllm_backend_branch=_need(h, "vllm_backend_branch", f"history[{i}]", source),
            structured_outputs_key=_need(h, "structured_outputs_key", f"history[{i}]", source),
            structured_outputs_engine_arg=_need(h, "structured_outputs_engine_arg", f"history[{i}]", source),
            backend_imports=tuple(_need(h, "backend_imports", f"history[{i}]", source)),
        )
        for i, h in enumerate(doc.get("history", []))
    )
    local_triton = None
    if "triton" in local:
        table = local["triton"]
        where = "local.triton"
        local_triton = LocalTriton(
            **{key: _need(table, key, where, source) for key in ("distribution", "distribution_version",
                                                                 "server_version", "release", "python_backend_stub",
                                                                 "stub_numpy", "stub_xgboost", "stub_scipy")},
            relied_on=tuple(table.get("relied_on", ())),
            differences=tuple(table.get("differences", ())),
        )
    return Pins(
        pinned=pinned,
        image=_need(triton, "image", "triton", source),
        vllm_build=_need(triton, "vllm_build", "triton", source),
        local_distribution=_need(local, "distribution", "local", source),
        local_vllm_version=_need(local, "vllm_version", "local", source),
        local_differences=tuple(local.get("differences", ())),
        history=history,
        source=source,
        local_triton=local_triton,
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
