"""The pack as a whole: its catalog, the PolicyPack wiring, the offline runner and its report, and the platform and
cost rules. Synthetic resources are shaped as `infra.mockrun` records them."""

from __future__ import annotations

import json
import runpy

import pulumi_policy
import pytest
import yaml
from pulumi_policy import EnforcementLevel, ResourceValidationPolicy, StackValidationPolicy
from rich.console import Console

from infra.mockrun import MockedResource, StackRun
from llm_serving.repository import REPO_ROOT
from policies import offline
from policies.catalog import ALL_POLICIES, by_name
from tests.infra.policy_support import compliant_stack, fired, inputs_of, messages, write_compat

ISSUE_MANDATORY = {
    "s3-bucket-encryption", "s3-bucket-versioning", "s3-public-access-block", "s3-tls-only",
    "fsx-persistent-2-in-prod", "fsx-encryption", "fsx-lustre-ports-only",
    "gpu-nodes-nvidia-ami", "gpu-nodes-taint", "gpu-nodes-approved-instance-types", "gpu-nodes-size-cap",
    "iam-no-wildcard-s3-ecr-kms",
    "serving-image-digest", "serving-image-pins", "serving-gpu-resources", "serving-probes",
    "serving-model-from-fsx", "serving-no-download-at-start", "serving-non-root",
    "rollout-versioned-only-on-io-change", "rollout-weight-only-to-replicas", "rollout-newest-version-kept",
}
# Beyond the issue's list: what a reviewer of this platform would also block.
EXTRA_MANDATORY = {"iam-irsa-trust-scoped", "serving-update-timeout", "rollout-gpu-surge-bound",
                   "eks-private-endpoint-in-prod", "s3-replication-kms-objects",
                   # The first real `pulumi up`: pods fit nodes, FSx may decrypt, nodes and add-ons.
                   "model-pod-fits-nodes", "fsx-s3-key-access", "nodes-bottlerocket-data-volume",
                   "eks-network-policy-and-pod-identity", "nodes-imdsv2-and-encrypted-disks",
                   "crds-before-custom-resources", "gpu-capacity-autoscaled", "routes-wait-for-controller",
                   "ecr-one-build-replicated", "serving-pod-contract",
                   # Every model kind: models without GPUs on CPU node groups.
                   "serving-cpu-model-no-gpu", "cpu-nodes-no-gpu-approved-types",
                   # The first production deploy: the engine uses the GPUs its pod holds.
                   "serving-engine-uses-pod-gpus",
                   # Python-backend models' dependencies are in the image.
                   "serving-python-dependencies-in-image",
                   # The caller's side: experiments allocate 100% to versions that are served.
                   "experiments-arms-served",
                   # The batch path: client data stays in its region, each worker in its model's prefix.
                   "batch-store-isolated",
                   # Fail-safe defaults: every engine a package starts has its share of the GPUs' memory.
                   "serving-engine-memory-budgeted", "serving-network-policy-gateway-only",
                   # Caller authentication: at the Gateway, and again at the pod on every serving port.
                   "gateway-api-keys-required", "serving-api-keys-required", "serving-kserve-ports-authenticated",
                   "batch-worker-key-required"}


@pytest.fixture
def compat(tmp_path):
    return write_compat(tmp_path)


# -- catalog and pack ----------------------------------------------------------------------------------------------


def test_catalog():
    names = [p.name for p in ALL_POLICIES]
    assert len(names) == len(set(names))
    assert all(isinstance(p, ResourceValidationPolicy | StackValidationPolicy) for p in ALL_POLICIES)
    assert all(p.enforcement_level in (EnforcementLevel.MANDATORY, EnforcementLevel.ADVISORY) for p in ALL_POLICIES)
    mandatory = {p.name for p in ALL_POLICIES if p.enforcement_level == EnforcementLevel.MANDATORY}
    assert mandatory == ISSUE_MANDATORY | EXTRA_MANDATORY
    assert by_name("cost-allocation-tags").enforcement_level == EnforcementLevel.ADVISORY
    with pytest.raises(KeyError, match="no policy named 'nope'"):
        by_name("nope")


def test_pack_main_builds_the_pack_from_the_catalog(monkeypatch):
    """Run policies/__main__.py with PolicyPack replaced by a recorder: the real constructor starts the analyzer's
    gRPC server and blocks, which is the CLI's business, not a test's."""
    built = {}

    class RecordingPack:
        def __init__(self, name, enforcement_level=None, policies=None, **kwargs):
            built.update(name=name, level=enforcement_level, policies=policies)

    monkeypatch.setattr(pulumi_policy, "PolicyPack", RecordingPack)
    runpy.run_path(str(REPO_ROOT / "policies" / "__main__.py"), run_name="__main__")
    assert built["name"] == "llm-serving"
    assert built["policies"] == ALL_POLICIES


def test_policy_yaml():
    doc = yaml.safe_load((REPO_ROOT / "policies" / "PulumiPolicy.yaml").read_text())
    assert doc["runtime"]["name"] == "python"
    assert (REPO_ROOT / "policies" / doc["runtime"]["options"]["virtualenv"]).resolve() == REPO_ROOT / ".venv-infra"


@pytest.mark.parametrize("stack_name", ["dev-us-east-1", "prod-us-east-1", "prod-eu-west-1"])
def test_compliant_stack_passes_every_policy(stack_name, compat):
    assert compliant_stack(stack_name).evaluate(compat) == []


# -- the runner ----------------------------------------------------------------------------------------------------


def test_conversion_links_parents_dependencies_providers_and_timeouts():
    provider_urn = "urn:pulumi:s::p::pulumi:providers:aws::aws-east"
    resources = [
        MockedResource("pulumi:providers:aws", "aws-east", provider_urn,
                       {"region": "us-east-1", "defaultTags": '{"tags": {"team": "t"}}'}, None, [], None, None),
        MockedResource("my:component:Thing", "thing", "urn:c", {}, None, [], None, None),
        MockedResource("aws:s3/bucket:Bucket", "b", "urn:b", {"bucket": "b"}, "urn:c", [], None,
                       f"{provider_urn}::provider-id"),
        MockedResource("kubernetes:apps/v1:Deployment", "d", "urn:d", {}, "urn:c", ["urn:b", "urn:elsewhere"],
                       {"create": "1h30m", "update": "45m"}, None),
    ]
    provider, component, bucket, deployment = offline.to_policy_resources(resources)
    assert bucket.parent is component and deployment.dependencies == [bucket]
    assert bucket.provider.props["defaultTags"] == {"tags": {"team": "t"}}
    timeouts = deployment.opts.custom_timeouts
    assert (timeouts.create_seconds, timeouts.update_seconds, timeouts.delete_seconds) == (5400, 2700, 0)


def test_property_dependencies_are_used_when_recorded(compat):
    """A rule depending on two groups is attributed by its securityGroupId's own dependency."""
    stack = compliant_stack()
    rule = stack.add("aws:vpc/securityGroupIngressRule:SecurityGroupIngressRule", "nodes-from-fsx", {
        "securityGroupId": "sg-nodes", "ipProtocol": "tcp", "fromPort": 0.0, "toPort": 65535.0,
        "referencedSecurityGroupId": "sg-fsx"}, depends_on=["nodes-sg", "fsx-sg"])
    # Without property dependencies the runner cannot tell target from source: it errs on the strict side.
    assert "fsx-lustre-ports-only" in fired(stack.evaluate(compat))
    rule.property_dependencies.update({"securityGroupId": [stack.get("nodes-sg").urn],
                                       "referencedSecurityGroupId": [stack.get("fsx-sg").urn]})
    assert stack.evaluate(compat) == []


def test_a_crashing_rule_is_a_blocking_finding(compat):
    def explode(args, report):
        raise RuntimeError("boom")

    broken = ResourceValidationPolicy(name="broken", description="raises", validate=explode,
                                      enforcement_level=EnforcementLevel.ADVISORY)
    stack = compliant_stack()
    findings = stack.evaluate(compat, policies=[broken])
    assert findings and all(f.enforcement == "error" and f.blocking for f in findings)
    assert findings[0].message == "the rule raised RuntimeError: boom"


def test_rules_see_the_analyzers_proxies_and_unknowns_fail_loudly(compat):
    """Props reach the rules wrapped in pulumi_policy's unknown-checking proxies, as under `pulumi preview`: a value
    that is unknown cannot be checked, and the runner says so instead of passing the rule."""
    from pulumi_policy.proxy import UNKNOWN_STRING_VALUE

    stack = compliant_stack()
    seen = []
    probe = ResourceValidationPolicy(name="probe", description="records props", enforcement_level=EnforcementLevel.
                                     ADVISORY, validate=lambda args, report: seen.append(type(args.props).__name__))
    stack.evaluate(compat, policies=[probe])
    assert set(seen) == {"_DictProxy"}
    inputs_of(stack, "llama-v1")["spec"]["template"]["spec"]["containers"][0]["image"] = UNKNOWN_STRING_VALUE
    errors = [f for f in stack.evaluate(compat) if f.enforcement == "error"]
    assert errors and errors[0].resource == "llama-v1"
    assert "can't be known during preview" in errors[0].message


def test_not_applicable_is_shown_and_never_blocks(compat):
    skip = StackValidationPolicy(name="skip", description="n/a", enforcement_level=EnforcementLevel.MANDATORY,
                                 validate=lambda a, r: a.not_applicable("nothing to check here"))
    (finding,) = compliant_stack().evaluate(compat, policies=[skip])
    assert (finding.enforcement, finding.blocking, finding.message) == ("not applicable", False,
                                                                        "nothing to check here")
    console = Console(record=True, width=160)
    offline.render([finding], "s", 1, console=console)
    assert "0 blocking, 0 advisory, 1 not applicable" in console.export_text()


def test_report_is_a_readable_table(compat):
    stack = compliant_stack()
    stack.remove("models-pab")
    inputs_of(stack, "gpu")["tags"] = {}
    findings = stack.evaluate(compat)
    console = Console(record=True, width=160)
    offline.render(findings, stack.stack, len(stack.resources), console=console)
    text = console.export_text()
    for header in ("policy", "enforcement", "resource", "message"):
        assert header in text
    assert "1 blocking, 1 advisory" in text
    assert "s3-public-access-block" in text and "mandatory" in text and "has no aws.s3.BucketPublicAccessBlock" in text
    # Blocking findings first.
    assert text.index("s3-public-access-block") < text.index("cost-allocation-tags")


def _fake_runs(monkeypatch, stacks):
    import infra.mockrun as mockrun

    runs = {s.stack: StackRun(s.stack, s.project, s.config, s.resources, {}) for s in stacks}
    monkeypatch.setattr(mockrun, "shipped_stacks", lambda: sorted(runs))
    monkeypatch.setattr(mockrun, "run_stack", lambda name: runs[name])


def test_main_exit_codes(monkeypatch, compat, tmp_path, capsys):
    good, bad = compliant_stack("dev-us-east-1"), compliant_stack("prod-us-east-1")
    inputs_of(bad, "gpu")["instanceTypes"] = ["g4dn.xlarge"]
    _fake_runs(monkeypatch, [good, bad])
    assert offline.main(["--compat-file", str(compat), "--stack", "dev-us-east-1"]) == 0
    out = tmp_path / "findings.json"
    assert offline.main(["--compat-file", str(compat), "--json", str(out)]) == 1
    printed = capsys.readouterr().out
    assert "2 stack(s): 1 blocking finding(s)" in printed
    (finding,) = json.loads(out.read_text())
    assert finding["policy"] == "gpu-nodes-approved-instance-types" and finding["stack"] == "prod-us-east-1"
    assert "g4dn.xlarge not approved for prod" in finding["message"]


def test_main_fails_when_a_stack_does_not_run(monkeypatch, compat, capsys):
    import infra.mockrun as mockrun

    def fail(name):
        raise mockrun.StackRunError(f"stack {name}: program error")

    monkeypatch.setattr(mockrun, "run_stack", fail)
    assert offline.main(["--compat-file", str(compat), "--stack", "dev-us-east-1"]) == 1
    assert "the mock run failed: stack dev-us-east-1: program error" in capsys.readouterr().err


# -- platform and cost rules ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("vpc", "shown"),
    [({"endpointPrivateAccess": True, "endpointPublicAccess": True}, "has a public API endpoint"),
     ({"endpointPrivateAccess": True}, "unset, which means true"),
     ({"endpointPublicAccess": False}, "lacks vpcConfig.endpointPrivateAccess: true")],
)
def test_prod_cluster_endpoint_private(vpc, shown, compat):
    stack = compliant_stack("prod-us-east-1")
    inputs_of(stack, "cluster")["vpcConfig"] = vpc
    findings = stack.evaluate(compat)
    assert fired(findings) == {"eks-private-endpoint-in-prod"}
    assert any(shown in m for m in messages(findings, "eks-private-endpoint-in-prod"))


def test_dev_cluster_may_be_public(compat):
    stack = compliant_stack("dev-us-east-1")
    inputs_of(stack, "cluster")["vpcConfig"]["endpointPublicAccess"] = True
    assert stack.evaluate(compat) == []


def test_ecr_advice(compat):
    stack = compliant_stack()
    inputs_of(stack, "serving-repo").update({"imageTagMutability": "MUTABLE", "imageScanningConfiguration": {}})
    findings = stack.evaluate(compat)
    assert fired(findings) == {"ecr-immutable-and-scanned"} and len(findings) == 2
    assert all(f.enforcement == "advisory" for f in findings)


def test_cost_tags_missing(compat):
    stack = compliant_stack()
    inputs_of(stack, "model-cache-fs")["tags"] = {"team": "ml-platform"}
    findings = stack.evaluate(compat)
    assert messages(findings, "cost-allocation-tags") == [
        "LustreFileSystem 'model-cache-fs' lacks the cost allocation tag(s) env (own tags or the provider's "
        "defaultTags)"]
    assert all(f.enforcement == "advisory" for f in findings)


def test_cost_tags_from_provider_default_tags(compat):
    stack = compliant_stack()
    provider = stack.add("pulumi:providers:aws", "aws", {
        "region": "us-east-1", "defaultTags": '{"tags":{"team":"ml-platform","env":"prod"}}'})
    fs = stack.get("model-cache-fs")
    fs.inputs["tags"] = {}
    stack.resources[stack.resources.index(fs)] = MockedResource(**{**fs.__dict__, "provider": f"{provider.urn}::id"})
    assert stack.evaluate(compat) == []


def test_cost_tag_env_must_match_the_stack(compat):
    stack = compliant_stack("prod-us-east-1")
    inputs_of(stack, "models")["tags"]["env"] = "dev"
    assert messages(stack.evaluate(compat), "cost-allocation-tags") == [
        "Bucket 'models' is tagged env='dev' in a prod stack"]


def test_model_server_cost_labels(compat):
    stack = compliant_stack()
    labels = inputs_of(stack, "llama-v1")["spec"]["template"]["metadata"]["labels"]
    del labels["team"]
    findings = stack.evaluate(compat)
    assert messages(findings, "cost-allocation-tags") == [
        "Deployment 'llama-v1': its pods lack the cost allocation label(s) team, so their GPU-hours cannot be "
        "charged back"]


def test_cluster_hardening_advice(compat):
    stack = compliant_stack()
    cluster = inputs_of(stack, "cluster")
    del cluster["encryptionConfig"]
    cluster["enabledClusterLogTypes"] = ["api"]
    findings = stack.evaluate(compat)
    assert fired(findings) == {"eks-secrets-encryption-and-audit-logs"}
    assert all(f.enforcement == "advisory" for f in findings)
    shown = messages(findings, "eks-secrets-encryption-and-audit-logs")
    assert any("does not envelope-encrypt Kubernetes secrets" in m for m in shown)
    assert any("does not ship control plane logs audit, authenticator" in m for m in shown)


def test_kms_rotation_advice(compat):
    stack = compliant_stack()
    inputs_of(stack, "models-key")["enableKeyRotation"] = False
    assert messages(stack.evaluate(compat), "kms-key-rotation") == ["KMS key 'models-key' does not rotate "
                                                                    "(enableKeyRotation)"]
    inputs_of(stack, "models-key")["customerMasterKeySpec"] = "RSA_2048"  # asymmetric keys cannot rotate
    assert stack.evaluate(compat) == []


def test_readme_lists_every_policy_with_its_enforcement():
    text = (REPO_ROOT / "policies" / "README.md").read_text()
    for policy in ALL_POLICIES:
        assert f"| `{policy.name}` | {policy.enforcement_level.value} |" in text, policy.name
