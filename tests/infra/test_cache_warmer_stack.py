"""The model-cache warmer as every shipped stack renders it (infra/cache_warmer.py), read against what its code
(serving_image/cache_warmer.py) and the rollout's check (llm_serving.cache_state keys) need.

The CronJob cannot run here (no cluster, no FSx): its rendered form is checked; its logic is tested in
tests/serving/test_cache_warmer.py against moto's S3 and a directory standing in for the file system.
"""

from __future__ import annotations

import json

from infra.cache_warmer import WARMER_MODULE, WARMER_NAME
from infra.serving_platform import MODEL_CACHE_PVC
from llm_serving import cache_state
from llm_serving import pod_contract as pc
from llm_serving.repository import REPO_ROOT


def _statements(policy: str) -> dict[str, dict]:
    return {st["Sid"]: st for st in json.loads(policy)["Statement"]}


def test_each_region_runs_a_warmer_on_the_model_cache_it_serves_from(stack):
    run, cfg = stack
    (cronjob,) = [r for r in run.of_type("kubernetes:batch/v1:CronJob") if r.inputs["metadata"]["name"] == WARMER_NAME]
    spec = cronjob.inputs["spec"]
    assert spec["concurrencyPolicy"] == "Forbid"
    pod = spec["jobTemplate"]["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    assert container["command"] == ["python3", "-m", WARMER_MODULE]
    assert (REPO_ROOT / (WARMER_MODULE.replace(".", "/") + ".py")).is_file()  # the module the serving image runs
    env = {e["name"]: e["value"] for e in container["env"]}
    assert env["LLM_SERVING_CACHE_REGION"] == cfg.region
    assert env["LLM_SERVING_CACHE_BUCKET"] == cfg.bucket_name()
    assert env["LLM_SERVING_CACHE_MODEL_PREFIX"] == cfg.model_storage.model_prefix
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert volumes[pc.MODEL_CACHE_VOLUME]["persistentVolumeClaim"] == {"claimName": MODEL_CACHE_PVC, "readOnly": True}
    mounts = {m["name"]: m for m in container["volumeMounts"]}
    assert mounts[pc.MODEL_CACHE_VOLUME] == {"name": pc.MODEL_CACHE_VOLUME, "mountPath": pc.MODEL_CACHE_MOUNT,
                                             "readOnly": True}
    assert not any(t.get("key") == "nvidia.com/gpu" for t in pod.get("tolerations", []))  # never on a GPU node
    assert pod["serviceAccountName"] == WARMER_NAME


def test_the_warmer_writes_only_its_own_regions_markers(stack):
    run, cfg = stack
    policy = run.find("aws:iam/rolePolicy:RolePolicy", "cache-warmer-role")
    by_sid = _statements(policy.inputs["policy"])
    bucket = f"arn:aws:s3:::{cfg.bucket_name()}"
    marker_prefix = cache_state.resident_key(cfg.region, "m", "v").rsplit("/m/", 1)[0] + "/"
    assert by_sid["WriteThisRegionsMarkers"]["Resource"] == [f"{bucket}/{marker_prefix}*"]
    writes = [a for st in by_sid.values() for a in st["Action"] if a.startswith(("s3:Put", "s3:Delete"))]
    assert writes == ["s3:PutObject"]
    # The markers and requests lie outside the data repository association's prefix (they never show up on FSx).
    assert not marker_prefix.startswith(cfg.model_storage.model_prefix)
    trust = json.loads(run.find("aws:iam/role:Role", "cache-warmer-role").inputs["assumeRolePolicy"])
    condition = trust["Statement"][0]["Condition"]["StringEquals"]
    assert [v for k, v in condition.items() if k.endswith(":sub")] == [
        f"system:serviceaccount:{cfg.serving.namespace}:{WARMER_NAME}"]
