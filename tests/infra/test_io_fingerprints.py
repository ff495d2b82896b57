"""The LLM I/O fingerprint is computed in one place (llm_serving/tensor_contract.py); the stacks name it, and nothing
restates an old one."""

from __future__ import annotations

import yaml

from llm_serving.repository import REPO_ROOT
from llm_serving.tensor_contract import RETIRED_VLLM_IO_FINGERPRINTS, VLLM_IO_FINGERPRINT

STACKS = REPO_ROOT / "stacks"


def _fingerprints() -> dict[str, set[str]]:
    found: dict[str, set[str]] = {}
    for path in sorted(STACKS.glob("Pulumi.*.yaml")):
        config = yaml.safe_load(path.read_text())["config"]
        for model in config.get("llm-serving:models", []):
            for version in model["versions"]:
                where = f"{path.name}: {model['id']} {version['version']}"
                found.setdefault(version["ioFingerprint"], set()).add(where)
    return found


def test_stacks_use_the_computed_vllm_fingerprint():
    found = _fingerprints()
    assert VLLM_IO_FINGERPRINT in found, "no stack serves an LLM with the current vLLM tensor contract"
    stale = {fp: where for fp, where in found.items() if fp in RETIRED_VLLM_IO_FINGERPRINTS}
    assert not stale, f"stacks restate a retired vLLM I/O fingerprint (now {VLLM_IO_FINGERPRINT}): {stale}"
