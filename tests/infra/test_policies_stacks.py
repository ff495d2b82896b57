"""The policy pack on the real program: every shipped stack passes, and the rules see the program's own shapes.

Each stack runs under Pulumi's mock runtime with the real provider SDKs (`infra.mockrun`; no cloud account exists
here). The first test is the CI gate (`make test`): no mandatory violation on any shipped stack, against the real
`serving_image/compat.toml`. The second breaks one thing at a time in the real prod-us-east-1 run and checks that
the rule meant to catch it does, so a rule cannot pass the shipped stacks by never matching their resources.
"""

from __future__ import annotations

import copy
import json
import re
from collections.abc import Callable

import pytest

from infra.mockrun import shipped_run, shipped_stacks
from policies.catalog import ALL_POLICIES
from policies.compat import DEFAULT_PATH as DEFAULT_COMPAT
from policies.offline import evaluate
from tests.infra.policy_support import write_compat

STACKS = shipped_stacks()
SENSITIVITY_STACK = "prod-us-east-1"
# The rules about models without GPUs and versioned models need a stack that has them: prod-us-west-2's ranker (a
# Python-backend model on the CPU node group `cpu`, versioned 3.0.0 and 4.0.0).
CPU_STACK = "prod-us-west-2"
MUTATION_STACK = {"serving-cpu-model-no-gpu": CPU_STACK, "cpu-nodes-no-gpu-approved-types": CPU_STACK,
                  "rollout-versioned-only-on-io-change": CPU_STACK,
                  "serving-python-dependencies-in-image": CPU_STACK, "experiments-arms-served": CPU_STACK}


@pytest.fixture(scope="module")
def runs():
    return {}


def _run(runs, stack):
    if stack not in runs:
        runs[stack] = shipped_run(stack)  # the per-process cache every module shares (read-only)
    return runs[stack]


def test_stacks_are_shipped():
    assert {"dev-us-east-1", "prod-us-east-1", "prod-us-west-2", "prod-eu-west-1"} <= set(STACKS)


@pytest.mark.parametrize("stack", STACKS)
def test_shipped_stack_has_no_mandatory_violation(stack, runs):
    run = _run(runs, stack)
    findings = evaluate(run.resources, run.stack, run.project, run.config)
    blocking = [f"{f.policy} on {f.resource}: {f.message}" for f in findings if f.blocking]
    assert blocking == []


# -- sensitivity on the real program's resources -------------------------------------------------------------------


def _of(resources, type_):
    found = [r for r in resources if r.type == type_]
    assert found, f"the program registered no {type_}"
    return found


def _serving(resources):
    return [r for r in _of(resources, "kubernetes:apps/v1:Deployment")
            if r.inputs["spec"]["template"]["metadata"]["labels"].get("app.kubernetes.io/component") == "model-server"]


def _server(resources):
    return _serving(resources)[0].inputs["spec"]["template"]["spec"]["containers"][0]


def _red_black_with_candidate(config):
    found = [m for m in config["llm-serving:models"] if m.get("candidate")]
    assert found, f"{SENSITIVITY_STACK} no longer ships a red-black rollout in progress; pick a stack that does"
    return found[0]


def _drop(resources, type_):
    resources[:] = [r for r in resources if r.type != type_]


def _policy_doc(resource, edit: Callable[[dict], None]):
    doc = json.loads(resource.inputs["policy"])
    edit(doc)
    resource.inputs["policy"] = json.dumps(doc)


def _candidate_deployment(resources, config):
    model = _red_black_with_candidate(config)
    return next(d for d in _serving(resources)
                if d.inputs["metadata"]["labels"]["app.kubernetes.io/version"] == model["candidate"]
                and d.inputs["metadata"]["labels"]["app.kubernetes.io/name"] == model["id"])


def _active_deployment(resources, config):
    model = _red_black_with_candidate(config)
    return next(d for d in _serving(resources)
                if d.inputs["metadata"]["labels"]["app.kubernetes.io/version"] == model["active"]
                and d.inputs["metadata"]["labels"]["app.kubernetes.io/name"] == model["id"])


def _drop_dependencies(resource):
    resource.dependencies.clear()
    resource.property_dependencies.clear()


def _batch_worker_key_volume(resources):
    workers = [d for d in _of(resources, "kubernetes:apps/v1:Deployment")
               if d.inputs["metadata"]["labels"].get("app.kubernetes.io/component") == "batch-worker"]
    assert workers, "the program registered no batch worker"
    return next(v for v in workers[0].inputs["spec"]["template"]["spec"]["volumes"] if "secret" in v)


def _ranker_server(resources):
    dep = next(d for d in _serving(resources) if d.inputs["metadata"]["labels"]["app.kubernetes.io/name"] == "ranker")
    return dep.inputs["spec"]["template"]["spec"]["containers"][0]


def _experiment_on_a_version_being_removed(resources, config):
    """An experiment between the ranker's two versions while 3.0.0's Deployment is scaled to zero (on its way out)."""
    config.setdefault("llm-serving:experiments", []).append(
        {"name": "ranker-v4", "unit": "user", "arms": [{"name": "control", "model": "ranker", "version": "3.0.0",
                                                        "percent": 50},
                                                       {"name": "xgboost", "model": "ranker", "version": "4.0.0",
                                                        "percent": 50}]})
    old = next(d for d in _serving(resources) if d.inputs["metadata"]["labels"]["app.kubernetes.io/name"] == "ranker"
               and d.inputs["metadata"]["labels"]["app.kubernetes.io/version"] == "3.0.0")
    old.inputs["spec"].update(replicas=0)


def _cpu_groups(resources):
    return [g for g in _of(resources, "aws:eks/nodeGroup:NodeGroup")
            if "llm-serving/cpu-node-group" in (g.inputs.get("labels") or {})]


def _same_fingerprint_twice(config):
    ranker = next(m for m in config["llm-serving:models"] if m["id"] == "ranker")
    ranker["versions"][-1]["ioFingerprint"] = ranker["versions"][0]["ioFingerprint"]


def _gpu_groups(resources):
    return [g for g in _of(resources, "aws:eks/nodeGroup:NodeGroup") if "NVIDIA" in g.inputs.get("amiType", "")]


def _loosen_irsa_trust(resources):
    role = next(r for r in _of(resources, "aws:iam/role:Role") if "AssumeRoleWithWebIdentity" in r.inputs.get(
        "assumeRolePolicy", ""))
    doc = json.loads(role.inputs["assumeRolePolicy"])
    doc["Statement"][0]["Condition"] = {"StringLike": {"x:sub": "system:serviceaccount:*"}}
    role.inputs["assumeRolePolicy"] = json.dumps(doc)


_RELEASE = re.compile(r"\d{2}\.\d{2}")


def _stated_release(resources) -> str:
    """The Triton release the program's image build states (its build args name the NGC base image or tag)."""
    args = _of(resources, "docker-build:index:Image")[0].inputs.get("buildArgs") or {}
    found = {m.group(0) for k, v in args.items() if "TRITON" in k.upper() for m in [_RELEASE.search(str(v))] if m}
    assert len(found) == 1, f"the serving image's build args state no single Triton release: {args}"
    return found.pop()


def _move_stated_release(resources, release):
    image = _of(resources, "docker-build:index:Image")[0].inputs
    old = _stated_release(resources)
    image["buildArgs"] = {k: str(v).replace(old, release) for k, v in image["buildArgs"].items()}
    image["tags"] = [str(t).replace(old, release) for t in image.get("tags", [])]


def _routes_stop_waiting_for(resources, deployment):
    for route in resources:
        if route.type.endswith(("HTTPRoute", "GRPCRoute")) and deployment.urn in route.dependencies:
            route.dependencies.remove(deployment.urn)


MUTATIONS: dict[str, Callable] = {
    "s3-bucket-encryption": lambda res, cfg: _drop(
        res, "aws:s3/bucketServerSideEncryptionConfiguration:BucketServerSideEncryptionConfiguration"),
    "s3-bucket-versioning": lambda res, cfg: _of(res, "aws:s3/bucketVersioning:BucketVersioning")[0].inputs[
        "versioningConfiguration"].update(status="Suspended"),
    "s3-public-access-block": lambda res, cfg: _of(
        res, "aws:s3/bucketPublicAccessBlock:BucketPublicAccessBlock")[0].inputs.update(restrictPublicBuckets=False),
    "s3-tls-only": lambda res, cfg: _policy_doc(_of(res, "aws:s3/bucketPolicy:BucketPolicy")[0],
                                                lambda doc: doc["Statement"][0].update(Effect="Allow")),
    "s3-replication-kms-objects": lambda res, cfg: _of(
        res, "aws:s3/bucketReplicationConfig:BucketReplicationConfig")[0].inputs["rules"][0].pop(
        "sourceSelectionCriteria"),
    "fsx-persistent-2-in-prod": lambda res, cfg: _of(res, "aws:fsx/lustreFileSystem:LustreFileSystem")[0].inputs
    .update(deploymentType="SCRATCH_2"),
    "fsx-encryption": lambda res, cfg: _of(res, "aws:fsx/lustreFileSystem:LustreFileSystem")[0].inputs
    .pop("kmsKeyId"),
    "fsx-lustre-ports-only": lambda res, cfg: _of(
        res, "aws:vpc/securityGroupIngressRule:SecurityGroupIngressRule")[0].inputs.update(toPort=2049),
    "gpu-nodes-nvidia-ami": lambda res, cfg: _gpu_groups(res)[0].inputs.update(amiType="AL2_x86_64_GPU"),
    "gpu-nodes-taint": lambda res, cfg: _gpu_groups(res)[0].inputs.update(taints=[]),
    "gpu-nodes-approved-instance-types": lambda res, cfg: _gpu_groups(res)[0].inputs.update(
        instanceTypes=["g4dn.xlarge"]),
    # A small type added to the L40S pool: embed-base's pod (sized for g6e.12xlarge) cannot fit on it.
    "model-pod-fits-nodes": lambda res, cfg: [g.inputs["instanceTypes"].append("g6e.xlarge") for g in _gpu_groups(res)
                                              if g.inputs["labels"].get("llm-serving/gpu-node-group") == "l40s"],
    # The bucket key's policy back to the default (no FSx statement): lazy loads through the association fail.
    "fsx-s3-key-access": lambda res, cfg: _of(res, "aws:kms/keyPolicy:KeyPolicy")[0].inputs.update(
        policy=json.dumps({"Version": "2012-10-17", "Statement": [json.loads(
            _of(res, "aws:kms/keyPolicy:KeyPolicy")[0].inputs["policy"])["Statement"][0]]})),
    "nodes-bottlerocket-data-volume": lambda res, cfg: [
        t.inputs.update(blockDeviceMappings=t.inputs["blockDeviceMappings"][:1])
        for t in _of(res, "aws:ec2/launchTemplate:LaunchTemplate") if t.name.endswith("l40s")],
    "eks-network-policy-and-pod-identity": lambda res, cfg: [
        a.inputs.pop("configurationValues") for a in _of(res, "aws:eks/addon:Addon")
        if a.inputs["addonName"] == "vpc-cni"],
    "nodes-imdsv2-and-encrypted-disks": lambda res, cfg: _of(res, "aws:ec2/launchTemplate:LaunchTemplate")[0].inputs[
        "metadataOptions"].update(httpTokens="optional"),
    # The first route created before the Gateway API CRDs exist on a fresh cluster.
    "crds-before-custom-resources": lambda res, cfg: _drop_dependencies(
        _of(res, "kubernetes:gateway.networking.k8s.io/v1:HTTPRoute")[0]),
    # The candidate's route stops waiting for the controller: the active version could shrink before new weights apply.
    "routes-wait-for-controller": lambda res, cfg: [
        r.inputs["metadata"]["annotations"].pop("pulumi.com/waitFor")
        for r in _of(res, "kubernetes:gateway.networking.k8s.io/v1:GRPCRoute")],
    # The home region stops replicating its image: the other regions' digest is never there.
    "ecr-one-build-replicated": lambda res, cfg: [res.remove(r) for r in _of(
        res, "aws:ecr/replicationConfiguration:ReplicationConfiguration")],
    # No Karpenter NodePools: fixed node groups only.
    "gpu-capacity-autoscaled": lambda res, cfg: [res.remove(p)
                                                 for p in _of(res, "kubernetes:karpenter.sh/v1:NodePool")],
    "gpu-nodes-size-cap": lambda res, cfg: _gpu_groups(res)[0].inputs["scalingConfig"].update(maxSize=500),
    "iam-no-wildcard-s3-ecr-kms": lambda res, cfg: _policy_doc(
        next(r for r in _of(res, "aws:iam/rolePolicy:RolePolicy") if '"s3:' in r.inputs["policy"]),
        lambda doc: doc["Statement"][0].update(Resource="*")),
    "serving-image-digest": lambda res, cfg: _server(res).update(image="registry.example/llm-serving:latest"),
    "serving-image-pins": lambda res, cfg: _move_stated_release(res, "24.01"),
    "serving-gpu-resources": lambda res, cfg: [r.pop("nvidia.com/gpu", None)
                                               for r in _server(res)["resources"].values()],
    # The 8-GPU model's pod states a 1-GPU engine: vLLM would serve on one GPU and leave seven idle.
    "serving-engine-uses-pod-gpus": lambda res, cfg: [
        e.update(value="tensor=1,pipeline=1,data=1") for r in _serving(res)
        for c in r.inputs["spec"]["template"]["spec"]["containers"] for e in c.get("env", [])
        if e["name"] == "LLM_SERVING_PARALLEL" and e["value"].startswith("tensor=8")],
    # Every engine of the pod back to vLLM's default share: three engines would each take 0.9 of the GPUs' memory.
    "serving-engine-memory-budgeted": lambda res, cfg: [
        e.update(value="generate=0.9,embed=0.9,score=0.9") for r in _serving(res)
        for c in r.inputs["spec"]["template"]["spec"]["containers"] for e in c.get("env", [])
        if e["name"] == "LLM_SERVING_ENGINE_MEMORY"],
    # The serving ports opened to every pod in the cluster (the rule without `from`): callers bypass the gateway.
    "serving-network-policy-gateway-only": lambda res, cfg: next(
        rule for n in _of(res, "kubernetes:networking.k8s.io/v1:NetworkPolicy") for rule in n.inputs["spec"].get(
            "ingress", []) if "gateway.envoyproxy.io" in json.dumps(rule.get("from"))).pop("from"),
    # No caller authentication at the Gateway: its SecurityPolicy gone, every route open to whoever reaches the NLB.
    "gateway-api-keys-required": lambda res, cfg: _drop(
        res, "kubernetes:gateway.envoyproxy.io/v1alpha1:SecurityPolicy"),
    # A model pod without its key: the keys' Secret volume and the variable naming it gone.
    "serving-api-keys-required": lambda res, cfg: _server(res).update(
        env=[e for e in _server(res)["env"] if e["name"] != "LLM_SERVING_API_KEYS_FILE"]),
    # A KServe port without a key: the flag that turns the check on for 8000/8001 (and fails a keyless start) gone.
    "serving-kserve-ports-authenticated": lambda res, cfg: _server(res).update(
        env=[e for e in _server(res)["env"] if e["name"] != "LLM_SERVING_REQUIRE_API_KEYS"]),
    # The batch worker's key Secret optional again: a worker without it would call the Gateway keyless.
    "batch-worker-key-required": lambda res, cfg: _batch_worker_key_volume(res)["secret"].update(optional=True),
    "serving-probes": lambda res, cfg: _server(res).pop("livenessProbe"),
    "serving-update-timeout": lambda res, cfg: _serving(res)[0].custom_timeouts.update(update="2m"),
    "serving-model-from-fsx": lambda res, cfg: _server(res).update(volumeMounts=[]),
    # The Deployment forgets the package: the image's startup would exit with a usage error.
    "serving-pod-contract": lambda res, cfg: _server(res).update(
        env=[e for e in _server(res)["env"] if e["name"] != "LLM_SERVING_PACKAGE"]),
    "serving-no-download-at-start": lambda res, cfg: _server(res)["env"].append(
        {"name": "MODEL_URI", "value": "s3://bucket/models/m.tar.gz"}),
    "serving-non-root": lambda res, cfg: _server(res)["securityContext"].update(runAsNonRoot=False),
    # The ranker's 4.0.0 claims 3.0.0's interface: versioned is only for an I/O change.
    "rollout-versioned-only-on-io-change": lambda res, cfg: _same_fingerprint_twice(cfg),
    # The ranker (no gpu configured) asks for a GPU anyway.
    "serving-cpu-model-no-gpu": lambda res, cfg: _ranker_server(res)["resources"]["limits"].update(
        {"nvidia.com/gpu": "1"}),
    # The CPU node group launches a GPU type: models without GPUs would hold GPU nodes.
    "cpu-nodes-no-gpu-approved-types": lambda res, cfg: _cpu_groups(res)[0].inputs.update(
        instanceTypes=["g5.2xlarge"]),
    # The ranker starts importing lightgbm, which the image's stub does not have: it would load locally only.
    "serving-python-dependencies-in-image": lambda res, cfg: next(
        m for m in cfg["llm-serving:models"] if m["id"] == "ranker")["pythonDependencies"].append("lightgbm==4.5.0"),
    # An arm on the ranker's 3.0.0 while that version is scaled to zero: the arm's users would get no answer.
    "experiments-arms-served": _experiment_on_a_version_being_removed,
    "rollout-weight-only-to-replicas": lambda res, cfg: _routes_stop_waiting_for(res, _candidate_deployment(res, cfg)),
    # The version with the traffic (the rollout's active one, the candidate being at 25%) loses its Deployment.
    "rollout-newest-version-kept": lambda res, cfg: res.remove(_active_deployment(res, cfg)),
    "rollout-gpu-surge-bound": lambda res, cfg: _candidate_deployment(res, cfg).inputs["spec"].update(replicas=8),
    "iam-irsa-trust-scoped": lambda res, cfg: _loosen_irsa_trust(res),
    "eks-private-endpoint-in-prod": lambda res, cfg: _of(res, "aws:eks/cluster:Cluster")[0].inputs[
        "vpcConfig"].update(endpointPublicAccess=True),
    # A batch worker's role widened from its model's prefix to the whole batch bucket (every model's client data).
    "batch-store-isolated": lambda res, cfg: _policy_doc(
        next(r for r in _of(res, "aws:iam/rolePolicy:RolePolicy") if r.name.startswith("batch-")),
        lambda doc: doc["Statement"][0].update(Resource=[doc["Statement"][0]["Resource"][0].rsplit("/", 2)[0] + "/*"])),
}


def test_every_mandatory_rule_has_a_mutation():
    mandatory = {p.name for p in ALL_POLICIES if p.enforcement_level.value == "mandatory"}
    assert mandatory == set(MUTATIONS)


@pytest.mark.parametrize("policy", sorted(MUTATIONS))
def test_rule_catches_a_break_in_the_real_program(policy, runs, tmp_path):
    run = _run(runs, MUTATION_STACK.get(policy, SENSITIVITY_STACK))
    # The real compat.toml; before the serving image's issue created it, a copy pinning what the program builds.
    compat = DEFAULT_COMPAT if DEFAULT_COMPAT.is_file() else write_compat(
        tmp_path, f'[triton]\nrelease = "{_stated_release(run.resources)}"\nvllm_version = "x"\n'
                  f'vllm_backend_branch = "y"\n')
    resources, config = copy.deepcopy(run.resources), copy.deepcopy(run.config)
    before = evaluate(resources, run.stack, run.project, config, compat_file=compat)
    assert not [f for f in before if f.blocking]
    MUTATIONS[policy](resources, config)
    after = evaluate(resources, run.stack, run.project, config, compat_file=compat)
    assert policy in {f.policy for f in after if f.blocking}, [(f.policy, f.message) for f in after]
