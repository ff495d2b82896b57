"""The soak as a marked test: `make bench` runs it; `make test` leaves it out (ten minutes)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from bench.soak import DEFAULT_SECONDS, RSS_GROWTH_BOUND_MB, soak

pytestmark = pytest.mark.soak


def test_soak_at_concurrency_32_has_no_failures_and_bounded_memory(demo_model_dir: Path, tmp_path: Path):
    seconds = float(os.environ.get("LLM_SERVING_SOAK_S", DEFAULT_SECONDS))
    result = soak(demo_model_dir, tmp_path, seconds)
    assert result.requests > 0
    assert result.failures == []
    assert result.rss_growth_mb <= RSS_GROWTH_BOUND_MB
