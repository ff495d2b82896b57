"""The bootstrap a fresh account and cluster need (infra/bootstrap.py, docs/first-update.md): what the program renders
for every shipped stack (the charts cannot be fetched here), and the two policies that hold it."""

from __future__ import annotations

import pytest

from infra.charts import CHARTS, CRD_SOURCES, chart_key
from policies.index import StackIndex
from policies.offline import to_policy_resources
from policies.rules.bootstrap import _closure, api_group
from tests.infra.policy_support import compliant_stack, fired, inputs_of, messages, write_compat

RELEASE = "kubernetes:helm.sh/v3:Release"


def _index(run):
    return StackIndex(to_policy_resources(run.resources))


def test_every_custom_resource_waits_for_the_release_installing_its_crds(stack):
    run, _ = stack
    index = _index(run)
    releases = {chart_key(str(r.props["chart"])): r for r in index.of_type(RELEASE)}
    custom = [r for r in index.resources if api_group(r.resource_type)]
    kinds = {r.resource_type.rsplit(":", 1)[-1] for r in custom}
    assert {"Gateway", "GatewayClass", "HTTPRoute", "GRPCRoute", "PodMonitor", "PrometheusRule", "NodePool",
            "EC2NodeClass", "ClusterIssuer", "Certificate", "ScaledObject"} <= kinds
    for resource in custom:
        source = releases[CRD_SOURCES[api_group(resource.resource_type)]]
        assert source.urn in _closure(index, resource), resource.name


def test_charts_are_pinned_and_rendered(stack):
    run, cfg = stack
    rendered = {r.inputs["name"]: r.inputs for r in run.of_type(RELEASE)}
    for key, spec in CHARTS.items():
        release = next(v for v in rendered.values() if v["chart"] == spec["chart"])
        assert release["version"] == spec["version"] and release["version"][-1].isdigit(), key
        assert release.get("repositoryOpts", {}).get("repo") == spec.get("repo"), key
    # CRDs from their own charts, the controllers skip them.
    assert rendered["envoy-gateway"]["skipCrds"] is True and rendered["karpenter"]["skipCrds"] is True
    assert rendered["gateway-crds"]["values"]["crds"]["gatewayAPI"] == {"enabled": True, "channel": "standard"}
    monitoring = rendered[cfg.serving.monitoring_release_label]
    assert monitoring["namespace"] == cfg.serving.monitoring_namespace
    namespaces = {r.inputs["metadata"]["name"] for r in run.of_type("kubernetes:core/v1:Namespace")}
    assert {cfg.serving.monitoring_namespace, "envoy-gateway-system", "cert-manager", "external-dns"} <= namespaces


def test_gateway_class_is_the_installed_controllers(stack):
    run, cfg = stack
    (gateway_class,) = run.of_type("kubernetes:gateway.networking.k8s.io/v1:GatewayClass")
    (gateway,) = run.of_type("kubernetes:gateway.networking.k8s.io/v1:Gateway")
    assert gateway.inputs["spec"]["gatewayClassName"] == gateway_class.inputs["metadata"]["name"] == \
        cfg.serving.gateway_class_name
    assert gateway_class.inputs["spec"]["controllerName"] == "gateway.envoyproxy.io/gatewayclass-controller"
    assert gateway_class.urn in gateway.dependencies
    assert gateway.inputs["spec"]["infrastructure"]["annotations"][
        "service.beta.kubernetes.io/aws-load-balancer-internal"] == "true"


def test_node_pools_mirror_the_gpu_node_groups(stack):
    run, cfg = stack
    pools = {r.inputs["metadata"]["name"]: r.inputs["spec"] for r in run.of_type("kubernetes:karpenter.sh/v1:NodePool")}
    classes = {r.inputs["metadata"]["name"]: r.inputs["spec"]
               for r in run.of_type("kubernetes:karpenter.k8s.aws/v1:EC2NodeClass")}
    groups = {r.inputs["labels"]["llm-serving/gpu-node-group"]: r.inputs
              for r in run.of_type("aws:eks/nodeGroup:NodeGroup") if "llm-serving/gpu-node-group" in r.inputs["labels"]}
    for group in cfg.cluster.gpu_node_groups:
        pool, node_class = pools[f"gpu-{group.name}"], classes[f"gpu-{group.name}"]
        assert pool["template"]["metadata"]["labels"] == groups[group.name]["labels"]
        types = next(r["values"] for r in pool["template"]["spec"]["requirements"]
                     if r["key"] == "node.kubernetes.io/instance-type")
        assert types == group.instance_types == groups[group.name]["instanceTypes"]
        assert pool["template"]["spec"]["taints"] == [{"key": "nvidia.com/gpu", "value": "true",
                                                      "effect": "NoSchedule"}]
        # Node group + NodePool never exceed the group's maxSize.
        total = group.scaling.desired_size * group.gpus_per_node + int(pool["limits"]["nvidia.com/gpu"])
        assert total == group.scaling.max_size * group.gpus_per_node
        assert pool["disruption"]["consolidationPolicy"] == "WhenEmpty"
        assert node_class["metadataOptions"]["httpTokens"] == "required"
        assert node_class["metadataOptions"]["httpPutResponseHopLimit"] == 1
        data = node_class["blockDeviceMappings"][-1]
        assert data["ebs"]["volumeSize"] == f"{group.disk_size_gib}Gi" and data["ebs"]["encrypted"] is True
        if group.ami_type.startswith("BOTTLEROCKET"):
            assert data["deviceName"] == "/dev/xvdb"
    associations = {r.inputs["serviceAccount"]: r.inputs for r in
                    run.of_type("aws:eks/podIdentityAssociation:PodIdentityAssociation")}
    assert associations["karpenter"]["namespace"] == "kube-system"
    assert {"karpenter", "cert-manager", "external-dns"} <= set(associations)


def test_certificate_and_dns_cover_every_route_hostname(stack):
    run, cfg = stack
    (certificate,) = run.of_type("kubernetes:cert-manager.io/v1:Certificate")
    names = certificate.inputs["spec"]["dnsNames"]
    assert certificate.inputs["spec"]["secretName"] == "llm-serving-tls"
    (gateway,) = run.of_type("kubernetes:gateway.networking.k8s.io/v1:Gateway")
    assert {listener["hostname"] for listener in gateway.inputs["spec"]["listeners"]} <= set(names)
    routes = [r for kind in ("HTTPRoute", "GRPCRoute")
              for r in run.of_type(f"kubernetes:gateway.networking.k8s.io/v1:{kind}")]
    hosts = [h for r in routes for h in r.inputs["spec"]["hostnames"]]
    assert hosts
    for host in hosts:
        assert any(host.endswith(n[1:]) and "." not in host[: -len(n[1:])] for n in names), host
    (dns,) = [r for r in run.of_type(RELEASE) if r.inputs["name"] == "external-dns"]
    assert dns.inputs["values"]["domainFilters"] == [cfg.serving.domain]
    assert set(dns.inputs["values"]["sources"]) == {"gateway-httproute", "gateway-grpcroute"}
    (zone,) = run.of_type("aws:route53/zone:Zone")
    assert zone.inputs["name"] == cfg.serving.domain


# -- the policies on the synthetic stack -----------------------------------------------------------------------------


@pytest.fixture
def compat(tmp_path):
    return write_compat(tmp_path)


def _one(stack, compat, policy, text):
    findings = stack.evaluate(compat)
    assert fired(findings) == {policy}, [(f.policy, f.message) for f in findings]
    assert any(text in m for m in messages(findings, policy)), messages(findings, policy)


def test_route_created_before_its_crds(compat):
    stack = compliant_stack()
    route = stack.get("llama-v1-route")
    route.dependencies.remove(stack.get("gateway-crds").urn)
    _one(stack, compat, "crds-before-custom-resources", "does not depend on 'gateway-crds'")


def test_nothing_installs_the_crds(compat):
    stack = compliant_stack()
    stack.remove("gateway-crds")
    _one(stack, compat, "crds-before-custom-resources", "nothing in this stack installs the CRDs of "
                                                        "gateway.networking.k8s.io")
    stack = compliant_stack()
    stack.add("kubernetes:example.com/v1:Widget", "widget", {"apiVersion": "example.com/v1", "kind": "Widget",
                                                             "metadata": {"name": "w"}})
    _one(stack, compat, "crds-before-custom-resources", "no matches for kind Widget")


def test_gpu_pool_without_autoscaler(compat):
    stack = compliant_stack()
    stack.remove("gpu-pool")
    _one(stack, compat, "gpu-capacity-autoscaled", "has no node autoscaler")
    stack.add("kubernetes:helm.sh/v3:Release", "cluster-autoscaler", {
        "chart": "cluster-autoscaler", "version": "9.50.1", "name": "cluster-autoscaler"})
    assert "gpu-capacity-autoscaled" not in fired(stack.evaluate(compat))


def test_node_pool_types_are_approved(compat):
    stack = compliant_stack("dev-us-east-1")
    inputs_of(stack, "gpu-pool")["spec"]["template"]["spec"]["requirements"][0]["values"] = ["g6e.12xlarge",
                                                                                          "p5.48xlarge"]
    _one(stack, compat, "gpu-capacity-autoscaled", "instance types ['p5.48xlarge'] not approved for dev")


def test_peak_beyond_the_pools_reach(compat):
    stack = compliant_stack()
    stack.models()[0]["autoscaling"] = {"maxReplicas": 40}
    _one(stack, compat, "gpu-capacity-autoscaled", "need 41 GPUs at their peak")


def test_gateway_closes_idle_connections_before_the_pod_and_the_nlb_do(stack):
    """Envoy's idle timeouts match the pod's keep-alive (the Deployment's env) and the NLB's."""
    from llm_serving import pod_contract as pc

    run, _ = stack
    (gateway,) = run.of_type("kubernetes:gateway.networking.k8s.io/v1:Gateway")
    (backend,) = run.of_type("kubernetes:gateway.envoyproxy.io/v1alpha1:BackendTrafficPolicy")
    (client,) = run.of_type("kubernetes:gateway.envoyproxy.io/v1alpha1:ClientTrafficPolicy")
    for policy in (backend, client):
        assert policy.inputs["spec"]["targetRefs"] == [{"group": "gateway.networking.k8s.io", "kind": "Gateway",
                                                        "name": gateway.inputs["metadata"]["name"]}]
        assert gateway.urn in policy.dependencies
    upstream = backend.inputs["spec"]["timeout"]["http"]["connectionIdleTimeout"]
    downstream = client.inputs["spec"]["timeout"]["http"]["idleTimeout"]
    deployments = run.of_type("kubernetes:apps/v1:Deployment")
    keepalives = {e["value"] for d in deployments for c in d.inputs["spec"]["template"]["spec"]["containers"]
                  for e in c.get("env", []) if e["name"] == pc.ENV_HTTP_KEEPALIVE}
    assert deployments and keepalives == {str(pc.HTTP_KEEPALIVE_S)}
    assert int(upstream.removesuffix("s")) < pc.HTTP_KEEPALIVE_S
    assert int(downstream.removesuffix("s")) < pc.NLB_TCP_IDLE_TIMEOUT_S



def test_gateway_retries_a_failed_attempt_on_another_pod_never_a_client_error(stack):
    """The Gateway-wide BackendTrafficPolicy retries a refused or reset connection and the server-side
    statuses (a candidate that serves errors, a pod not ready or draining), never a 4xx, a bounded number of times;
    the values are the pod contract's, which the rehearsal's proxy realises from this same object."""
    from llm_serving import pod_contract as pc

    run, _ = stack
    (backend,) = run.of_type("kubernetes:gateway.envoyproxy.io/v1alpha1:BackendTrafficPolicy")
    retry = backend.inputs["spec"]["retry"]
    assert retry["numRetries"] == pc.GATEWAY_RETRIES
    assert set(retry["retryOn"]["triggers"]) == {"connect-failure", "reset", "retriable-status-codes"}
    codes = retry["retryOn"]["httpStatusCodes"]
    assert codes == list(pc.GATEWAY_RETRY_STATUS_CODES) and 503 in codes
    assert all(500 <= code < 600 for code in codes)
    assert 1 <= retry["numRetries"] <= 3  # bounded: a retry storm would take the capacity the rollout needs

# -- routes wait for their controller ---------------------------------------------------------


def test_routes_and_gateway_wait_for_the_controller(stack):
    import json

    run, _ = stack
    routes = [r for kind in ("HTTPRoute", "GRPCRoute")
              for r in run.of_type(f"kubernetes:gateway.networking.k8s.io/v1:{kind}")]
    assert routes
    for route in routes:
        waits = json.loads(route.inputs["metadata"]["annotations"]["pulumi.com/waitFor"])
        assert any('"Accepted"' in w and ".status.parents" in w for w in waits)
        assert any('"ResolvedRefs"' in w for w in waits)
    (gateway,) = run.of_type("kubernetes:gateway.networking.k8s.io/v1:Gateway")
    assert gateway.inputs["metadata"]["annotations"]["pulumi.com/waitFor"] == "condition=Programmed"


@pytest.mark.parametrize("waits", [None, '["condition=Ready"]',
                                   'jsonpath={.status.parents[0].conditions[?(@.type=="Accepted")].status}=True'])
def test_route_without_controller_wait(waits, compat):
    stack = compliant_stack()
    meta = inputs_of(stack, "llama-v1-route")["metadata"]
    if waits is None:
        del meta["annotations"]
    else:
        meta["annotations"]["pulumi.com/waitFor"] = waits
    _one(stack, compat, "routes-wait-for-controller", "Pulumi does not wait for the gateway controller")
