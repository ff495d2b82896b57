"""Fixtures shared by every suite. Kept free of heavy imports: tests/infra runs in the Pulumi venv."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]
CACHE_ROOT = REPO_ROOT / ".cache" / "llm-serving"

# Nothing may reach a model hub from a test.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


@pytest.fixture(scope="session")
def demo_model_dir() -> Path:
    """The deterministic tiny demo model (built once per machine into the repository's cache)."""
    from filelock import FileLock

    from serving_image.demo_model import ensure_demo_model

    target = CACHE_ROOT / "models" / "demo-tiny"
    target.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(target) + ".lock"):
        return ensure_demo_model(target)
