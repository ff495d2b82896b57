"""Fixtures shared by every suite. Kept free of heavy imports: tests/infra runs in the Pulumi venv."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from llm_serving.repository import REPO_ROOT

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


# -- running on several workers (pytest-xdist) ----------------------------------------------------------------------
#
# `make test` runs the serving suite on two pytest-xdist workers with `--dist loadgroup` (a server boot leaves a core
# idle most of the time: measured, the serving suite alone kept the 2-core machine 40-60 % busy). What must stay on
# one worker goes to it as one unit:
# - a module's tests, because module-scoped fixtures (a module's own server or engine) are set up once per worker;
# - every module that uses one of the shared servers of a topology (SHARED_SERVERS), because a session fixture is
#   per worker too: one group per server, so the suite still boots each of them once.
# The units start in the order this hook leaves them (the Makefile passes --no-loadscope-reorder): those that boot
# servers first, so that the long ones do not end up alone at the tail. Without xdist the marks change nothing.
SHARED_SERVERS = ("openai_server", "triton_standalone")


def _module_of(item: pytest.Item) -> str:
    return item.nodeid.split("::", 1)[0]


@pytest.hookimpl(wrapper=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]):
    # A wrapper, so that the marks are in place before any plugin's own hook runs: pytest-xdist's worker reads them in
    # its pytest_collection_modifyitems (and needs pytest < 9: pyproject.toml's pin says why).
    _group_for_workers(items)
    return (yield)


def _group_for_workers(items: list[pytest.Item]) -> None:
    parent: dict[str, str] = {}

    def find(node: str) -> str:
        while parent.setdefault(node, node) != node:
            node = parent[node]
        return node

    for item in items:
        module = find(_module_of(item))
        for server in SHARED_SERVERS:
            if server in getattr(item, "fixturenames", ()):
                root = find(server)
                if root != module:
                    parent[module] = root
                module = find(root)
    groups = {item.nodeid: find(_module_of(item)) for item in items}

    def boots(group: str) -> int:
        """2: a shared server's group; 1: a group with a test marked slow (it starts an engine or a server)."""
        if group in SHARED_SERVERS:
            return 2
        return int(any(groups[i.nodeid] == group and i.get_closest_marker("slow") for i in items))

    rank = {group: boots(group) for group in set(groups.values())}
    first_seen = {group: n for n, group in reversed(list(enumerate(groups[i.nodeid] for i in items)))}
    items.sort(key=lambda i: (-rank[groups[i.nodeid]], first_seen[groups[i.nodeid]]))
    for item in items:
        item.add_marker(pytest.mark.xdist_group(groups[item.nodeid]))
