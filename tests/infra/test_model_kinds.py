"""Every model kind in a stack: an LLM (`vllm`), a non-LLM Python-backend model (`python`, the
XGBoost ranker) and a Triton ensemble (`ensemble`) with its step models in the same pod.

The stack schema (infra/config.py) names the field of every mistake; the program (infra/serving.py) gives a model
without GPUs a Deployment on its CPU node group with no GPU request, limit, toleration or GPU node selector, and an
ensemble's pod the packages of its steps (llm_serving.pod_contract.ENV_COMPANION_PACKAGES); the cluster
(infra/cluster.py, infra/bootstrap.py) gets a managed node group and a Karpenter NodePool per CPU node group.
"""

from __future__ import annotations

import copy

import pytest
import yaml

from infra.config import ConfigError, parse_stack_config
from infra.mockrun import run_stack, shipped_run, stack_config_path
from infra.naming import CPU_NODE_GROUP_LABEL, GPU_NODE_GROUP_LABEL
from infra.serving import package_path
from llm_serving import pod_contract as pc
from llm_serving.tensor_contract import VLLM_IO_FINGERPRINT
from policies.offline import evaluate

STACK = "prod-us-west-2"  # chat-large (vllm, GPUs) and the ranker (python, CPU node group `cpu`)
DEPLOYMENT = "kubernetes:apps/v1:Deployment"
NODE_GROUP = "aws:eks/nodeGroup:NodeGroup"
PIPELINE_FP = "sha256:40186508a2d5dba542d04aa5ae75b54e471f8e87c5ee72352ebc6d375f3807cb"  # examples/ranker/pipeline


def _values(stack: str = STACK) -> tuple[dict, str]:
    raw = yaml.safe_load(stack_config_path(stack).read_text())["config"]
    return {k.split(":", 1)[1]: v for k, v in raw.items() if k.startswith("llm-serving:")}, raw["aws:region"]


def _parse(edit):
    values, region = _values()
    values = copy.deepcopy(values)
    edit(values)
    return parse_stack_config(values, region)


def _ranker(values: dict) -> dict:
    return next(m for m in values["models"] if m["id"] == "ranker")


def _chat(values: dict) -> dict:
    return next(m for m in values["models"] if m["id"] == "chat-large")


def _pipeline(version: str = "1.0.0", steps=None) -> dict:
    bucket = "acme-llm-prod-us-east-1"
    return {
        "id": "ranker-pipeline", "kind": "ensemble", "replicas": 1, "nodeGroup": "cpu", "podsPerNode": 2,
        "strategy": "red-black", "active": version, "loadTimeSeconds": 120,
        "versions": [{"version": version,
                      "package": f"s3://{bucket}/models/model-cache/ranker-pipeline/{version}/",
                      "ioFingerprint": PIPELINE_FP,
                      "steps": steps if steps is not None else [
                          {"id": "ranker-features", "version": "1.0.0"}, {"id": "ranker", "version": "4.0.0"},
                          {"id": "ranker-relevance", "version": "1.0.0"}]}],
    }


# -- the schema ------------------------------------------------------------------------------------------------------


def test_shipped_stack_declares_a_cpu_model():
    values, region = _values()
    cfg = parse_stack_config(values, region)
    ranker = next(m for m in cfg.models if m.id == "ranker")
    assert ranker.kind == "python" and ranker.gpu is None and ranker.gpus == 0 and ranker.placement == "cpu"
    assert [g.name for g in cfg.cluster.cpu_node_groups] == ["cpu"]
    assert cfg.node_group(ranker).instance_types == ["c7i.2xlarge"]


def _cpu_on_gpu_group(v):
    _ranker(v)["nodeGroup"] = "a10g"


def _no_placement(v):
    del _ranker(v)["nodeGroup"]


def _vllm_on_cpu(v):
    chat = _chat(v)
    del chat["gpu"]
    chat["nodeGroup"] = "cpu"


def _gpu_and_node_group(v):
    _chat(v)["nodeGroup"] = "cpu"


def _gpu_on_cpu_group(v):
    _ranker(v).pop("nodeGroup")
    _ranker(v).pop("podsPerNode")
    _ranker(v).pop("inProcess", None)  # a model with gpu never runs in a caller: that refusal has its own test
    _ranker(v)["gpu"] = {"nodeGroup": "cpu", "count": 1}


def _unknown_cpu_group(v):
    _ranker(v)["nodeGroup"] = "arm"


def _made_up_vllm_fingerprint(v):
    _chat(v)["versions"][0]["ioFingerprint"] = "sha256:" + "3f" * 32


def _no_kind(v):
    del _ranker(v)["kind"]


def _bad_kind(v):
    _ranker(v)["kind"] = "xgboost"


def _steps_on_python(v):
    _ranker(v)["versions"][0]["steps"] = [{"id": "ranker-features", "version": "1.0.0"}]


def _ensemble_without_steps(v):
    v["models"].append(_pipeline(steps=[]))


def _ensemble_calling_itself(v):
    v["models"].append(_pipeline(steps=[{"id": "ranker-pipeline", "version": "1.0.0"}]))


def _ensemble_step_twice(v):
    v["models"].append(_pipeline(steps=[{"id": "ranker", "version": "3.0.0"}, {"id": "ranker", "version": "4.0.0"}]))


def _ensemble_step_bad_id(v):
    v["models"].append(_pipeline(steps=[{"id": "Ranker_Features", "version": "1.0.0"}]))


def _gpu_type_in_cpu_group(v):
    v["cluster"]["cpuNodeGroups"][0]["instanceTypes"] = ["g5.2xlarge"]


def _cpu_group_named_like_gpu_group(v):
    v["cluster"]["cpuNodeGroups"][0]["name"] = "a10g"


def _nvidia_ami_on_cpu_group(v):
    v["cluster"]["cpuNodeGroups"][0]["amiType"] = "AL2023_x86_64_NVIDIA"


@pytest.mark.parametrize("edit, message", [
    (_cpu_on_gpu_group, "llm-serving:models[1].nodeGroup: 'a10g' is a GPU node group; a model without gpu runs on a "
                        "CPU node group (cluster.cpuNodeGroups: ['cpu'])"),
    (_no_placement, "llm-serving:models[1].nodeGroup: a model without gpu names the CPU node group it runs on"),
    (_vllm_on_cpu, "llm-serving:models[0].gpu: a vllm model (an LLM) runs on GPUs"),
    (_gpu_and_node_group, "llm-serving:models[0].nodeGroup: a model with gpu names its node group in gpu.nodeGroup"),
    (_gpu_on_cpu_group, "llm-serving:models[1].gpu.nodeGroup: 'cpu' is not a GPU node group (a CPU node group; a "
                        "model with gpu runs on a GPU node group); allowed: ['a10g', 'h100']"),
    (_unknown_cpu_group, "llm-serving:models[1].nodeGroup: 'arm' is not a CPU node group; allowed: ['cpu']"),
    (_made_up_vllm_fingerprint, "llm-serving:models[0].versions[0].ioFingerprint: sha256:3f3f"),
    (_no_kind, "llm-serving:models[1].kind: Field required"),
    (_bad_kind, "llm-serving:models[1].kind: Input should be 'vllm', 'python' or 'ensemble'"),
    (_steps_on_python, "llm-serving:models[1].versions[0].steps: only an ensemble (kind: ensemble) serves step "
                       "models; this model is kind: python"),
    (_ensemble_without_steps, "llm-serving:models[2].versions[0].steps: an ensemble's pod serves its step models "
                              "too"),
    (_ensemble_calling_itself, "llm-serving:models[2].versions[0].steps: 'ranker-pipeline' is the ensemble itself"),
    (_ensemble_step_twice, "llm-serving:models[2].versions[0].steps: names the model(s) ['ranker'] twice"),
    (_ensemble_step_bad_id, "llm-serving:models[2].versions[0].steps[0].id: String should match pattern"),
    (_gpu_type_in_cpu_group, "llm-serving:cluster.cpuNodeGroups[0].instanceTypes: ['g5.2xlarge'] have GPUs"),
    (_cpu_group_named_like_gpu_group, "llm-serving:cluster.cpuNodeGroups: ['a10g'] also name GPU node groups"),
    (_nvidia_ami_on_cpu_group, "llm-serving:cluster.cpuNodeGroups[0].amiType: Input should be "
                               "'AL2023_x86_64_STANDARD'"),
])
def test_every_placement_mistake_names_its_field(edit, message):
    with pytest.raises(ConfigError) as err:
        _parse(edit)
    assert message in str(err.value), str(err.value)


def test_the_vllm_fingerprint_message_says_where_it_comes_from():
    with pytest.raises(ConfigError, match=r"is not the vLLM tensor contract's \(" + VLLM_IO_FINGERPRINT):
        _parse(_made_up_vllm_fingerprint)


def test_an_ensemble_with_its_steps_is_accepted():
    cfg = _parse(lambda v: v["models"].append(_pipeline()))
    pipeline = next(m for m in cfg.models if m.id == "ranker-pipeline")
    assert pipeline.kind == "ensemble" and [v.version for v in pipeline.versions] == ["1.0.0"]
    assert pipeline.versions[0].steps  # its steps, as declared, reach the program


# -- the program -----------------------------------------------------------------------------------------------------


def _model_deployments(run, model_id):
    return [d for d in run.of_type(DEPLOYMENT)
            if d.inputs["metadata"]["labels"].get("app.kubernetes.io/name") == model_id]


def test_a_cpu_model_gets_a_deployment_without_gpus():
    run = shipped_run(STACK)
    deployments = _model_deployments(run, "ranker")
    assert len(deployments) == 2  # versioned: 3.0.0 and 4.0.0
    for dep in deployments:
        pod = dep.inputs["spec"]["template"]["spec"]
        (container,) = pod["containers"]
        resources = container["resources"]
        assert "nvidia.com/gpu" not in resources["requests"] and "nvidia.com/gpu" not in resources["limits"]
        assert "tolerations" not in pod and "affinity" not in pod
        assert pod["nodeSelector"] == {CPU_NODE_GROUP_LABEL: "cpu"}
        # half of a c7i.2xlarge's allocatable (podsPerNode: 2), infra/instances.py: (15155 MiB kubelet capacity
        # - 893 kube-reserved - 100 eviction - 2048 DaemonSets) / 2, rounded down to 256 MiB
        assert resources["requests"] == {"cpu": "3400m", "memory": "5888Mi"}
        shm = next(v for v in pod["volumes"] if v["name"] == "dshm")
        assert shm["emptyDir"]["sizeLimit"] == "2Gi"
        env = {e["name"]: e["value"] for e in container["env"]}
        assert pc.ENV_COMPANION_PACKAGES not in env  # a python model's pod serves its own package only
    # the LLM beside it keeps its GPUs
    (chat,) = _model_deployments(run, "chat-large")
    pod = chat.inputs["spec"]["template"]["spec"]
    assert pod["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] == "8"
    assert pod["nodeSelector"] == {GPU_NODE_GROUP_LABEL: "h100"}
    assert pod["tolerations"] == [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}]


def test_a_cpu_model_scales_on_tritons_queue_not_vllms():
    run = shipped_run(STACK)
    queries = {so.name: so.inputs["spec"]["triggers"][0]["metadata"]["query"]
               for so in run.of_type("kubernetes:keda.sh/v1alpha1:ScaledObject")}
    assert any(n.startswith("ranker-") for n in queries)
    for name, query in queries.items():
        metric = "vllm:num_requests_waiting" if name.startswith("chat-large") else "nv_inference_pending_request_count"
        assert query.startswith(f"sum({metric}{{"), (name, query)


def test_cpu_node_group_is_a_managed_node_group_and_a_nodepool_without_gpus():
    run = shipped_run(STACK)
    (group,) = [g for g in run.of_type(NODE_GROUP) if g.inputs["labels"].get(CPU_NODE_GROUP_LABEL)]
    assert group.inputs["labels"][CPU_NODE_GROUP_LABEL] == "cpu"
    assert group.inputs["amiType"] == "AL2023_x86_64_STANDARD" and group.inputs["instanceTypes"] == ["c7i.2xlarge"]
    assert group.inputs["capacityType"] == "ON_DEMAND" and not group.inputs.get("taints")
    assert group.inputs["scalingConfig"] == {"minSize": 1, "maxSize": 4, "desiredSize": 2}
    assert group.inputs["launchTemplate"]["id"]
    pools = [p for p in run.of_type("kubernetes:karpenter.sh/v1:NodePool")
             if p.inputs["metadata"]["name"] == "cpu-cpu"]
    (pool,) = pools
    spec = pool.inputs["spec"]
    assert spec["template"]["metadata"]["labels"][CPU_NODE_GROUP_LABEL] == "cpu"
    assert "taints" not in spec["template"]["spec"] and "nvidia.com/gpu" not in spec["limits"]
    assert spec["limits"] == {"cpu": "16"}  # (maxSize 4 - desiredSize 2) nodes of 8 vCPUs


def test_an_ensembles_pod_serves_its_steps_and_passes_the_policies():
    values, _ = _values()
    models = copy.deepcopy(values["models"]) + [_pipeline()]
    run = run_stack(STACK, config_overrides={"llm-serving:models": models})
    (dep,) = _model_deployments(run, "ranker-pipeline")
    pod = dep.inputs["spec"]["template"]["spec"]
    env = {e["name"]: e["value"] for e in pod["containers"][0]["env"]}
    assert env[pc.ENV_PACKAGE] == package_path("ranker-pipeline", "1.0.0")
    assert env[pc.ENV_COMPANION_PACKAGES].split(pc.COMPANION_SEPARATOR) == [
        package_path("ranker-features", "1.0.0"), package_path("ranker", "4.0.0"),
        package_path("ranker-relevance", "1.0.0")]
    assert env[pc.ENV_IO_FINGERPRINT] == PIPELINE_FP
    assert "nvidia.com/gpu" not in pod["containers"][0]["resources"]["limits"]
    assert run.outputs["models"]["ranker-pipeline"]["kind"] == "ensemble"
    blocking = [f"{f.policy} on {f.resource}: {f.message}"
                for f in evaluate(run.resources, run.stack, run.project, run.config) if f.blocking]
    assert blocking == []
