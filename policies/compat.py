"""The image pins of `serving_image/compat.toml` (docs/architecture.md §3.9), as the image-pin policy reads them.

Only three values matter to policy: the Triton release, the vLLM version inside that release, and the vLLM backend
branch. The file is read by its one reader, llm_serving/compat.py, which fails with the file's path and the key
when one is missing or ill-typed; this module picks the three.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from llm_serving.compat import COMPAT_PATH, CompatError, load_compat

DEFAULT_PATH = COMPAT_PATH
__all__ = ["DEFAULT_PATH", "CompatError", "Pins", "load_pins"]


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


def load_pins(path: Path | str | None = None) -> Pins:
    file = Path(path) if path else DEFAULT_PATH
    if not file.is_file():
        raise CompatError(f"{file}: not found, so the image pins cannot be checked (docs/architecture.md §3.9)")
    triton = load_compat(file).triton
    return Pins(triton_release=triton.release, vllm_version=triton.vllm_version,
                vllm_backend_branch=triton.vllm_backend_branch, source=str(file))
