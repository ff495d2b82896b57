"""Serving Deployment rules: each against the compliant synthetic stack and one broken setting."""

from __future__ import annotations

import pytest

from tests.infra.policy_support import (
    COMPAT_TOML,
    compliant_stack,
    container,
    fired,
    inputs_of,
    messages,
    pod,
    write_compat,
)


@pytest.fixture
def compat(tmp_path):
    return write_compat(tmp_path)


def _check(stack, compat, policy, message):
    findings = stack.evaluate(compat)
    assert fired(findings) == {policy}, [(f.policy, f.message) for f in findings]
    assert any(message in m for m in messages(findings, policy)), messages(findings, policy)


def test_only_model_servers_are_judged(compat):
    """A Deployment without the model-server component label (a gateway, a controller) is not a model server."""
    stack = compliant_stack()
    stack.add("kubernetes:apps/v1:Deployment", "gateway", {
        "metadata": {"name": "gateway", "labels": {"app.kubernetes.io/name": "gateway"}},
        "spec": {"template": {"metadata": {"labels": {"app": "gw"}},
                              "spec": {"containers": [{"name": "gw", "image": "envoy:latest"}]}}}})
    assert stack.evaluate(compat) == []


# -- image ---------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("image", ["repo/llm-serving:latest", "repo/llm-serving@sha256:abc", "repo/llm-serving"])
def test_image_by_digest(image, compat):
    stack = compliant_stack()
    container(stack)["image"] = image
    _check(stack, compat, "serving-image-digest", f"uses image {image!r}: pin it by digest")


def test_init_container_image_by_digest(compat):
    stack = compliant_stack()
    pod(stack)["initContainers"] = [{"name": "warm", "image": "busybox:1.36", "securityContext": {
        "runAsNonRoot": True, "allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]},
        "seccompProfile": {"type": "RuntimeDefault"}}}]
    _check(stack, compat, "serving-image-digest", "container 'warm' uses image 'busybox:1.36'")


def test_build_arg_disagreeing_with_compat(compat):
    stack = compliant_stack()
    inputs_of(stack, "serving-image")["buildArgs"]["TRITON_IMAGE_TAG"] = "25.09-vllm-python-py3"
    _check(stack, compat, "serving-image-pins",
           "states triton release '25.09' (TRITON_IMAGE_TAG=25.09-vllm-python-py3) but compat.toml pins '25.10'")


@pytest.mark.parametrize(
    ("name", "value", "kind"),
    [("VLLM_VERSION", "0.9.2", "vllm version"), ("VLLM_BACKEND_BRANCH", "r25.09", "vllm backend branch"),
     ("BASE_IMAGE", "nvcr.io/nvidia/tritonserver:24.12-vllm-python-py3", "triton release")],
)
def test_deployment_env_disagreeing_with_compat(name, value, kind, compat):
    stack = compliant_stack()
    container(stack)["env"].append({"name": name, "value": value})
    _check(stack, compat, "serving-image-pins", f"Deployment 'llama-v1' states {kind}")


def test_release_named_in_the_image_tag(compat):
    stack = compliant_stack()
    inputs_of(stack, "serving-image")["tags"] = ["123456789012.dkr.ecr.us-east-1.amazonaws.com/llm-serving:"
                                                 "triton-25.09-vllm-python-py3-8bf56e43"]
    _check(stack, compat, "serving-image-pins", "states triton release '25.09' (tags[0]=")


def test_pins_follow_compat_file(tmp_path):
    """The same stack fails once compat.toml moves to another release: the policy reads the file, not a copy."""
    stack = compliant_stack()
    assert stack.evaluate(write_compat(tmp_path)) == []
    moved = write_compat(tmp_path, COMPAT_TOML.replace("25.10", "25.11"))
    assert fired(stack.evaluate(moved)) == {"serving-image-pins"}


def test_image_not_traceable_to_compat(compat):
    stack = compliant_stack()
    stack.get("llama-v1").dependencies.remove(stack.get("serving-image").urn)
    _check(stack, compat, "serving-image-pins", "whose Triton release cannot be traced to compat.toml")


def test_missing_compat_file_is_reported_as_not_applicable(tmp_path):
    """Before the serving image's issue creates compat.toml there is nothing to compare; the report says so."""
    stack = compliant_stack()
    (finding,) = stack.evaluate(tmp_path / "absent.toml")
    assert (finding.policy, finding.enforcement, finding.blocking) == ("serving-image-pins", "not applicable", False)
    assert "absent.toml does not exist yet, so no pin can be compared" in finding.message


def test_unreadable_compat_file_fails_the_check(tmp_path):
    stack = compliant_stack()
    findings = stack.evaluate(write_compat(tmp_path, "[triton\n"))
    assert fired(findings) == {"serving-image-pins"} and findings[0].blocking
    assert "not valid TOML" in findings[0].message


def test_compat_file_without_a_pin_names_the_key(tmp_path):
    stack = compliant_stack()
    text = "\n".join(line for line in COMPAT_TOML.splitlines() if not line.startswith("vllm_backend_branch"))
    findings = stack.evaluate(write_compat(tmp_path, text))
    assert "compat.toml: triton.vllm_backend_branch is missing" in findings[0].message


# -- GPUs ----------------------------------------------------------------------------------------------------------


def test_gpu_limit_required(compat):
    stack = compliant_stack()
    container(stack)["resources"] = {"limits": {"cpu": "8"}}
    _check(stack, compat, "serving-gpu-resources", "has no container with a nvidia.com/gpu limit")


def test_gpu_request_must_equal_limit(compat):
    stack = compliant_stack()
    container(stack)["resources"]["requests"]["nvidia.com/gpu"] = "2"
    _check(stack, compat, "serving-gpu-resources", "GPU request 2 differs from its limit 1")


def test_gpu_limit_matches_configured_count(compat):
    stack = compliant_stack()
    container(stack)["resources"] = {"limits": {"nvidia.com/gpu": "2"}}
    _check(stack, compat, "serving-gpu-resources", "GPU limit 2 differs from the model's configured gpu.count 1")


def test_gpu_toleration_required(compat):
    stack = compliant_stack()
    pod(stack)["tolerations"] = []
    _check(stack, compat, "serving-gpu-resources", "does not tolerate the nvidia.com/gpu:NoSchedule taint")


# -- probes and timeouts -------------------------------------------------------------------------------------------


@pytest.mark.parametrize("probe", ["startupProbe", "readinessProbe", "livenessProbe"])
def test_each_probe_required(probe, compat):
    stack = compliant_stack()
    del container(stack)[probe]
    _check(stack, compat, "serving-probes", f"has no {probe}")


@pytest.mark.parametrize(("probe", "path", "shown"), [
    ("readinessProbe", "/v2/health/live", "the readinessProbe asks '/v2/health/live', not a readiness endpoint"),
    ("readinessProbe", "/", "the readinessProbe asks '/', not a readiness endpoint"),
    ("livenessProbe", "/v2/health/ready", "the livenessProbe asks the readiness endpoint '/v2/health/ready'"),
    ("livenessProbe", "/v2/models/llama/ready", "the livenessProbe asks the readiness endpoint"),
])
def test_probe_endpoints(probe, path, shown, compat):
    stack = compliant_stack()
    container(stack)[probe]["httpGet"]["path"] = path
    _check(stack, compat, "serving-probes", shown)


@pytest.mark.parametrize("path", ["/health/ready", "/v2/models/llama/ready", "/v2/models/llama/versions/1/ready"])
def test_other_ready_endpoints_are_fine(path, compat):
    stack = compliant_stack()
    container(stack)["readinessProbe"]["httpGet"]["path"] = path
    assert stack.evaluate(compat) == []


def test_startup_budget_below_configured_load_time(compat):
    stack = compliant_stack()
    stack.models()[0]["loadTimeSeconds"] = 1800
    stack.get("llama-v1").custom_timeouts.update({"create": "1h", "update": "1h"})
    _check(stack, compat, "serving-probes", "gives up after 1000s (initialDelaySeconds + failureThreshold x "
                                            "periodSeconds) but model 'llama' is configured to load in up to 1800s")


def test_startup_budget_uses_kubernetes_defaults(compat):
    stack = compliant_stack()
    container(stack)["startupProbe"] = {"httpGet": {"path": "/v2/health/ready", "port": 8000.0}}
    _check(stack, compat, "serving-probes", "gives up after 30s")


def test_undeclared_model(compat):
    stack = compliant_stack()
    stack.models()[0]["id"] = "other"
    findings = stack.evaluate(compat)
    assert any("serves model 'llama', which llm-serving:models does not declare" in m
               for m in messages(findings, "serving-probes"))


@pytest.mark.parametrize(
    ("timeouts", "shown"),
    [(None, "create timeout is unset (the provider's default 600s)"), ({"create": "30m", "update": "10m"},
                                                                       "update timeout is 600s")],
)
def test_pulumi_timeout_covers_startup(timeouts, shown, compat):
    stack = compliant_stack()
    deployment = stack.get("llama-v1")
    deployment.custom_timeouts.clear()
    deployment.custom_timeouts.update(timeouts or {})
    _check(stack, compat, "serving-update-timeout", shown)


# -- model source --------------------------------------------------------------------------------------------------


def test_model_cache_must_be_mounted(compat):
    stack = compliant_stack()
    container(stack)["volumeMounts"] = [m for m in container(stack)["volumeMounts"] if m["name"] != "model-cache"]
    _check(stack, compat, "serving-model-from-fsx", "does not mount the FSx model cache claim into its server")


def test_model_cache_claim_must_be_fsx(compat):
    stack = compliant_stack()
    inputs_of(stack, "model-cache-pv")["spec"]["csi"]["driver"] = "ebs.csi.aws.com"
    _check(stack, compat, "serving-model-from-fsx", "uses driver 'ebs.csi.aws.com', not fsx.csi.aws.com")


def test_model_cache_via_fsx_storage_class(compat):
    stack = compliant_stack()
    claim = inputs_of(stack, "model-cache")["spec"]
    del claim["volumeName"]
    claim["storageClassName"] = "fsx"
    stack.add("kubernetes:storage.k8s.io/v1:StorageClass", "fsx-sc",
              {"metadata": {"name": "fsx"}, "provisioner": "fsx.csi.aws.com"})
    assert stack.evaluate(compat) == []


def test_model_cache_read_only(compat):
    stack = compliant_stack()
    pod(stack)["volumes"][0]["persistentVolumeClaim"]["readOnly"] = False
    container(stack)["volumeMounts"][0]["readOnly"] = False
    _check(stack, compat, "serving-model-from-fsx", "the model cache volume 'model-cache' is mounted read-write")


@pytest.mark.parametrize(
    ("where", "value", "marker"),
    [("args", "s3://models-prod/llama/v1.tar.gz", "s3://"),
     ("args", "meta-llama/Llama-3.1-8B@https://huggingface.co", "huggingface.co"),
     ("command", "aws s3 sync s3://b/m /models", "s3://")],
)
def test_no_download_at_start(where, value, marker, compat):
    stack = compliant_stack()
    container(stack)[where] = [value]
    _check(stack, compat, "serving-no-download-at-start", f"refers to {marker!r}")


def test_no_hub_token_and_offline_hub(compat):
    stack = compliant_stack()
    container(stack)["env"] = [{"name": "HF_TOKEN", "value": "x"}, {"name": "HF_HUB_OFFLINE", "value": "0"}]
    findings = stack.evaluate(compat)
    shown = messages(findings, "serving-no-download-at-start")
    assert any("sets HF_TOKEN" in m for m in shown) and any("HF_HUB_OFFLINE='0'" in m for m in shown)


# -- identity ------------------------------------------------------------------------------------------------------


def test_non_root_required(compat):
    stack = compliant_stack()
    del pod(stack)["securityContext"]["runAsNonRoot"]
    del container(stack)["securityContext"]["runAsNonRoot"]
    _check(stack, compat, "serving-non-root", "does not set securityContext.runAsNonRoot: true")


def test_container_overrides_pod(compat):
    stack = compliant_stack()
    container(stack)["securityContext"]["runAsNonRoot"] = False
    _check(stack, compat, "serving-non-root", "does not set securityContext.runAsNonRoot: true")


def test_root_uid_and_privileged(compat):
    stack = compliant_stack()
    container(stack)["securityContext"].update({"runAsUser": 0.0, "privileged": True})
    findings = stack.evaluate(compat)
    shown = messages(findings, "serving-non-root")
    assert any("runs as user 0 (root)" in m for m in shown) and any("is privileged" in m for m in shown)


# -- advisory ------------------------------------------------------------------------------------------------------


def test_hardening_advice(compat):
    stack = compliant_stack()
    container(stack)["securityContext"] = {"runAsNonRoot": True}
    _check(stack, compat, "serving-hardening", "could also set allowPrivilegeEscalation: false, capabilities.drop: "
                                               "[ALL], seccompProfile: RuntimeDefault")
    assert all(f.enforcement == "advisory" for f in stack.evaluate(compat))


def test_zone_spread_advice(compat):
    stack = compliant_stack()
    pod(stack)["topologySpreadConstraints"] = []
    _check(stack, compat, "serving-zone-spread", "does not spread its replicas across zones")


def test_drain_grace_advice(compat):
    stack = compliant_stack()
    del pod(stack)["terminationGracePeriodSeconds"]
    _check(stack, compat, "serving-drain-grace", "terminationGracePeriodSeconds is 30s")


def test_disruption_budget_advice(compat):
    stack = compliant_stack()
    stack.remove("llama-v1-pdb")
    _check(stack, compat, "serving-disruption-budget", "has no PodDisruptionBudget")


# -- the pod contract -----------------------------------------------------------------------------------


def test_the_deployment_must_set_what_the_startup_reads(compat):
    stack = compliant_stack()
    container(stack)["env"] = [e for e in container(stack)["env"] if e["name"] != "LLM_SERVING_PACKAGE"]
    _check(stack, compat, "serving-pod-contract",
           "does not set LLM_SERVING_PACKAGE: the image's startup procedure reads them")


@pytest.mark.parametrize("package", ["/mnt/model-cache/models/llama/v1.tar.gz", "/models/llama/v1"])
def test_the_package_is_a_directory_below_the_model_cache(package, compat):
    stack = compliant_stack()
    next(e for e in container(stack)["env"] if e["name"] == "LLM_SERVING_PACKAGE")["value"] = package
    _check(stack, compat, "serving-pod-contract", f"LLM_SERVING_PACKAGE={package!r} is not a package directory")


def test_the_metrics_directory_is_the_images(compat):
    stack = compliant_stack()
    next(e for e in container(stack)["env"] if e["name"] == "PROMETHEUS_MULTIPROC_DIR")["value"] = \
        "/var/run/llm-serving/metrics"
    _check(stack, compat, "serving-pod-contract", "but the image and its metrics proxy use")


def test_what_the_pod_writes_needs_a_writable_volume_under_a_read_only_root(compat):
    stack = compliant_stack()
    container(stack)["securityContext"]["readOnlyRootFilesystem"] = True
    _check(stack, compat, "serving-pod-contract",
           "/var/run/llm-serving/prometheus is written at start but lies on the read-only root file system")
    pod(stack)["volumes"].append({"name": "run", "emptyDir": {}})
    container(stack)["volumeMounts"].append({"name": "run", "mountPath": "/var/run/llm-serving"})
    assert stack.evaluate(compat) == []


# -- only the gateway reaches a model ------------------------------------------------------------------------------


def test_a_model_server_without_a_network_policy_is_refused(compat):
    from tests.infra.policy_support import compliant_stack

    stack = compliant_stack()
    stack.remove("llama-v1-netpol")
    findings = [f for f in stack.evaluate(compat) if f.policy == "serving-network-policy-gateway-only"]
    assert findings and "no NetworkPolicy selects its pods" in findings[0].message


@pytest.mark.parametrize(("edit", "message"), [
    (lambda rule: rule.pop("from"), "admits the serving ports of 'llama-v1' from anywhere"),
    (lambda rule: rule.update({"from": [{"namespaceSelector": {}}]}), "from peers other than the gateway"),
    (lambda rule: [rule.pop("ports"), rule.pop("from")], "admits the serving ports of 'llama-v1' from anywhere"),
])
def test_an_open_network_policy_is_refused(compat, edit, message):
    from tests.infra.policy_support import compliant_stack, inputs_of

    stack = compliant_stack()
    netpol = inputs_of(stack, "llama-v1-netpol")
    edit(netpol["spec"]["ingress"][0])
    findings = [f.message for f in stack.evaluate(compat) if f.policy == "serving-network-policy-gateway-only"]
    assert any(message in m for m in findings), findings


def test_metrics_from_outside_monitoring_is_refused(compat):
    from tests.infra.policy_support import compliant_stack, inputs_of

    stack = compliant_stack()
    inputs_of(stack, "llama-v1-netpol")["spec"]["ingress"][1].pop("from")
    findings = [f.message for f in stack.evaluate(compat) if f.policy == "serving-network-policy-gateway-only"]
    assert any("admits the metrics port of 'llama-v1' from anywhere; only 'monitoring' scrapes it" in m
               for m in findings), findings
