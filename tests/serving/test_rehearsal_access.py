"""The rehearsal's enforcement of caller authentication, pure parts (docs/rehearsal.md): the Secrets it makes for the
rendered ExternalSecrets, the pods' secret volumes, HAProxy's key check as rendered, and the node's NetworkPolicy
rules. The full rehearsal (`make rehearse`, root) runs them for real and shows the three access cases."""

from __future__ import annotations

import itertools
import shutil
import subprocess

import pytest

from llm_serving import pod_contract as pc
from rehearsal import haproxy_config, net, podspec, secrets
from rehearsal.gateway import gateway_api_keys
from rehearsal.gateway_routes import Gateway, Listener

EXTERNAL = [
    {"metadata": {"name": "llm-serving-api-keys", "namespace": "llm-serving"},
     "spec": {"target": {"name": "llm-serving-api-keys"}, "dataFrom": [{"extract": {"key": "llm-serving/dev/k"}}]}},
    {"metadata": {"name": "chat-batch-worker-api-key", "namespace": "llm-serving"},
     "spec": {"target": {"name": "chat-batch-worker-api-key"},
              "data": [{"secretKey": "api-key",
                        "remoteRef": {"key": "llm-serving/dev/k", "property": "chat-batch-worker"}}]}},
]


def _keys():
    counter = itertools.count()
    return lambda: f"key-{next(counter)}"


def test_every_external_secret_becomes_its_secret_with_keys_of_this_run(tmp_path):
    plan = secrets.plan_secrets(EXTERNAL, _keys())
    keys = plan.secrets["llm-serving-api-keys"]
    assert set(keys) == {"chat-batch-worker", secrets.REHEARSAL_CLIENT}
    assert plan.secrets["chat-batch-worker-api-key"] == {"api-key": keys["chat-batch-worker"]}  # the same client's
    assert plan.client_key() == keys[secrets.REHEARSAL_CLIENT]
    dirs = plan.write(tmp_path)
    assert (tmp_path / "llm-serving-api-keys" / "chat-batch-worker").read_text() == keys["chat-batch-worker"]
    assert dirs["chat-batch-worker-api-key"] == str(tmp_path / "chat-batch-worker-api-key")
    assert oct((tmp_path / "llm-serving-api-keys").stat().st_mode & 0o777) == "0o555"


def test_an_external_secret_the_rehearsal_cannot_make_is_named():
    with pytest.raises(secrets.SecretsError, match="names no remoteRef key and property"):
        secrets.plan_secrets([{"metadata": {"name": "x"}, "spec": {"data": [{"secretKey": "a", "remoteRef": {}}]}}])


def _deployment(secret: dict) -> dict:
    return {"inputs": {"metadata": {"name": "m", "namespace": "llm-serving"}, "spec": {"replicas": 1, "template": {
        "metadata": {"labels": {"app.kubernetes.io/name": "m"}},
        "spec": {"securityContext": {"runAsUser": 10001}, "volumes": [{"name": "keys", "secret": secret}],
                 "containers": [{"name": "c", "command": ["x"], "volumeMounts": [
                     {"name": "keys", "mountPath": pc.API_KEYS_MOUNT, "readOnly": True}]}]}}}}}


def test_a_required_secret_is_mounted_read_only_from_the_rehearsals_directory(tmp_path):
    from tests.serving.test_rehearsal import IMAGE

    (plan,) = podspec.pod_plans(_deployment({"secretName": pc.API_KEYS_SECRET}), IMAGE, {}, lambda p, v: tmp_path,
                                secret_sources={pc.API_KEYS_SECRET: "/run/keys"})
    (mount,) = plan.mounts
    assert (mount.target, mount.source, mount.read_only) == (pc.API_KEYS_MOUNT, "/run/keys", True)
    with pytest.raises(podspec.PodSpecError, match="which no ExternalSecret of the stack produces"):
        podspec.pod_plans(_deployment({"secretName": "other"}), IMAGE, {}, lambda p, v: tmp_path,
                          secret_sources={pc.API_KEYS_SECRET: "/run/keys"})


POLICY = {"metadata": {"name": "llm-serving-api-keys", "namespace": "llm-serving"},
          "spec": {"targetRefs": [{"group": "gateway.networking.k8s.io", "kind": "Gateway", "name": "llm-serving"}],
                   "apiKeyAuth": {"credentialRefs": [{"name": "llm-serving-api-keys"}],
                                  "extractFrom": [{"headers": ["authorization"]}]}}}


def test_the_gateway_takes_the_keys_of_the_rendered_security_policy():
    plan = secrets.plan_secrets(EXTERNAL, _keys())
    keys = gateway_api_keys([POLICY], "llm-serving", "llm-serving", plan)
    assert keys == sorted(plan.secrets["llm-serving-api-keys"].values())
    assert gateway_api_keys([], "llm-serving", "llm-serving", plan) is None  # nothing rendered: no check
    on_route = {**POLICY, "spec": {**POLICY["spec"], "targetRefs": [{"kind": "HTTPRoute", "name": "chat"}]}}
    with pytest.raises(haproxy_config.ProxyConfigError, match="on the Gateway llm-serving only"):
        gateway_api_keys([on_route], "llm-serving", "llm-serving", plan)
    with pytest.raises(haproxy_config.ProxyConfigError, match="is none the rehearsal made"):
        gateway_api_keys([POLICY], "llm-serving", "llm-serving", secrets.plan_secrets([]))


def test_haproxy_refuses_a_caller_without_a_key_before_any_route(tmp_path):
    keys_file = tmp_path / "api-keys.acl"
    keys_file.write_text(haproxy_config.api_key_patterns(["k1", "k2"]))
    assert keys_file.read_text() == "Bearer k1\nBearer k2\n"
    gateway = Gateway("llm-serving", (Listener("openai", 443, "HTTP", "*.example.com"),))
    settings = haproxy_config.Settings(binds={443: ("127.0.0.1", 8443)}, admin_socket=tmp_path / "admin.sock",
                                       api_keys_file=keys_file, access_log=False)
    text = haproxy_config.render_config(gateway, [], {}, settings).text
    lines = text.splitlines()
    acl = lines.index(f"    acl caller_authenticated req.hdr(authorization) -m str -f {keys_file}")
    refuse = next(i for i, line in enumerate(lines) if line.startswith("    http-request return status 401"))
    assert acl < refuse < lines.index("    default_backend no-route")
    assert "if !caller_authenticated" in lines[refuse] and "www-authenticate Bearer" in lines[refuse]
    without = haproxy_config.render_config(gateway, [], {}, haproxy_config.Settings(
        binds={443: ("127.0.0.1", 8443)}, admin_socket=tmp_path / "admin.sock", access_log=False)).text
    assert "caller_authenticated" not in without
    with pytest.raises(haproxy_config.ProxyConfigError, match="none given"):
        haproxy_config.api_key_patterns([])
    with pytest.raises(haproxy_config.ProxyConfigError, match="a space"):
        haproxy_config.api_key_patterns(["a b"])


def test_haproxy_accepts_the_rendered_key_check(tmp_path):
    """HAProxy itself parses the rendered configuration (`haproxy -c`)."""
    assert shutil.which("haproxy"), "haproxy is missing: make serving-env installs it (apt-get install haproxy)"
    keys_file = tmp_path / "api-keys.acl"
    keys_file.write_text(haproxy_config.api_key_patterns(["k1"]))
    gateway = Gateway("llm-serving", (Listener("openai", 443, "HTTP", "*.example.com"),))
    settings = haproxy_config.Settings(binds={443: ("127.0.0.1", 8443)}, admin_socket=tmp_path / "admin.sock",
                                       api_keys_file=keys_file, access_log=False)
    config = tmp_path / "haproxy.cfg"
    config.write_text(haproxy_config.render_config(gateway, [], {}, settings).text)
    check = subprocess.run(["haproxy", "-c", "-f", str(config)], capture_output=True, text=True)
    assert check.returncode == 0, check.stdout + check.stderr


MODEL_POLICY = {
    "metadata": {"name": "chat-1-0-0", "namespace": "llm-serving"},
    "spec": {"podSelector": {"matchLabels": {"app.kubernetes.io/name": "chat"}}, "policyTypes": ["Ingress"],
             "ingress": [
                 {"ports": [{"protocol": "TCP", "port": p} for p in (8000, 8001, 9000)],
                  "from": [{"namespaceSelector": {"matchLabels": {
                      "kubernetes.io/metadata.name": net.GATEWAY_PROXY_NAMESPACE}},
                      "podSelector": {"matchLabels": {"gateway.envoyproxy.io/owning-gateway-name": "llm-serving"}}}]},
                 {"ports": [{"protocol": "TCP", "port": 8002}],
                  "from": [{"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}}}]}]}}
NODE_NAMESPACES = (net.GATEWAY_PROXY_NAMESPACE, "monitoring")


def test_a_model_pod_admits_only_the_node_namespace_on_its_ports():
    rules = net.policy_rules([MODEL_POLICY], "llm-serving", {"app.kubernetes.io/name": "chat"}, NODE_NAMESPACES)
    assert rules == [([f"{net.GATEWAY}/32"], [8000, 8001, 9000]), ([f"{net.GATEWAY}/32"], [8002])]
    assert net.ingress_rules("10.213.1.4", rules) == [
        f"-A {net.NETPOL_CHAIN} -d 10.213.1.4/32 -s 10.213.0.1/32 -p tcp -m multiport --dports 8000,8001,9000 "
        "-j ACCEPT",
        f"-A {net.NETPOL_CHAIN} -d 10.213.1.4/32 -s 10.213.0.1/32 -p tcp -m multiport --dports 8002 -j ACCEPT",
        f"-A {net.NETPOL_CHAIN} -d 10.213.1.4/32 -p tcp -j REJECT --reject-with tcp-reset",
        f"-A {net.NETPOL_CHAIN} -d 10.213.1.4/32 -j DROP"]


def test_a_pod_no_policy_selects_is_left_open_and_an_open_rule_admits_anyone():
    assert net.policy_rules([MODEL_POLICY], "llm-serving", {"app.kubernetes.io/name": "worker"},
                            NODE_NAMESPACES) is None
    assert net.policy_rules([MODEL_POLICY], "other", {"app.kubernetes.io/name": "chat"}, NODE_NAMESPACES) is None
    open_rule = {**MODEL_POLICY, "spec": {**MODEL_POLICY["spec"], "ingress": [{"ports": [{"port": 9000}]}]}}
    rules = net.policy_rules([open_rule], "llm-serving", {"app.kubernetes.io/name": "chat"}, NODE_NAMESPACES)
    assert net.ingress_rules("10.213.1.4", rules)[0] == (
        f"-A {net.NETPOL_CHAIN} -d 10.213.1.4/32 -p tcp -m multiport --dports 9000 -j ACCEPT")


def test_a_peer_the_rehearsal_does_not_run_is_named():
    other = {**MODEL_POLICY, "spec": {**MODEL_POLICY["spec"], "ingress": [
        {"from": [{"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "elsewhere"}}}]}]}}
    with pytest.raises(net.NetError, match="is none the rehearsal runs"):
        net.policy_rules([other], "llm-serving", {"app.kubernetes.io/name": "chat"}, NODE_NAMESPACES)
