"""The image pins of `serving_image/compat.toml` (docs/architecture.md §3.9), as the image-pin policy reads them.

Only three values matter to policy: the Triton release, the vLLM version inside that release, and the vLLM backend
branch. The file is owned by the serving image; this module reads it and nothing else, and fails with the file's
path and the missing key when it cannot find one of the three.
"""

from __future__ import annotations

import re
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

DEFAULT_PATH = Path(__file__).resolve().parents[1] / "serving_image" / "compat.toml"

# Where each pin may live in the file (dotted paths, first match wins).
_TRITON_RELEASE = ("triton.release", "triton.version", "triton_release", "triton.image_tag")
_VLLM_VERSION = ("triton.vllm_version", "vllm.version", "vllm_version")
_BACKEND_BRANCH = (
    "triton.vllm_backend_branch",
    "triton.vllm_backend.branch",
    "vllm_backend.branch",
    "backend.branch",
    "triton.backend_branch",
    "vllm_backend_branch",
)


class CompatError(ValueError):
    pass


@dataclass(frozen=True)
class Pins:
    triton_release: str
    vllm_version: str
    vllm_backend_branch: str
    source: str

    def as_dict(self) -> dict[str, str]:
        return {
            "triton_release": self.triton_release,
            "vllm_version": self.vllm_version,
            "vllm_backend_branch": self.vllm_backend_branch,
        }


def _lookup(doc: Mapping[str, Any], paths: tuple[str, ...], what: str, source: str) -> str:
    for dotted in paths:
        cur: Any = doc
        for part in dotted.split("."):
            cur = cur.get(part) if isinstance(cur, Mapping) else None
        if isinstance(cur, str | int | float) and not isinstance(cur, bool) and str(cur):
            return str(cur)
    raise CompatError(f"{source}: no {what} (looked for {', '.join(paths)})")


def load_pins(path: Path | str | None = None) -> Pins:
    file = Path(path) if path else DEFAULT_PATH
    if not file.is_file():
        raise CompatError(f"{file}: not found, so the image pins cannot be checked (docs/architecture.md §3.9)")
    try:
        doc = tomllib.loads(file.read_text())
    except tomllib.TOMLDecodeError as err:
        raise CompatError(f"{file}: not valid TOML: {err}") from err
    source = str(file)
    release = _lookup(doc, _TRITON_RELEASE, "Triton release", source)
    # An NGC image tag ("25.10-vllm-python-py3") carries the release as its first part.
    match = re.match(r"^(\d{2}\.\d{2})", release)
    return Pins(
        triton_release=match.group(1) if match else release,
        vllm_version=_lookup(doc, _VLLM_VERSION, "vLLM version", source),
        vllm_backend_branch=_lookup(doc, _BACKEND_BRANCH, "vLLM backend branch", source),
        source=source,
    )
