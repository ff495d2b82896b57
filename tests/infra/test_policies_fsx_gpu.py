"""FSx for Lustre and GPU node group rules: each against the compliant synthetic stack and one broken setting."""

from __future__ import annotations

import pytest

from policies.rules.gpu_nodes import APPROVED_INSTANCE_TYPES, MAX_NODES
from tests.infra.policy_support import compliant_stack, fired, inputs_of, messages, write_compat


@pytest.fixture
def compat(tmp_path):
    return write_compat(tmp_path)


def _check(stack, compat, policy, message, resource):
    findings = stack.evaluate(compat)
    assert fired(findings) == {policy}, [(f.policy, f.message) for f in findings]
    assert any(message in m for m in messages(findings, policy)), messages(findings, policy)
    assert {f.resource for f in findings} == {resource}


# -- FSx -----------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["SCRATCH_2", "PERSISTENT_1"])
def test_prod_needs_persistent_2(kind, compat):
    stack = compliant_stack("prod-us-east-1")
    inputs_of(stack, "model-cache-fs")["deploymentType"] = kind
    _check(stack, compat, "fsx-persistent-2-in-prod", f"is {kind} in prod stack 'prod-us-east-1'", "model-cache-fs")


def test_dev_may_use_scratch_2(compat):
    stack = compliant_stack("dev-us-east-1")
    fs = inputs_of(stack, "model-cache-fs")
    fs["deploymentType"] = "SCRATCH_2"
    del fs["kmsKeyId"]  # scratch file systems take no customer key; SCRATCH_2 is encrypted at rest by FSx
    assert stack.evaluate(compat) == []


def test_unset_deployment_type_is_aws_default_scratch_1(compat):
    stack = compliant_stack("dev-us-east-1")
    del inputs_of(stack, "model-cache-fs")["deploymentType"]
    _check(stack, compat, "fsx-encryption", "SCRATCH_1, which is not encrypted at rest", "model-cache-fs")


def test_persistent_needs_kms_key(compat):
    stack = compliant_stack()
    del inputs_of(stack, "model-cache-fs")["kmsKeyId"]
    _check(stack, compat, "fsx-encryption", "(PERSISTENT_2) has no kmsKeyId", "model-cache-fs")


@pytest.mark.parametrize(
    ("rule", "shown"),
    [
        ({"ipProtocol": "tcp", "fromPort": 22.0, "toPort": 22.0}, "opens TCP 22"),
        ({"ipProtocol": "tcp", "fromPort": 988.0, "toPort": 1023.0}, "opens TCP 988-1023"),
        ({"ipProtocol": "-1"}, "opens all protocols and ports"),
        ({"ipProtocol": "udp", "fromPort": 988.0, "toPort": 988.0}, "opens protocol 'udp'"),
        ({"ipProtocol": "tcp", "fromPort": 988.0, "toPort": 988.0, "cidrIpv4": "0.0.0.0/0"}, "is open to 0.0.0.0/0"),
    ],
)
def test_only_lustre_ports_open(rule, shown, compat):
    stack = compliant_stack()
    stack.add("aws:vpc/securityGroupIngressRule:SecurityGroupIngressRule", "fsx-extra",
              {"securityGroupId": "sg-fsx", **rule}, depends_on=["fsx-sg"])
    _check(stack, compat, "fsx-lustre-ports-only", shown, "fsx-sg")


def test_inline_and_legacy_rules_are_checked(compat):
    stack = compliant_stack()
    inputs_of(stack, "fsx-sg")["ingress"] = [{"protocol": "tcp", "fromPort": 443.0, "toPort": 443.0,
                                              "cidrBlocks": ["10.0.0.0/8"]}]
    stack.add("aws:ec2/securityGroupRule:SecurityGroupRule", "fsx-legacy", {
        "type": "ingress", "securityGroupId": "sg-fsx", "protocol": "tcp", "fromPort": 0.0, "toPort": 65535.0,
        "sourceSecurityGroupId": "sg-nodes"}, depends_on=["fsx-sg", "nodes-sg"])
    findings = stack.evaluate(compat)
    shown = messages(findings, "fsx-lustre-ports-only")
    assert any("'fsx-sg (inline)' opens TCP 443" in m for m in shown)
    assert any("'fsx-legacy' opens TCP 0-65535" in m for m in shown)


def test_rules_of_other_groups_do_not_count(compat):
    """Port 22 on the node group's security group is not the file system's business."""
    stack = compliant_stack()
    stack.add("aws:vpc/securityGroupIngressRule:SecurityGroupIngressRule", "nodes-ssh", {
        "securityGroupId": "sg-nodes", "ipProtocol": "tcp", "fromPort": 22.0, "toPort": 22.0,
        "cidrIpv4": "10.0.0.0/16"}, depends_on=["nodes-sg"])
    assert stack.evaluate(compat) == []


def test_file_system_without_a_stack_security_group(compat):
    stack = compliant_stack()
    stack.get("model-cache-fs").dependencies.remove(stack.get("fsx-sg").urn)
    _check(stack, compat, "fsx-lustre-ports-only", "uses no security group created in this stack", "model-cache-fs")


# -- GPU node groups -----------------------------------------------------------------------------------------------


def test_gpu_node_group_needs_nvidia_ami(compat):
    stack = compliant_stack()
    inputs_of(stack, "gpu")["amiType"] = "AL2_x86_64_GPU"
    _check(stack, compat, "gpu-nodes-nvidia-ami", "has amiType 'AL2_x86_64_GPU'", "gpu")


def test_gpu_detected_by_instance_type_even_with_a_cpu_ami(compat):
    stack = compliant_stack()
    inputs_of(stack, "gpu")["amiType"] = "AL2023_x86_64_STANDARD"
    inputs_of(stack, "gpu")["taints"] = []
    findings = stack.evaluate(compat)
    assert fired(findings) == {"gpu-nodes-nvidia-ami", "gpu-nodes-taint"}


def test_cpu_node_group_is_not_judged_as_gpu(compat):
    stack = compliant_stack()
    stack.add("aws:eks/nodeGroup:NodeGroup", "system", {
        "clusterName": "cluster", "amiType": "AL2023_x86_64_STANDARD", "instanceTypes": ["m7i.xlarge"],
        "scalingConfig": {"minSize": 2.0, "desiredSize": 3.0, "maxSize": 60.0},
        "launchTemplate": {"id": "lt-1", "version": "1"},
        "tags": {"team": "ml-platform", "env": "prod"}}, depends_on=["nodes-lt"])
    assert stack.evaluate(compat) == []


@pytest.mark.parametrize(
    "taints",
    [[], [{"key": "nvidia.com/gpu", "value": "true", "effect": "PREFER_NO_SCHEDULE"}],
     [{"key": "gpu", "value": "true", "effect": "NO_SCHEDULE"}]],
    ids=["none", "prefer-only", "wrong-key"],
)
def test_gpu_taint(taints, compat):
    stack = compliant_stack()
    inputs_of(stack, "gpu")["taints"] = taints
    _check(stack, compat, "gpu-nodes-taint", "lacks the taint nvidia.com/gpu with effect NO_SCHEDULE", "gpu")


def test_instance_type_not_approved_for_dev(compat):
    stack = compliant_stack("dev-us-east-1")
    inputs_of(stack, "gpu")["instanceTypes"] = ["g6e.12xlarge", "p5.48xlarge"]
    assert "p5.48xlarge" not in APPROVED_INSTANCE_TYPES["dev"]
    _check(stack, compat, "gpu-nodes-approved-instance-types", "p5.48xlarge not approved for dev", "gpu")


def test_instance_type_approved_in_prod(compat):
    stack = compliant_stack("prod-us-east-1")
    inputs_of(stack, "gpu")["instanceTypes"] = ["p5.48xlarge"]
    assert stack.evaluate(compat) == []


def test_instance_types_must_be_visible(compat):
    stack = compliant_stack()
    del inputs_of(stack, "gpu")["instanceTypes"]
    _check(stack, compat, "gpu-nodes-approved-instance-types", "does not list instanceTypes", "gpu")


def test_size_cap(compat):
    stack = compliant_stack("dev-us-east-1")
    inputs_of(stack, "gpu")["scalingConfig"]["maxSize"] = float(MAX_NODES["dev"] + 1)
    _check(stack, compat, "gpu-nodes-size-cap", f"exceeds the dev cap of {MAX_NODES['dev']} nodes", "gpu")


def test_inconsistent_scaling(compat):
    stack = compliant_stack()
    inputs_of(stack, "gpu")["scalingConfig"].update({"minSize": 3.0, "desiredSize": 2.0})
    _check(stack, compat, "gpu-nodes-size-cap", "needs minSize <= desiredSize <= maxSize, got 3 / 2 / 4", "gpu")


def test_unknown_environment_is_reported_not_guessed(compat):
    stack = compliant_stack("qa-us-east-1")
    del stack.config["llm-serving:environment"]
    findings = stack.evaluate(compat)
    errors = [f for f in findings if f.enforcement == "error"]
    assert errors and all("cannot tell its environment" in f.message for f in errors)


# -- node metadata service and disks (advisory) --------------------------------------------------------------------


def test_default_launch_template_leaves_imds_to_pods(compat):
    stack = compliant_stack()
    del inputs_of(stack, "gpu")["launchTemplate"]
    findings = stack.evaluate(compat)
    assert fired(findings) == {"nodes-imdsv2-and-encrypted-disks"}
    assert all(f.enforcement == "mandatory" for f in findings)
    assert "uses EKS's default launch template" in findings[0].message


def test_launch_template_metadata_and_disks(compat):
    stack = compliant_stack()
    template = inputs_of(stack, "nodes-lt")
    template["metadataOptions"].update({"httpTokens": "optional", "httpPutResponseHopLimit": 2.0})
    template["blockDeviceMappings"][0]["ebs"]["encrypted"] = "false"
    shown = messages(stack.evaluate(compat), "nodes-imdsv2-and-encrypted-disks")
    assert len(shown) == 3
    assert any("allows IMDSv1 (metadataOptions.httpTokens is 'optional'" in m for m in shown)
    assert any("httpPutResponseHopLimit 2, needs 1" in m for m in shown)
    assert any("volume '/dev/xvda' is not encrypted" in m for m in shown)


# -- FSx's S3-access role and the bucket key ----------------------------------------------------------


def _with_association(stack, statement: dict | None, bucket_keys: bool = True):
    """The compliant stack plus a data repository association over its SSE-KMS bucket and the key's policy."""
    import json

    bucket = "models-prod-us-east-1"
    inputs_of(stack, "models-sse")["rules"][0]["bucketKeyEnabled"] = bucket_keys
    root = {"Effect": "Allow", "Principal": {"AWS": "arn:aws:iam::123456789012:root"}, "Action": "kms:*",
            "Resource": "*"}
    stack.add("aws:kms/keyPolicy:KeyPolicy", "models-key-policy", {"keyId": "key-1", "policy": json.dumps({
        "Version": "2012-10-17", "Statement": [root] + ([statement] if statement else [])})},
        depends_on=["models-key", "model-cache-fs", "models"])
    stack.add("aws:fsx/dataRepositoryAssociation:DataRepositoryAssociation", "models-dra", {
        "dataRepositoryPath": f"s3://{bucket}/models/", "fileSystemPath": "/models", "fileSystemId": "fs-1"},
        depends_on=["model-cache-fs", "models", "models-key-policy"])
    return stack


def _fsx_statement(context: str = "arn:aws:s3:::models-prod-us-east-1", via: str = "s3.us-east-1.amazonaws.com"):
    return {"Effect": "Allow", "Principal": {"AWS": "arn:aws:iam::123456789012:role/aws-service-role/"
                                                    "s3.data-source.lustre.fsx.amazonaws.com/"
                                                    "AWSServiceRoleForFSxS3Access_fs-1"},
            "Action": ["kms:Decrypt", "kms:GenerateDataKey*"], "Resource": "*",
            "Condition": {"StringEquals": {"kms:ViaService": via, "kms:EncryptionContext:aws:s3:arn": context}}}


def test_fsx_role_may_decrypt_for_this_bucket(compat):
    assert _with_association(compliant_stack(), _fsx_statement()).evaluate(compat) == []


@pytest.mark.parametrize(("statement", "bucket_keys", "shown"), [
    (None, True, "does not let FSx's S3-access role"),
    (_fsx_statement(context="arn:aws:s3:::*"), True, "is not limited to this bucket"),
    (_fsx_statement(context="arn:aws:s3:::models-prod-us-east-1"), False,
     "needs ['arn:aws:s3:::models-prod-us-east-1/*']"),
    (_fsx_statement(via="ec2.us-east-1.amazonaws.com"), True, "is not limited to calls through S3"),
])
def test_fsx_key_access_mistakes(statement, bucket_keys, shown, compat):
    stack = _with_association(compliant_stack(), statement, bucket_keys)
    _check(stack, compat, "fsx-s3-key-access", shown, "models-dra")


def test_association_waits_for_the_key_policy(compat):
    stack = _with_association(compliant_stack(), _fsx_statement())
    stack.get("models-dra").dependencies.remove(stack.get("models-key-policy").urn)
    _check(stack, compat, "fsx-s3-key-access", "does not depend on the key policy", "models-dra")


def test_sse_s3_needs_no_key_policy(compat):
    stack = _with_association(compliant_stack(), None)
    inputs_of(stack, "models-sse")["rules"][0]["applyServerSideEncryptionByDefault"] = {"sseAlgorithm": "AES256"}
    assert "fsx-s3-key-access" not in fired(stack.evaluate(compat))


# -- nodes and add-ons ----------------------------------------------------------------------------------


def _bottlerocket(stack, mappings):
    inputs_of(stack, "gpu")["amiType"] = "BOTTLEROCKET_x86_64_NVIDIA"
    inputs_of(stack, "nodes-lt")["blockDeviceMappings"] = mappings
    return stack


def test_bottlerocket_data_volume(compat):
    os_volume = {"deviceName": "/dev/xvda", "ebs": {"encrypted": "true", "volumeSize": 8.0}}
    data = {"deviceName": "/dev/xvdb", "ebs": {"encrypted": "true", "volumeSize": 500.0}}
    assert _bottlerocket(compliant_stack(), [os_volume, data]).evaluate(compat) == []
    _check(_bottlerocket(compliant_stack(), [os_volume]), compat, "nodes-bottlerocket-data-volume",
           "keeps Bottlerocket's 20 GiB default", "gpu")
    small = {**data, "ebs": {"encrypted": "true", "volumeSize": 40.0}}
    _check(_bottlerocket(compliant_stack(), [os_volume, small]), compat, "nodes-bottlerocket-data-volume",
           "is 40 GiB", "gpu")


def test_pod_identity_agent_and_network_policy_enforcement(compat):
    stack = compliant_stack()
    stack.remove("eks-pod-identity-agent")
    _check(stack, compat, "eks-network-policy-and-pod-identity", "lacks the managed add-on(s) eks-pod-identity-agent",
           "cluster")
    stack = compliant_stack()
    del inputs_of(stack, "vpc-cni")["configurationValues"]
    _check(stack, compat, "eks-network-policy-and-pod-identity", "every NetworkPolicy is accepted and ignored",
           "cluster")
    stack.remove("llama-v1-netpol")  # no NetworkPolicy in the stack: nothing for vpc-cni to enforce
    assert "eks-network-policy-and-pod-identity" not in {f.policy for f in stack.evaluate(compat)}


def test_imdsv1_is_refused(compat):
    stack = compliant_stack()
    inputs_of(stack, "nodes-lt")["metadataOptions"]["httpTokens"] = "optional"
    _check(stack, compat, "nodes-imdsv2-and-encrypted-disks", "allows IMDSv1", "gpu")
