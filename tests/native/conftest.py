"""Fixtures of the native-core tests."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def vllm_config(demo_model_dir):
    """A real VllmConfig for the demo model (no engine is started)."""
    from vllm.engine.arg_utils import EngineArgs

    return EngineArgs(model=str(demo_model_dir), max_model_len=256, max_num_seqs=6).create_engine_config()
