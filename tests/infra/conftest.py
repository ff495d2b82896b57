"""What the infra test modules share: every shipped stack's mock run with its parsed config."""

from __future__ import annotations

import pytest
import yaml

from infra.config import StackConfig, parse_stack_config
from infra.mockrun import StackRun, shipped_run, shipped_stacks, stack_config_path


def config_of(stack: str) -> StackConfig:
    raw = yaml.safe_load(stack_config_path(stack).read_text())["config"]
    values = {k.split(":", 1)[1]: v for k, v in raw.items() if k.startswith("llm-serving:")}
    return parse_stack_config(values, raw["aws:region"])


@pytest.fixture(scope="module", params=shipped_stacks())
def stack(request) -> tuple[StackRun, StackConfig]:
    """Each shipped stack's mock run and config (module scope: each module runs every stack once)."""
    return shipped_run(request.param), config_of(request.param)
