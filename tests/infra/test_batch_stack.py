"""The batch path as every shipped stack renders it (infra/batch.py): a batch bucket that never replicates, and one
worker per LLM whose role reaches its own model's prefix only.

The worker cannot run here (no cluster): its rendered form is checked against what its code needs
(serving_image/batch/worker.py's arguments); its behaviour is tested in tests/serving/test_batch_api.py.
"""

from __future__ import annotations

import json

from infra.batch import WORKER_MODULE, batch_bucket_name, worker_name
from llm_serving import pod_contract as pc
from llm_serving.repository import REPO_ROOT


def test_the_batch_bucket_is_protected_and_never_replicated(stack):
    run, cfg = stack
    (bucket,) = [r for r in run.of_type("aws:s3/bucket:Bucket") if r.inputs.get("bucket") == batch_bucket_name(cfg)]
    assert bucket.inputs["bucket"] != cfg.bucket_name()  # a bucket of its own, not a prefix of the model bucket
    for side in ("bucketServerSideEncryptionConfiguration:BucketServerSideEncryptionConfiguration",
                 "bucketVersioning:BucketVersioning", "bucketPublicAccessBlock:BucketPublicAccessBlock",
                 "bucketPolicy:BucketPolicy", "bucketLifecycleConfiguration:BucketLifecycleConfiguration"):
        assert run.find(f"aws:s3/{side}", "batch-bucket") is not None, side
    sse = run.find("aws:s3/bucketServerSideEncryptionConfiguration:BucketServerSideEncryptionConfiguration",
                   "batch-bucket")
    assert sse.inputs["rules"][0]["applyServerSideEncryptionByDefault"]["sseAlgorithm"] == "aws:kms"
    # No replication rule names it (the model bucket's replicates to every replica region).
    for replication in run.of_type("aws:s3/bucketReplicationConfig:BucketReplicationConfig"):
        assert "batch" not in replication.name
        assert batch_bucket_name(cfg) not in json.dumps(replication.inputs)


def test_each_llm_has_a_worker_on_its_own_route(stack):
    run, cfg = stack
    llms = [m for m in cfg.models if m.kind == "vllm"]
    deployments = {r.inputs["metadata"]["name"]: r for r in run.of_type("kubernetes:apps/v1:Deployment")}
    assert (REPO_ROOT / (WORKER_MODULE.replace(".", "/") + ".py")).is_file()  # the module the serving image runs
    for model in llms:
        spec = deployments[worker_name(model.id)].inputs["spec"]
        assert spec["replicas"] == 1 and spec["strategy"] == {"type": "Recreate"}  # no lease yet: never two
        pod = spec["template"]["spec"]
        (container,) = pod["containers"]
        command = container["command"]
        assert command[:3] == ["python3", "-m", WORKER_MODULE]
        options = dict(zip(command[3::2], command[4::2], strict=True))
        assert options["--store"] == f"s3://{batch_bucket_name(cfg)}/{model.id}"
        assert options["--endpoint"] == f"https://{model.id}.{cfg.serving.domain}" or \
            options["--endpoint"].startswith(f"https://{model.id}-")  # a versioned model's newest version
        assert pod["serviceAccountName"] == worker_name(model.id)
        assert not any(t.get("key") == "nvidia.com/gpu" for t in pod.get("tolerations", []))
        assert container["securityContext"]["readOnlyRootFilesystem"] is True
        # The image's multiprocess metrics directory is written by the worker's first metric: on a volume, since
        # the root is read-only (the worker exited at start without it in `make rehearse`).
        env = {e["name"]: e["value"] for e in container["env"]}
        assert env.get(pc.ENV_MULTIPROC_DIR, pc.MULTIPROC_DIR) == pc.MULTIPROC_DIR
        mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"] if not m.get("readOnly")}
        volumes = {v["name"]: v for v in pod["volumes"]}
        assert "emptyDir" in volumes[mounts[pc.MULTIPROC_DIR]]
    workers = [n for n in deployments if n.endswith("-batch-worker")]
    assert sorted(workers) == sorted(worker_name(m.id) for m in llms)


def test_a_worker_reaches_its_own_models_prefix_and_nothing_else(stack):
    run, cfg = stack
    bucket = f"arn:aws:s3:::{batch_bucket_name(cfg)}"
    for model in (m for m in cfg.models if m.kind == "vllm"):
        policy = json.loads(run.find("aws:iam/rolePolicy:RolePolicy", f"batch-{model.id}-role").inputs["policy"])
        s3_resources = set()
        for statement in policy["Statement"]:
            assert statement["Effect"] == "Allow"
            s3_actions = [a for a in statement["Action"] if a.startswith("s3:")]
            if s3_actions:
                s3_resources.update(statement["Resource"])
                if statement["Action"] == ["s3:ListBucket"]:
                    assert statement["Condition"] == {"StringLike": {"s3:prefix": [f"{model.id}/*"]}}
            assert "*" not in statement["Action"] and "s3:*" not in statement["Action"]
        assert s3_resources == {bucket, f"{bucket}/{model.id}/*"}  # not the model bucket, not another model's
        trust = json.loads(run.find("aws:iam/role:Role", f"batch-{model.id}-role").inputs["assumeRolePolicy"])
        condition = trust["Statement"][0]["Condition"]["StringEquals"]
        assert [v for k, v in condition.items() if k.endswith(":sub")] == [
            f"system:serviceaccount:{cfg.serving.namespace}:{worker_name(model.id)}"]


def test_each_llms_pods_serve_the_batch_api_on_its_prefix(stack):
    run, cfg = stack
    llms = {m.id for m in cfg.models if m.kind == "vllm"}
    for deployment in run.of_type("kubernetes:apps/v1:Deployment"):
        labels = deployment.inputs["spec"]["template"]["metadata"]["labels"]
        model_id = labels.get("app.kubernetes.io/name")
        if labels.get("app.kubernetes.io/component") != "model-server":
            continue
        env = {e["name"]: e.get("value") for c in deployment.inputs["spec"]["template"]["spec"]["containers"]
               for e in c.get("env", [])}
        if model_id in llms:
            assert env["LLM_SERVING_BATCH_STORE"] == f"s3://{batch_bucket_name(cfg)}/{model_id}"
            assert env["LLM_SERVING_BATCH_KMS_KEY_ID"]
        else:  # a ranker serves no OpenAI port, so no Batch API
            assert "LLM_SERVING_BATCH_STORE" not in env
    policy = json.loads(run.find("aws:iam/rolePolicy:RolePolicy", "batch-serving").inputs["policy"])
    bucket = f"arn:aws:s3:::{batch_bucket_name(cfg)}"
    resources = {r for st in policy["Statement"] if any(a.startswith("s3:") for a in st["Action"])
                 for r in st["Resource"]}
    assert resources == {bucket, *(f"{bucket}/{m}/*" for m in llms)}
