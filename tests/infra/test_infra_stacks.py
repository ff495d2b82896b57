"""Every shipped stack under Pulumi's mock runtime: the resources it registers and their properties.

Only AWS and the Kubernetes API are mocked (infra/mocks.py: there is no cloud account here). The program, the
provider SDKs' resource classes and Pulumi's dependency tracking are the real ones, and every assertion reads the
inputs the real SDK sent to the (mock) engine, as `pulumi up` would send them to the providers.
"""

from __future__ import annotations

import json
import math

from infra.config import AMIS_WITHOUT_DEVICE_PLUGIN
from infra.iam import UNSCOPABLE_ACTIONS
from infra.mockrun import MockedResource, StackRun, shipped_run, shipped_stacks
from infra.rollout.planner import plan_red_black

STACKS = shipped_stacks()
RECOMMENDED_LABELS = ("app.kubernetes.io/name", "app.kubernetes.io/version", "app.kubernetes.io/component",
                      "app.kubernetes.io/part-of", "app.kubernetes.io/managed-by")


def only(run: StackRun, type_token: str) -> MockedResource:
    found = run.of_type(type_token)
    assert len(found) == 1, f"{run.stack}: expected one {type_token}, got {[r.name for r in found]}"
    return found[0]


def statements(policy: str) -> list[dict]:
    doc = json.loads(policy)
    return doc["Statement"]


def minutes(timeout: str) -> float:
    assert timeout.endswith("m"), timeout
    return float(timeout[:-1])


def test_the_four_stacks_are_shipped():
    assert STACKS == ["dev-us-east-1", "prod-eu-west-1", "prod-us-east-1", "prod-us-west-2"]


# -- network and cluster -------------------------------------------------------------------------------------------


def test_network_has_private_subnets_in_three_zones_or_uses_the_given_vpc(stack):
    run, cfg = stack
    cluster = only(run, "aws:eks/cluster:Cluster")
    if cfg.network.vpc_id:
        assert not run.of_type("aws:ec2/vpc:Vpc")
        assert cluster.inputs["vpcConfig"]["subnetIds"] == cfg.network.private_subnet_ids
        return
    vpc = only(run, "aws:ec2/vpc:Vpc")
    assert vpc.inputs["cidrBlock"] == cfg.network.cidr
    private = [r for r in run.of_type("aws:ec2/subnet:Subnet") if "private" in r.name]
    assert len({r.inputs["availabilityZone"] for r in private}) == 3
    assert all(r.inputs["tags"]["kubernetes.io/role/internal-elb"] == "1" for r in private)
    assert len(run.of_type("aws:ec2/natGateway:NatGateway")) == 3  # one per AZ
    assert len(cluster.inputs["vpcConfig"]["subnetIds"]) == 3


def test_cluster_endpoint_is_private_in_prod(stack):
    run, cfg = stack
    vpc_config = only(run, "aws:eks/cluster:Cluster").inputs["vpcConfig"]
    assert vpc_config["endpointPrivateAccess"] is True
    assert vpc_config["endpointPublicAccess"] is (cfg.environment == "dev")
    assert only(run, "aws:eks/cluster:Cluster").inputs["encryptionConfig"]["resources"] == ["secrets"]


def test_gpu_node_groups_follow_the_config(stack):
    run, cfg = stack
    groups = {r.name: r for r in run.of_type("aws:eks/nodeGroup:NodeGroup")}
    assert set(groups) == ({"eks-system"} | {f"eks-gpu-{g.name}" for g in cfg.cluster.gpu_node_groups}
                           | {f"eks-cpu-{g.name}" for g in cfg.cluster.cpu_node_groups})
    assert groups["eks-system"].inputs.get("taints") is None
    for g in cfg.cluster.cpu_node_groups:  # models without GPUs: no GPU taint, AMI or label
        ng = groups[f"eks-cpu-{g.name}"].inputs
        assert not ng.get("taints") and "NVIDIA" not in ng["amiType"] and ng["instanceTypes"] == g.instance_types
        assert ng["labels"]["llm-serving/cpu-node-group"] == g.name and "llm-serving/gpu-node-group" not in ng["labels"]
    system_template = run.find("aws:ec2/launchTemplate:LaunchTemplate", "eks-system").inputs
    assert system_template["metadataOptions"] == {"httpEndpoint": "enabled", "httpTokens": "required",
                                                  "httpPutResponseHopLimit": 1}
    assert system_template["blockDeviceMappings"][0]["ebs"]["encrypted"] == "true"
    for g in cfg.cluster.gpu_node_groups:
        ng = groups[f"eks-gpu-{g.name}"].inputs
        assert ng["amiType"] == g.ami_type
        assert ng["instanceTypes"] == g.instance_types
        assert ng["taints"] == [{"key": "nvidia.com/gpu", "value": "true", "effect": "NO_SCHEDULE"}]
        assert ng["labels"]["llm-serving/gpu-node-group"] == g.name
        assert all(ng["labels"][k] == v for k, v in g.labels.items())
        assert ng["scalingConfig"] == {"minSize": g.scaling.min_size, "maxSize": g.scaling.max_size,
                                       "desiredSize": g.scaling.desired_size}
        template = run.find("aws:ec2/launchTemplate:LaunchTemplate", f"eks-gpu-{g.name}").inputs
        assert template["metadataOptions"]["httpTokens"] == "required"
        efa = [ni for ni in template.get("networkInterfaces", []) if ni.get("interfaceType") == "efa"]
        assert bool(efa) is g.efa
        if g.efa:  # EFA nodes share one AZ and a cluster placement group
            assert len(ng["subnetIds"]) == 1
            assert "groupName" in template["placement"]


def test_device_plugin_only_where_the_ami_lacks_it(stack):
    run, cfg = stack
    needed = any(g.ami_type in AMIS_WITHOUT_DEVICE_PLUGIN for g in cfg.cluster.gpu_node_groups)
    plugins = [r for r in run.of_type("kubernetes:apps/v1:DaemonSet") if "nvidia-device-plugin" in r.name]
    assert bool(plugins) is needed
    if plugins:
        spec = plugins[0].inputs["spec"]["template"]["spec"]
        assert spec["nodeSelector"] == {"llm-serving/device-plugin": "program"}
        assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in spec["tolerations"]
        for g in cfg.cluster.gpu_node_groups:  # the selector matches exactly the node groups that need it
            labels = run.find("aws:eks/nodeGroup:NodeGroup", f"eks-gpu-{g.name}").inputs["labels"]
            assert (labels["llm-serving/device-plugin"] == "program") is g.needs_device_plugin


# -- model storage -------------------------------------------------------------------------------------------------


MODEL_BUCKET = "storage-models"


def test_model_bucket_is_encrypted_versioned_private_tls_only_and_expires_old_versions(stack):
    run, cfg = stack
    # The model bucket and its side resources (the batch bucket beside it is tests/infra/test_batch_stack.py's).
    bucket = run.find("aws:s3/bucket:Bucket", MODEL_BUCKET)
    assert bucket.inputs["bucket"] == f"acme-llm-{cfg.environment}-{cfg.region}"
    sse = run.find("aws:s3/bucketServerSideEncryptionConfiguration:BucketServerSideEncryptionConfiguration",
                   MODEL_BUCKET)
    rule = sse.inputs["rules"][0]["applyServerSideEncryptionByDefault"]
    assert rule["sseAlgorithm"] == "aws:kms" and rule["kmsMasterKeyId"].startswith("arn:aws:kms:")
    assert run.find("aws:s3/bucketVersioning:BucketVersioning", MODEL_BUCKET).inputs["versioningConfiguration"] == {
        "status": "Enabled"}
    block = run.find("aws:s3/bucketPublicAccessBlock:BucketPublicAccessBlock", MODEL_BUCKET).inputs
    assert all(block[k] is True for k in ("blockPublicAcls", "blockPublicPolicy", "ignorePublicAcls",
                                          "restrictPublicBuckets"))
    (deny,) = statements(run.find("aws:s3/bucketPolicy:BucketPolicy", MODEL_BUCKET).inputs["policy"])
    assert deny["Effect"] == "Deny" and deny["Condition"] == {"Bool": {"aws:SecureTransport": "false"}}
    lifecycle = run.find("aws:s3/bucketLifecycleConfiguration:BucketLifecycleConfiguration",
                         MODEL_BUCKET).inputs["rules"][0]
    assert lifecycle["noncurrentVersionExpiration"]["noncurrentDays"] == cfg.model_storage.noncurrent_version_days


def test_only_the_home_region_replicates_to_every_other_region_with_their_keys(stack):
    run, cfg = stack
    replication = run.of_type("aws:s3/bucketReplicationConfig:BucketReplicationConfig")
    if not cfg.is_home_region or not cfg.model_storage.replica_regions:
        assert not replication  # dev has one region; the other prod regions receive, they do not send
        return
    assert run.stack == "prod-us-east-1"
    (config,) = replication
    destinations = {r["destination"]["bucket"]: r["destination"]["encryptionConfiguration"]["replicaKmsKeyId"]
                    for r in config.inputs["rules"]}
    assert destinations == {f"arn:aws:s3:::acme-llm-prod-{r.region}": r.kms_key_arn
                            for r in cfg.model_storage.replica_regions}
    assert {r.region for r in cfg.model_storage.replica_regions} == {"us-west-2", "eu-west-1"}
    # The other prod stacks export the key the home stack names (their `modelKmsKeyArn` output).
    for replica in cfg.model_storage.replica_regions:
        assert shipped_run(f"prod-{replica.region}").outputs["modelKmsKeyArn"] == replica.kms_key_arn


def test_fsx_is_persistent_2_linked_to_the_model_prefix_and_opens_only_lustre_ports_to_nodes(stack):
    run, cfg = stack
    fs = only(run, "aws:fsx/lustreFileSystem:LustreFileSystem")
    assert fs.inputs["deploymentType"] == "PERSISTENT_2"
    assert fs.inputs["perUnitStorageThroughput"] == cfg.model_storage.fsx.per_unit_storage_throughput
    assert fs.custom_timeouts and minutes(fs.custom_timeouts["create"]) > 10
    dra = only(run, "aws:fsx/dataRepositoryAssociation:DataRepositoryAssociation").inputs
    assert dra["dataRepositoryPath"] == f"s3://acme-llm-{cfg.environment}-{cfg.region}/models/"
    assert dra["fileSystemPath"] == "/models"
    # The FSx group's rules (the cluster group's runner rule on 443 is tests/infra/test_infra_reachability.py's).
    rules = [r for r in run.of_type("aws:vpc/securityGroupIngressRule:SecurityGroupIngressRule")
             if "-api-runner-" not in r.name]
    assert {(r.inputs["fromPort"], r.inputs["toPort"]) for r in rules} == {(988, 988), (1018, 1023)}
    assert all("cidrIpv4" not in r.inputs and r.inputs["ipProtocol"] == "tcp" for r in rules)
    node_sg = only(run, "aws:eks/cluster:Cluster")  # the cluster security group is the nodes' group
    from_nodes = [r for r in rules if "nodes" in r.name]
    assert len(from_nodes) == 2 and all(r.inputs["referencedSecurityGroupId"].startswith("sg-") for r in from_nodes)
    assert node_sg.urn in {d for r in from_nodes for d in r.dependencies}


def test_model_cache_is_mounted_read_only_through_the_fsx_csi_driver(stack):
    run, _ = stack
    assert run.find("aws:eks/addon:Addon", "eks-aws-fsx-csi-driver").inputs["addonName"] == "aws-fsx-csi-driver"
    pv = only(run, "kubernetes:core/v1:PersistentVolume").inputs
    assert pv["spec"]["csi"]["driver"] == "fsx.csi.aws.com" and pv["spec"]["csi"]["readOnly"] is True
    assert pv["spec"]["csi"]["volumeHandle"] == run.outputs["modelCacheFileSystemId"]
    assert pv["spec"]["accessModes"] == ["ReadOnlyMany"]
    pvc = only(run, "kubernetes:core/v1:PersistentVolumeClaim").inputs
    assert pvc["spec"]["accessModes"] == ["ReadOnlyMany"]
    assert pvc["spec"]["volumeName"] == pv["metadata"]["name"]


def test_ecr_is_immutable_scanned_and_every_deployment_runs_the_built_digest(stack):
    run, cfg = stack
    repo = only(run, "aws:ecr/repository:Repository").inputs
    assert repo["imageTagMutability"] == "IMMUTABLE"
    assert repo["imageScanningConfiguration"] == {"scanOnPush": True}
    ref = run.outputs["servingImage"]
    if cfg.is_home_region:
        image = only(run, "docker-build:index:Image").inputs
        assert image["context"] == {"location": ".."}  # the repository root, from infra/ (the CLI's working dir)
        assert image["dockerfile"] == {"location": "../serving_image/Dockerfile"}
        assert image["push"] is True
        assert "@sha256:" in ref and ref.startswith(image["tags"][0].rsplit(":", 1)[0])
    else:  # another region runs the home region's build (tests/infra/test_infra_multiregion.py)
        assert "@sha256:" in ref and ref.startswith(f"123456789012.dkr.ecr.{cfg.region}.amazonaws.com/")
    for dep in run.of_type("kubernetes:apps/v1:Deployment"):
        if dep.name.endswith("-deployment"):
            assert dep.inputs["spec"]["template"]["spec"]["containers"][0]["image"] == ref


def test_iam_is_least_privilege(stack):
    run, cfg = stack
    for policy in run.of_type("aws:iam/rolePolicy:RolePolicy"):
        for st in statements(policy.inputs["policy"]):
            resources = st["Resource"] if isinstance(st["Resource"], list) else [st["Resource"]]
            actions = st["Action"] if isinstance(st["Action"], list) else [st["Action"]]
            # "*" only for actions IAM cannot scope (infra/iam.py UNSCOPABLE_ACTIONS), never mixed with others.
            assert "*" not in resources or set(actions) <= UNSCOPABLE_ACTIONS, (policy.name, st)
            for arn in resources:
                assert not arn.startswith("arn:aws:kms") or "*" not in arn, (policy.name, st)
    serving = run.find("aws:iam/rolePolicy:RolePolicy", "platform-model-server")
    by_sid = {st["Sid"]: st for st in statements(serving.inputs["policy"])}
    bucket = f"arn:aws:s3:::acme-llm-{cfg.environment}-{cfg.region}"
    assert by_sid["ReadModelPackages"]["Resource"] == [f"{bucket}/models/*"]
    assert set(by_sid["ReadModelPackages"]["Action"]) == {"s3:GetObject", "s3:GetObjectVersion"}
    assert by_sid["ListModelPrefix"]["Condition"] == {"StringLike": {"s3:prefix": ["models/*"]}}
    assert all(not a.startswith(("s3:Put", "s3:Delete")) for st in by_sid.values() for a in st["Action"])
    trust = json.loads(run.find("aws:iam/role:Role", "platform-model-server").inputs["assumeRolePolicy"])
    condition = trust["Statement"][0]["Condition"]["StringEquals"]
    assert [v for k, v in condition.items() if k.endswith(":sub")] == [
        "system:serviceaccount:llm-serving:model-server"]
    assert trust["Statement"][0]["Action"] == "sts:AssumeRoleWithWebIdentity"


# -- per model -----------------------------------------------------------------------------------------------------


def model_objects(run: StackRun, model_id: str) -> list[MockedResource]:
    return [r for r in run.resources if r.type.startswith("kubernetes:")
            and (r.inputs.get("metadata") or {}).get("labels", {}).get("app.kubernetes.io/name") == model_id]


def test_every_model_version_has_its_deployment_service_pdb_autoscaler_and_routes(stack):
    run, cfg = stack
    for model in cfg.models:
        objects = model_objects(run, model.id)
        kinds = sorted(r.inputs["kind"] for r in objects)
        served = run.outputs["models"][model.id]["versions"]
        n = len(served)
        routes = n if model.strategy == "versioned" else 1
        expected = (["Deployment"] * n + ["GRPCRoute"] * routes + ["HTTPRoute"] * routes + ["NetworkPolicy"] * n
                    + ["PodDisruptionBudget"] * n + ["Service"] * n)
        scaled = [r for r in objects if r.inputs["kind"] == "ScaledObject"]
        assert sorted(k for k in kinds if k != "ScaledObject") == sorted(expected)
        assert len(scaled) == sum(1 for v in served if run.outputs["models"][model.id]["replicas"][v] > 0)
        for r in objects:  # §3.10 on every per-model object
            labels = r.inputs["metadata"]["labels"]
            assert all(k in labels for k in RECOMMENDED_LABELS), (r.name, labels)
            assert labels["app.kubernetes.io/component"] == "model-server"
            assert labels["app.kubernetes.io/managed-by"] == "pulumi"


def test_deployments_carry_gpu_limits_probes_security_spread_and_long_timeouts(stack):
    run, cfg = stack
    for model in cfg.models:
        for dep in (r for r in model_objects(run, model.id) if r.inputs["kind"] == "Deployment"):
            pod = dep.inputs["spec"]["template"]["spec"]
            (c,) = pod["containers"]
            if model.gpu is None:  # a model without GPUs: its CPU node group, no GPU request or toleration
                assert "nvidia.com/gpu" not in c["resources"]["limits"]
                assert "nvidia.com/gpu" not in c["resources"]["requests"]
                assert pod["nodeSelector"] == {"llm-serving/cpu-node-group": model.node_group}
                assert not any(t.get("key") == "nvidia.com/gpu" for t in pod.get("tolerations") or [])
            else:
                assert c["resources"]["limits"]["nvidia.com/gpu"] == str(model.gpu.count)
                assert pod["nodeSelector"] == {"llm-serving/gpu-node-group": model.gpu.node_group}
            startup = c["startupProbe"]
            assert startup["failureThreshold"] * startup["periodSeconds"] >= model.load_time_seconds
            assert c["readinessProbe"]["httpGet"]["path"] == "/v2/health/ready"
            assert c["livenessProbe"]["httpGet"]["path"] == "/v2/health/live"
            assert pod["securityContext"]["runAsNonRoot"] is True and c["securityContext"]["runAsNonRoot"] is True
            assert c["securityContext"]["allowPrivilegeEscalation"] is False
            assert "topology.kubernetes.io/zone" in {t["topologyKey"] for t in pod["topologySpreadConstraints"]}
            assert pod["terminationGracePeriodSeconds"] == cfg.serving.termination_grace_period_seconds
            assert c["lifecycle"]["preStop"]["sleep"]["seconds"] < pod["terminationGracePeriodSeconds"]
            mounts = {m["name"]: m for m in c["volumeMounts"]}
            assert mounts["model-cache"]["readOnly"] is True
            volumes = {v["name"]: v for v in pod["volumes"]}
            assert volumes["model-cache"]["persistentVolumeClaim"] == {"claimName": "model-cache", "readOnly": True}
            assert dep.custom_timeouts is not None
            assert minutes(dep.custom_timeouts["create"]) > 10 and minutes(dep.custom_timeouts["update"]) > 10
            assert minutes(dep.custom_timeouts["create"]) * 60 >= model.load_time_seconds


def test_autoscaling_is_keda_on_the_queue_depth(stack):
    """An LLM scales on vLLM's waiting requests; the other kinds (no vLLM engine) on Triton's pending requests."""
    run, cfg = stack
    for model in cfg.models:
        metric = "vllm:num_requests_waiting" if model.kind == "vllm" else "nv_inference_pending_request_count"
        for so in (r for r in model_objects(run, model.id) if r.inputs["kind"] == "ScaledObject"):
            spec = so.inputs["spec"]
            (trigger,) = spec["triggers"]
            assert trigger["type"] == "prometheus"
            assert trigger["metadata"]["query"].startswith(f"sum({metric}{{")
            version = so.inputs["metadata"]["labels"]["app.kubernetes.io/version"]
            assert spec["minReplicaCount"] == run.outputs["models"][model.id]["replicas"][version]
            assert spec["maxReplicaCount"] >= spec["minReplicaCount"]
            assert spec["scaleTargetRef"]["name"] == so.inputs["metadata"]["name"]
            # No series is the scaler's error, and the fallback keeps the replicas: never scaled down for lack of data.
            assert trigger["metadata"]["ignoreNullValues"] == "false"
            assert spec["fallback"]["behavior"] == "currentReplicas"
            assert spec["fallback"]["replicas"] == spec["minReplicaCount"]


def test_routes_split_traffic_by_the_planner(stack):
    run, cfg = stack
    for model in cfg.models:
        objects = model_objects(run, model.id)
        http = [r for r in objects if r.inputs["kind"] == "HTTPRoute"]
        grpc = [r for r in objects if r.inputs["kind"] == "GRPCRoute"]
        if model.strategy == "versioned":
            assert len(http) == len(grpc) == len(model.versions)
            hosts = {r.inputs["spec"]["hostnames"][0] for r in http}
            assert len(hosts) == len(model.versions)  # one hostname per version
            continue
        plan = plan_red_black(model.active, model.replicas, model.candidate, model.weight,
                              model.autoscaling.max_replicas if model.autoscaling else None)
        expected = {f"{model.id}-{s.version.replace('.', '-')}": s.weight for s in plan.shares}
        for route, port in ((http[0], 9000), (grpc[0], 8001)):
            backends = {b["name"]: b["weight"] for b in route.inputs["spec"]["rules"][0]["backendRefs"]}
            assert backends == expected
            assert {b["port"] for b in route.inputs["spec"]["rules"][0]["backendRefs"]} == {port}
        assert math.isclose(sum(expected.values()), 100)


# -- outputs -------------------------------------------------------------------------------------------------------


def test_outputs_follow_the_documented_schema(stack):
    from llm_serving.stack_outputs import parse_stack_outputs

    run, cfg = stack
    outputs = parse_stack_outputs(run.outputs)
    assert outputs.region == cfg.region and outputs.stack == run.stack and outputs.environment == cfg.environment
    assert set(outputs.models) == {m.id for m in cfg.models}
    for model in cfg.models:
        out = outputs.models[model.id]
        assert out.strategy == model.strategy and out.region == cfg.region
        if model.strategy == "red-black":
            assert out.active_version == model.active
            assert out.versions == [v for v in (model.active, model.candidate) if v]
        else:
            assert out.versions == [v.version for v in model.versions]
            assert out.active_version == model.versions[-1].version
            assert set(out.version_endpoints) == set(out.versions)
        assert out.endpoints.openai == f"https://{model.id}" + (
            f"-{out.active_version.replace('.', '-')}" if model.strategy == "versioned" else "") + \
            f".{cfg.serving.domain}/v1"
