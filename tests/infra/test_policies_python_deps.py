"""serving-python-dependencies-in-image (policies/rules/python_deps.py): a stack's Python-backend models declare what
their packages import (`models[].pythonDependencies`), and the policy refuses one the serving image's stub pins
(serving_image/compat.toml [triton.stub]) cannot meet, naming the distribution. The shipped stacks' python models
pass it in test_policies_stacks.py (every mandatory policy on every shipped stack)."""

from __future__ import annotations

import re

import pytest

from infra.config import ModelConfig
from llm_serving.repository import REPO_ROOT
from tests.infra.policy_support import COMPAT_TOML, compliant_stack, fired, messages, model, write_compat

POLICY = "serving-python-dependencies-in-image"
RANKER = ["numpy>=1.24", "xgboost==3.0.5", "scipy==1.13.1"]


@pytest.fixture
def compat(tmp_path):
    # The real pins: the policy checks against what the image build installs.
    return write_compat(tmp_path, (REPO_ROOT / "serving_image" / "compat.toml").read_text())


def _stack(dependencies):
    stack = compliant_stack()
    stack.config["llm-serving:models"] = [model(pythonDependencies=dependencies)]
    return stack


def test_dependencies_the_image_meets_pass(compat):
    assert POLICY not in fired(_stack(RANKER).evaluate(compat))


def test_a_distribution_the_image_lacks_is_named(compat):
    findings = _stack([*RANKER, "lightgbm==4.5.0"]).evaluate(compat)
    [message] = messages(findings, POLICY)
    assert message.startswith("model 'llama' (kind: python) in stack 'prod-us-east-1': pythonDependencies "
                              "lightgbm==4.5.0 needs lightgbm, which the serving image's Python backend stub "
                              "(Triton 26.08, compat.toml [triton.stub]) does not have")
    assert "add the distribution to compat.toml [triton.stub] install" in message


def test_another_version_than_the_image_s_is_named(compat):
    [message] = messages(_stack(["xgboost==2.1.0"]).evaluate(compat), POLICY)
    assert "xgboost==2.1.0 needs xgboost ==2.1.0; the serving image's Python backend stub" in message
    assert "has xgboost 3.0.5" in message


def test_compat_without_stub_pins_is_reported(tmp_path):
    without = re.sub(r"\n\[triton\.stub\]\n.*?(?=\n\[local\]\n)", "\n", COMPAT_TOML, flags=re.S)
    [message] = messages(_stack(RANKER).evaluate(write_compat(tmp_path, without)), POLICY)
    assert "compat.toml: [triton.stub] is missing" in message


def test_schema_refuses_a_malformed_or_misplaced_declaration():
    entry = model(pythonDependencies=["xgboost=="])
    with pytest.raises(ValueError, match=r"pythonDependencies\[0\]: 'xgboost==' is not a PEP 508 requirement"):
        ModelConfig.model_validate(entry)
    with pytest.raises(ValueError, match=r"pythonDependencies\[0\]: 'torch==2.5.0': torch's version is fixed"):
        ModelConfig.model_validate(model(pythonDependencies=["torch==2.5.0"]))
