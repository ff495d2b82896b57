"""The caller-authentication rules (policies/rules/auth.py) on a synthetic stack: each break caught, named."""

from __future__ import annotations

import pytest

from tests.infra.policy_support import compliant_stack, container, fired, inputs_of, messages, pod, write_compat


@pytest.fixture
def compat(tmp_path):
    return write_compat(tmp_path)


def _check(stack, compat, policy, message):
    findings = stack.evaluate(compat)
    assert fired(findings) == {policy}, [(f.policy, f.message) for f in findings]
    assert any(message in m for m in messages(findings, policy)), messages(findings, policy)


def test_the_compliant_stack_passes(compat):
    assert compliant_stack().evaluate(compat) == []


def test_a_route_without_a_security_policy_is_refused(compat):
    stack = compliant_stack()
    stack.remove("gateway-api-keys")
    _check(stack, compat, "gateway-api-keys-required", "no SecurityPolicy with API keys (apiKeyAuth) or JWT")


def test_a_security_policy_on_another_gateway_does_not_cover_the_route(compat):
    stack = compliant_stack()
    inputs_of(stack, "gateway-api-keys")["spec"]["targetRefs"][0]["name"] = "another-gateway"
    _check(stack, compat, "gateway-api-keys-required", "HTTPRoute 'llama-v1'")


def test_a_security_policy_without_keys_does_not_authenticate(compat):
    stack = compliant_stack()
    inputs_of(stack, "gateway-api-keys")["spec"].pop("apiKeyAuth")
    _check(stack, compat, "gateway-api-keys-required", "no SecurityPolicy")


def test_a_security_policy_on_the_route_itself_covers_it(compat):
    stack = compliant_stack()
    inputs_of(stack, "gateway-api-keys")["spec"]["targetRefs"] = [
        {"group": "gateway.networking.k8s.io", "kind": "HTTPRoute", "name": "llama-v1"}]
    assert stack.evaluate(compat) == []


def test_keys_the_program_writes_itself_are_refused(compat):
    stack = compliant_stack()
    stack.remove("api-keys")
    stack.add("kubernetes:core/v1:Secret", "plain-keys", {
        "apiVersion": "v1", "kind": "Secret", "metadata": {"name": "llm-serving-api-keys", "namespace": "llm-serving"},
        "stringData": {"client": "in-the-state"}})
    _check(stack, compat, "gateway-api-keys-required", "the program writes itself")


def test_a_model_pod_without_its_key_file_is_refused(compat):
    stack = compliant_stack()
    container(stack)["env"] = [e for e in container(stack)["env"] if e["name"] != "LLM_SERVING_API_KEYS_FILE"]
    _check(stack, compat, "serving-api-keys-required", "names no key file")


def test_an_optional_key_secret_is_refused(compat):
    stack = compliant_stack()
    next(v for v in pod(stack)["volumes"] if v["name"] == "api-keys")["secret"]["optional"] = True
    _check(stack, compat, "serving-api-keys-required", "optional")


def test_a_writable_key_mount_is_refused(compat):
    stack = compliant_stack()
    next(m for m in container(stack)["volumeMounts"] if m["name"] == "api-keys")["readOnly"] = False
    _check(stack, compat, "serving-api-keys-required", "writable")


def test_keys_from_something_else_than_a_secret_are_refused(compat):
    stack = compliant_stack()
    next(v for v in pod(stack)["volumes"] if v["name"] == "api-keys").update(secret=None, emptyDir={})
    _check(stack, compat, "serving-api-keys-required", "not a Secret's volume")


@pytest.mark.parametrize("value", [None, "0", "yes"])
def test_kserve_ports_without_the_key_check_are_refused(compat, value):
    stack = compliant_stack()
    env = [e for e in container(stack)["env"] if e["name"] != "LLM_SERVING_REQUIRE_API_KEYS"]
    if value is not None:
        env.append({"name": "LLM_SERVING_REQUIRE_API_KEYS", "value": value})
    container(stack)["env"] = env
    _check(stack, compat, "serving-kserve-ports-authenticated", "KServe ports (8000, 8001)")
