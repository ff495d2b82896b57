"""Experiments and in-process marks in the stack config (docs/clients.md, "Experiments" and "In the caller's
process"): the schema names the key of every bad declaration; the program renders them into the stack outputs'
schema version 2 (tests/infra/test_infra_outputs.py reads them back)."""

from __future__ import annotations

import copy

import pytest
import yaml

from infra.config import ConfigError, parse_stack_config
from infra.mockrun import stack_config_path

STACK = "prod-us-west-2"  # chat-large (red-black) and the ranker (versioned 3.0.0, 4.0.0; inProcess)


def base() -> dict:
    raw = yaml.safe_load(stack_config_path(STACK).read_text())["config"]
    return {k.split(":", 1)[1]: v for k, v in raw.items() if k.startswith("llm-serving:")}


def with_experiment(arms: list[dict], name: str = "exp", unit: str = "user") -> dict:
    values = copy.deepcopy(base())
    values["experiments"] = [*values["experiments"], {"name": name, "unit": unit, "arms": arms}]
    return values


def error_for(values: dict) -> str:
    with pytest.raises(ConfigError) as info:
        parse_stack_config(values, "us-west-2")
    return str(info.value)


def test_the_shipped_experiment_parses():
    cfg = parse_stack_config(base(), "us-west-2")
    assert [(e.name, e.unit, [a.percent for a in e.arms]) for e in cfg.experiments] == [
        ("chat-temperature", "user", [90, 10])]
    assert cfg.regional_package_uri(cfg.models[1].versions[0].package).startswith("s3://acme-llm-prod-us-west-2/")


def test_a_version_experiment_on_a_versioned_model_parses():
    cfg = parse_stack_config(with_experiment([{"name": "old", "model": "ranker", "version": "3.0.0", "percent": 50},
                                              {"name": "new", "model": "ranker", "version": "4.0.0", "percent": 50}]),
                             "us-west-2")
    assert [a.version for a in cfg.experiments[1].arms] == ["3.0.0", "4.0.0"]


@pytest.mark.parametrize("arms,expected", [
    ([{"name": "a", "model": "ranker", "percent": 50}, {"name": "b", "model": "ranker", "percent": 40}],
     "llm-serving:experiments[1].arms: the percentages sum to 90, not 100 (a: 50, b: 40)"),
    ([{"name": "a", "model": "ranker", "percent": 50}, {"name": "a", "model": "ranker", "percent": 50}],
     "llm-serving:experiments[1].arms: duplicate arm names ['a']"),
    ([{"name": "a", "model": "ranker", "version": "2.0.0", "percent": 50},
      {"name": "b", "model": "ranker", "percent": 50}],
     "llm-serving:experiments[1].arms[0].version: 'ranker' does not serve '2.0.0' (served: ['3.0.0', '4.0.0'])"),
    ([{"name": "a", "model": "chat-large", "version": "2.3.0", "percent": 50},
      {"name": "b", "model": "chat-large", "percent": 50}],
     "llm-serving:experiments[1].arms[0].version: 'chat-large' is red-black"),
    ([{"name": "a", "model": "chat-huge", "percent": 50}, {"name": "b", "model": "chat-large", "percent": 50}],
     "llm-serving:experiments[1].arms[0].model: 'chat-huge' is not a model of this stack"),
    ([{"name": "a", "model": "ranker", "percent": 100}],
     "llm-serving:experiments[1].arms: List should have at least 2 items"),
    ([{"name": "a", "model": "ranker", "percent": 50}, {"name": "b", "model": "ranker", "percent": 50,
                                                         "share": 3}],
     "llm-serving:experiments[1].arms[1].share: unknown key"),
])
def test_a_bad_experiment_names_its_key(arms, expected):
    assert expected in error_for(with_experiment(arms))


def test_the_unit_is_user_profile_or_request():
    arms = [{"name": "a", "model": "ranker", "percent": 50}, {"name": "b", "model": "ranker", "percent": 50}]
    assert "llm-serving:experiments[1].unit: Input should be 'user', 'profile' or 'request'" in error_for(
        with_experiment(arms, unit="session"))


def test_experiment_names_are_unique():
    arms = [{"name": "a", "model": "ranker", "percent": 50}, {"name": "b", "model": "ranker", "percent": 50}]
    assert "llm-serving:experiments: duplicate experiment names ['chat-temperature']" in error_for(
        with_experiment(arms, name="chat-temperature"))


def test_only_a_cpu_python_model_runs_in_process():
    values = copy.deepcopy(base())
    chat = next(m for m in values["models"] if m["id"] == "chat-large")
    chat["inProcess"] = True
    assert "llm-serving:models[0].inProcess: only a python model without gpu may run in the caller's process; " \
           "this model is kind: vllm with gpu" in error_for(values)


# -- the policy, on the real program's resources (prod-us-west-2's mock run) -----------------------------------------


def _policy_findings(experiments: list[dict]) -> list[str]:
    from infra.mockrun import shipped_run
    from policies.offline import evaluate

    run = shipped_run(STACK)
    config = copy.deepcopy(run.config)
    config["llm-serving:experiments"] = experiments
    return [f.message for f in evaluate(run.resources, run.stack, run.project, config)
            if f.policy == "experiments-arms-served" and f.blocking]


def test_the_policy_passes_the_shipped_experiment_and_a_served_version_experiment():
    assert _policy_findings(base()["experiments"]) == []
    assert _policy_findings([{"name": "ranker-v4", "unit": "user", "arms": [
        {"name": "old", "model": "ranker", "version": "3.0.0", "percent": 50},
        {"name": "new", "model": "ranker", "version": "4.0.0", "percent": 50}]}]) == []


@pytest.mark.parametrize("arms,expected", [
    ([{"name": "a", "model": "ranker", "version": "3.0.0", "percent": 60},
      {"name": "b", "model": "ranker", "version": "4.0.0", "percent": 50}],
     "llm-serving:experiments[0]: arms: the percentages sum to 110, not 100"),
    ([{"name": "a", "model": "ranker", "version": "2.0.0", "percent": 50},
      {"name": "b", "model": "ranker", "version": "4.0.0", "percent": 50}],
     "arms[0].version: 'ranker' does not serve '2.0.0'"),
    ([{"name": "a", "model": "chat-large", "version": "2.3.0", "percent": 50},
      {"name": "b", "model": "chat-large", "percent": 50}],
     "arms[0].version: 'chat-large' is red-black"),
])
def test_the_policy_names_a_bad_experiment(arms, expected):
    findings = _policy_findings([{"name": "exp", "unit": "user", "arms": arms}])
    assert any(expected in f for f in findings), findings
