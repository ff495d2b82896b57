"""Stack config validation (docs/architecture.md §3.6): every wrong value fails at program start with a message that
names the full key and the allowed values. Most cases validate in-process (no Pulumi needed); one runs the real
program under the mock runtime to check the error surfaces from `run_stack` unchanged."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import yaml

from infra.config import COMPAT_TOML, ConfigError, ServingConfig, parse_stack_config, triton_pin
from infra.mockrun import run_stack, stack_config_path

STACK = "prod-us-east-1"


def base() -> dict:
    raw = yaml.safe_load(stack_config_path(STACK).read_text())["config"]
    return {k.split(":", 1)[1]: v for k, v in raw.items() if k.startswith("llm-serving:")}


def error_for(values: dict, region: str = "us-east-1") -> str:
    with pytest.raises(ConfigError) as info:
        parse_stack_config(values, region)
    return str(info.value)


def test_shipped_configs_parse():
    for stack in ("dev-us-east-1", "prod-us-east-1", "prod-us-west-2", "prod-eu-west-1"):
        raw = yaml.safe_load(stack_config_path(stack).read_text())["config"]
        values = {k.split(":", 1)[1]: v for k, v in raw.items() if k.startswith("llm-serving:")}
        cfg = parse_stack_config(values, raw["aws:region"])
        assert cfg.region == raw["aws:region"]


def mutate(path: str, value, values: dict | None = None) -> dict:
    """Set `a.b[0].c` in a copy of the base config (value None deletes the key)."""
    values = copy.deepcopy(values or base())
    node = values
    keys = path.replace("]", "").replace("[", ".").split(".")
    for key in keys[:-1]:
        node = node[int(key)] if key.isdigit() else node[key]
    last = keys[-1]
    if value is None:
        del node[int(last) if last.isdigit() else last]
    else:
        node[int(last) if last.isdigit() else last] = value
    return values


@pytest.mark.parametrize("path,value,expected", [
    ("models[0].strategy", "blue-green",
     "llm-serving:models[0].strategy: Input should be 'red-black' or 'versioned' (got 'blue-green')"),
    ("models[0].weight", 140, "llm-serving:models[0].weight: Input should be less than or equal to 100 (got 140)"),
    ("models[0].weight", -5, "llm-serving:models[0].weight: Input should be greater than or equal to 0 (got -5)"),
    ("models[0].candidate", "9.9", "llm-serving:models[0].candidate: '9.9' is not one of the listed versions"),
    ("models[0].candidate", "2.3.0", "llm-serving:models[0].candidate: '2.3.0' is the active version"),
    ("models[0].active", None, "llm-serving:models[0].active: a red-black model must name its active version"),
    ("models[0].weight", None, "llm-serving:models[0].weight: a red-black model with a candidate needs"),
    ("models[0].replicas", 0, "llm-serving:models[0].replicas: Input should be greater than or equal to 1"),
    ("models[0].gpu.nodeGroup", "a100",
     "llm-serving:models[0].gpu.nodeGroup: 'a100' is not a GPU node group; allowed: ['h100', 'l40s']"),
    ("models[0].gpu.count", 16, "llm-serving:models[0].gpu.count: 16 GPUs per pod, but the engine's parallel "
     "layout is tensor 8 x pipeline 1 x data 1 = 8 GPU(s); vLLM uses exactly that many"),
    ("models[0].gpu.count", 4, "llm-serving:models[0].gpu.count: 4 GPUs per pod, but the engine's parallel "
     "layout is tensor 8 x pipeline 1 x data 1 = 8 GPU(s)"),
    ("models[0].parallel", {"tensor": 4, "pipeline": 4}, "llm-serving:models[0].gpu.count: 8 GPUs per pod, but the "
     "engine's parallel layout is tensor 4 x pipeline 4 x data 1 = 16 GPU(s)"),
    ("models[0].parallel", {"tensor": 8, "expert": 2}, "llm-serving:models[0].parallel.expert"),
    ("models[0].parallel", None, "llm-serving:models[0].gpu.count: 8 GPUs per pod, but the engine's parallel "
     "layout is tensor 1 x pipeline 1 x data 1 = 1 GPU(s)"),
    ("models[0].versions[0].ioFingerprint", "md5:abc",
     "llm-serving:models[0].versions[0].ioFingerprint: String should match pattern"),
    ("models[0].versions[0].package", "s3://someone-elses-bucket/models/x/",
     "llm-serving:models[0].versions[0].package: 's3://someone-elses-bucket/models/x/' must be under "
     "s3://acme-llm-prod-us-east-1/models/"),
    # A tarball is a publishing format; the stack names the unpacked package on the model cache
    ("models[0].versions[0].package", "s3://acme-llm-prod-us-east-1/models/chat-large/2.3.0.tar.gz",
     "llm-serving:models[0].versions[0].package: String should match pattern"),
    # ... at the key `llm-serving publish` derives from (id, version)
    ("models[0].versions[0].package", "s3://acme-llm-prod-us-east-1/models/chat-large/2.3.0/",
     "llm-serving:models[0].versions[0].package: 's3://acme-llm-prod-us-east-1/models/chat-large/2.3.0/' is not "
     "where `llm-serving publish --store s3://acme-llm-prod-us-east-1/models` puts a package of chat-large; expected "
     "'s3://acme-llm-prod-us-east-1/models/model-cache/chat-large/2.3.0/' for chat-large 2.3.0"),
    ("models[0].versions[0].package", "s3://acme-llm-prod-us-east-1/models/model-cache/embed-base/1.2/",
     "is not where `llm-serving publish --store s3://acme-llm-prod-us-east-1/models` puts a package of chat-large"),
    ("models[1].id", "chat-large", "llm-serving:models: duplicate model ids ['chat-large']"),
    ("models[0].tier", "gold", "llm-serving:models[0].tier: unknown key"),
    ("environment", "staging", "llm-serving:environment: Input should be 'dev' or 'prod' (got 'staging')"),
    ("cluster.endpointPublicAccess", True,
     "llm-serving:cluster.endpointPublicAccess: prod clusters have a private endpoint only (allowed: false)"),
    ("cluster.gpuNodeGroups[0].amiType", "AL2_x86_64",
     "llm-serving:cluster.gpuNodeGroups[0].amiType: Input should be 'AL2023_x86_64_NVIDIA', 'AL2023_ARM_64_NVIDIA',"),
    ("cluster.gpuNodeGroups[0].instanceTypes", ["m7i.large"],
     "llm-serving:cluster.gpuNodeGroups[0].instanceTypes: 'm7i.large' is not an NVIDIA GPU instance type"),
    ("modelStorage.fsx.perUnitStorageThroughput", 200,
     "llm-serving:modelStorage.fsx.perUnitStorageThroughput: Input should be 125, 250, 500 or 1000 (got 200)"),
    ("modelStorage.fsx.storageCapacityGib", 3000,
     "llm-serving:modelStorage.fsx.storageCapacityGib: PERSISTENT_2 takes 1200 GiB or a multiple of 2400 GiB"),
    ("modelStorage.replicaRegions[0].kmsKeyArn", "arn:aws:kms:eu-west-1:123456789012:key/"
     "91f01bf2-6ef8-2603-4bd9-f53e680dd652",
     "llm-serving:modelStorage.replicaRegions[0].kmsKeyArn: the key must be in us-west-2"),
    ("serving.domain", "not a domain", "llm-serving:serving.domain: String should match pattern"),
])
def test_bad_values_name_the_key_and_what_is_allowed(path, value, expected):
    assert expected in error_for(mutate(path, value))


def test_efa_needs_efa_capable_instances():
    values = mutate("cluster.gpuNodeGroups[1].instanceTypes", ["g5.12xlarge"],
                    mutate("cluster.gpuNodeGroups[1].efa", True))
    assert "llm-serving:cluster.gpuNodeGroups[1].efa: true needs EFA-capable instance types" in error_for(values)


def test_versioned_models_do_not_take_red_black_keys():
    values = mutate("models[0].strategy", "versioned")
    assert "llm-serving:models[0].active: only a red-black model names active" in error_for(values)


def test_red_black_lists_only_the_versions_it_serves():
    values = mutate("models[0].candidate", None, mutate("models[0].weight", None))
    assert "llm-serving:models[0].versions: ['2.4.0'] are neither active nor candidate" in error_for(values)


def test_unknown_top_level_key_and_missing_required_keys():
    values = base()
    values["modelStorag"] = {}
    assert "llm-serving:modelStorag: unknown key (allowed: environment, team, homeRegion" in error_for(values)
    values = base()
    del values["cluster"]
    assert "llm-serving:cluster: Field required" in error_for(values)


def test_only_the_home_region_replicates():
    assert "llm-serving:modelStorage.replicaRegions: only the home region (us-east-1) replicates" in error_for(
        base(), region="us-west-2")


def test_every_error_is_reported_at_once():
    values = mutate("models[0].weight", 140, mutate("environment", "staging"))
    message = error_for(values)
    assert "llm-serving:environment" in message and "llm-serving:models[0].weight" in message


def test_config_errors_surface_from_run_stack_with_the_programs_message():
    models = base()["models"]
    models[0]["strategy"] = "canary"
    with pytest.raises(ConfigError) as info:
        run_stack(STACK, {"models": models})
    assert str(info.value) == ("llm-serving:models[0].strategy: Input should be 'red-black' or 'versioned' "
                               "(got 'canary')")


def test_triton_pin_comes_from_compat_toml_and_the_config_key_only_as_a_fallback(tmp_path: Path):
    compat = tmp_path / "compat.toml"
    text = COMPAT_TOML.read_text()
    compat.write_text(text)
    pin = triton_pin(ServingConfig(domain="llm.example.com"), compat)
    assert (pin.release, pin.image_tag, pin.vllm_version) == ("26.08", "26.08-vllm-python-py3", "0.27.1")
    with pytest.raises(ConfigError, match="serving.tritonImageTag: '25.10-vllm-python-py3' disagrees with"):
        triton_pin(ServingConfig(domain="llm.example.com", triton_image_tag="25.10-vllm-python-py3"), compat)
    missing = tmp_path / "absent.toml"
    with pytest.raises(ConfigError, match="serving.tritonImageTag: required while serving_image/compat.toml"):
        triton_pin(ServingConfig(domain="llm.example.com"), missing)
    fallback = triton_pin(ServingConfig(domain="llm.example.com", triton_image_tag="25.12-vllm-python-py3"), missing)
    assert fallback.image == "nvcr.io/nvidia/tritonserver:25.12-vllm-python-py3"
    compat.write_text(text.replace('\nrelease = "26.08"\n', "\n", 1))
    with pytest.raises(ConfigError, match=r"compat.toml: triton.release is missing"):
        triton_pin(ServingConfig(domain="llm.example.com"), compat)
    compat.write_text(text.replace("tritonserver:26.08-vllm-python-py3\"", "tritonserver:26.07-vllm-python-py3\""))
    with pytest.raises(ConfigError, match=r"triton.image '.*:26.07-vllm-python-py3' is not release '26.08'"):
        triton_pin(ServingConfig(domain="llm.example.com"), compat)


def test_plain_and_structured_values_reach_the_program_as_pulumi_hands_them_over():
    """`team` is a plain string, `cluster` an object (JSON-encoded by the engine); a string where an object belongs
    is reported under its key."""
    run = run_stack("dev-us-east-1", {"team": "search-ranking"})
    bucket = run.find("aws:s3/bucket:Bucket", "storage-models")
    assert bucket.inputs["tags"]["team"] == "search-ranking" and bucket.inputs["tags"]["env"] == "dev"
    with pytest.raises(ConfigError, match=r"^llm-serving:cluster: Input should be a valid dictionary"):
        run_stack("dev-us-east-1", {"cluster": "big"})


def test_a_layout_that_matches_its_gpus_must_still_fit_one_node():
    values = mutate("models[0].gpu.count", 16, mutate("models[0].parallel", {"tensor": 16}))
    assert "llm-serving:models[0].gpu.count: 16 GPUs do not fit on one node of 'h100'" in error_for(values)


def test_parallel_is_only_for_vllm_models_and_others_use_one_gpu():
    cfg = base()
    ranker = {"id": "ranker", "kind": "python", "replicas": 1, "gpu": {"nodeGroup": "l40s", "count": 2},
              "strategy": "versioned", "versions": [{"version": "1", "package": cfg["models"][0]["versions"][0][
                  "package"].replace("chat-large/2.3.0", "ranker/1"), "ioFingerprint": "sha256:" + "1" * 64}]}
    assert "models[2].gpu.count: a python model's Triton instance uses one GPU" in error_for(
        mutate("models", [*cfg["models"], ranker]))
    ranker = {**ranker, "gpu": {"nodeGroup": "l40s", "count": 1}, "parallel": {"tensor": 1}}
    assert "models[2].parallel: only a vllm model runs an engine with a parallel layout" in error_for(
        mutate("models", [*cfg["models"], ranker]))


def test_the_model_cache_must_hold_the_resident_versions_and_the_next_one():
    """Every package the stack names is resident on FSx (the cache warmer restores it in full), and the
    next version of the largest model is warmed before a rollout may name it: all of it within storageCapacityGib."""
    values = mutate("modelStorage.fsx", {"storageCapacityGib": 1200, "perUnitStorageThroughput": 1000})
    values = mutate("models[0].loadTimeSeconds", 7200, values)
    values = mutate("models[0].versions[0].weightsGib", 400, values)
    values = mutate("models[0].versions[1].weightsGib", 400, values)
    message = error_for(values)
    assert "llm-serving:modelStorage.fsx.storageCapacityGib: 1200 GiB cannot hold the" in message
    assert "plus the next version of the largest (400 GiB) warmed before its rollout: 1201.25 GiB needed" in message
