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

# Hypothesis judges by the clock by default: an example slower than 200 ms fails (`deadline`), and so does slow data
# generation (HealthCheck.too_slow). Both fail on a loaded or small machine, not on a wrong answer: off for every
# property test of every suite. (Loaded here, before any test module builds its @settings, so that the settings a
# module gives inherit the rest from this profile.)
try:
    from hypothesis import HealthCheck, settings
except ImportError:  # a venv without hypothesis has no property tests
    pass
else:
    settings.register_profile("llm-serving", deadline=None, suppress_health_check=[HealthCheck.too_slow])
    settings.load_profile("llm-serving")


@pytest.fixture(scope="session")
def demo_model_dir() -> Path:
    """The deterministic tiny demo model (built once per machine into the repository's cache)."""
    from filelock import FileLock

    from serving_image.demo_model import ensure_demo_model

    target = CACHE_ROOT / "models" / "demo-tiny"
    target.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(target) + ".lock"):
        return ensure_demo_model(target)
