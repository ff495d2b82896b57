"""Every shipped stack, rendered under the mock runtime, against the image it runs (docs/architecture.md §3.10b):
each model container must start the image's entrypoint with the env the startup procedure reads, the
mounts it needs, and the package where `llm-serving publish` put it, seen through FSx. Nothing is started.

The image's half (the Dockerfile and the startup procedure against llm_serving/pod_contract.py) is checked in
tests/serving/test_pod_contract_image.py; the two halves meet in the contract module.
"""

from __future__ import annotations

from pathlib import PurePosixPath

import pytest

from infra.mockrun import REPO_ROOT
from infra.serving import container_env, package_path
from llm_serving import dockerfile
from llm_serving import pod_contract as pc

DEPLOYMENT = "kubernetes:apps/v1:Deployment"
DRA = "aws:fsx/dataRepositoryAssociation:DataRepositoryAssociation"
IMAGE = dockerfile.read(REPO_ROOT / "serving_image" / "Dockerfile")


def _model_deployments(run):
    out = [d for d in run.of_type(DEPLOYMENT)
           if d.inputs["metadata"].get("labels", {}).get("app.kubernetes.io/component") == "model-server"]
    return out


def _under(path: str, mount: str) -> bool:
    return path == mount or path.startswith(mount.rstrip("/") + "/")


def test_every_model_container_matches_the_image(stack):
    run, cfg = stack
    deployments = _model_deployments(run)
    assert len(deployments) == sum(len(m.versions) for m in cfg.models if m.strategy == "versioned") + sum(
        len({m.active, m.candidate} - {None}) for m in cfg.models if m.strategy == "red-black")
    (dra,) = run.of_type(DRA)
    assert dra.inputs["fileSystemPath"] == pc.FSX_MODELS_PATH
    dra_source = dra.inputs["dataRepositoryPath"]
    for dep in deployments:
        pod = dep.inputs["spec"]["template"]["spec"]
        (container,) = pod["containers"]
        where = f"{run.stack}/{dep.name}"
        # the image's entrypoint runs as is: no command, no args that would replace or extend it
        assert "command" not in container and "args" not in container, where
        assert IMAGE.entrypoint[:1] == (pc.NVIDIA_ENTRYPOINT,)
        env = {e["name"]: e["value"] for e in container["env"]}
        missing = [n for n in pc.STARTUP_ENV if n not in env]
        assert not missing, f"{where}: the startup procedure reads {missing}, which the Deployment does not set"
        # the env agrees with the image's own ENV wherever both set a variable (the metrics directory above all)
        for name, value in IMAGE.env.items():
            if name in env:
                assert env[name] == value, f"{where}: {name}={env[name]} but the image says {value}"
        labels = dep.inputs["metadata"]["labels"]
        model_id, version = labels["app.kubernetes.io/name"], labels["app.kubernetes.io/version"]
        entry = next(m for m in cfg.models if m.id == model_id).version(version)
        _, package_id, package_version = pc.parse_package_uri(entry.package, cfg.model_storage.model_prefix)
        # the package's identity, which the startup compares with the manifest (normally the version's own; a
        # candidate that only changes the serving image names the active version's package)
        assert (env[pc.ENV_MODEL_ID], env[pc.ENV_MODEL_VERSION]) == (model_id, package_version) == (
            package_id, package_version)
        assert env[pc.ENV_IO_FINGERPRINT] == entry.io_fingerprint

        # mounts: the model cache read-only from the FSx claim, everything the pod writes on a writable volume
        mounts = {m["mountPath"]: m for m in container["volumeMounts"]}
        volumes = {v["name"]: v for v in pod["volumes"]}
        cache = mounts[pc.MODEL_CACHE_MOUNT]
        assert cache.get("readOnly") is True and "persistentVolumeClaim" in volumes[cache["name"]], where
        assert env[pc.ENV_MODEL_CACHE] == pc.MODEL_CACHE_MOUNT
        writable = [p for p, m in mounts.items() if not m.get("readOnly") and "emptyDir" in volumes[m["name"]]]
        assert container["securityContext"]["readOnlyRootFilesystem"] is True
        for path in (env[pc.ENV_MULTIPROC_DIR], *(env[n] for n in pc.CACHE_ENV), IMAGE.entrypoint[-1]):
            assert any(_under(path, m) for m in writable), f"{where}: {path} is not on a writable volume"
        assert pod["securityContext"]["runAsUser"] == pc.RUN_AS_UID == int(IMAGE.user)

        # the package: where publish put it (the stack's URI), presented by the DRA under the FSx root's mount
        package = env[pc.ENV_PACKAGE]
        assert _under(package, pc.MODEL_CACHE_MOUNT), where
        assert entry.package == pc.package_uri(cfg.bucket_name(cfg.home_region), cfg.model_storage.model_prefix,
                                               model_id, package_version)
        below_dra = entry.package.removeprefix(
            f"s3://{cfg.bucket_name(cfg.home_region)}/").removeprefix(cfg.model_storage.model_prefix)
        assert dra_source == f"s3://{cfg.bucket_name()}/{cfg.model_storage.model_prefix}"
        on_fsx = PurePosixPath(pc.MODEL_CACHE_MOUNT) / dra.inputs["fileSystemPath"].lstrip("/") / below_dra
        assert package == str(on_fsx), f"{where}: the pod reads {package}, FSx has the package at {on_fsx}"

        # ports and probes
        ports = {p["name"]: p["containerPort"] for p in container["ports"]}
        assert ports == pc.PORTS and set(IMAGE.exposed) == set(ports.values())
        for probe, path in (("startupProbe", pc.READY_PATH), ("readinessProbe", pc.READY_PATH),
                            ("livenessProbe", pc.LIVE_PATH)):
            assert container[probe]["httpGet"] == {"path": path, "port": pc.PROBE_PORT_NAME}, (where, probe)


def test_package_path_follows_publish_key():
    """The pod once looked for `/mnt/model-cache/<id>/<version>.tar.gz`, dropping the DRA's `/models`."""
    assert package_path("chat-small", "1.0.0") == "/mnt/model-cache/models/model-cache/chat-small/1.0.0"
    assert pc.package_uri("b", "models/", "chat-small", "1.0.0") == "s3://b/models/model-cache/chat-small/1.0.0/"


def test_container_env_names_the_package_under_the_contracts_name():
    env = {e["name"]: e["value"] for e in container_env("m", "1", "sha256:" + "0" * 64)}
    assert env[pc.ENV_PACKAGE] == package_path("m", "1") and "MODEL_PACKAGE" not in env
    assert env[pc.ENV_MULTIPROC_DIR] == pc.MULTIPROC_DIR == IMAGE.env[pc.ENV_MULTIPROC_DIR]


def test_a_package_uri_is_parsed_back_to_its_key():
    uri = pc.package_uri("b", "models/", "m", "1.0")
    assert pc.parse_package_uri(uri, "models/") == ("b", "m", "1.0")
    for bad in ("s3://b/models/m/1.0.tar.gz", "s3://b/models/model-cache/m/", "s3://b/other/model-cache/m/1/"):
        with pytest.raises(pc.PodContractError, match="is not a published package directory"):
            pc.parse_package_uri(bad, "models/")


@pytest.mark.parametrize("bad", ["", "..", "a/b", "-x"])
def test_a_key_segment_that_cannot_be_a_path_is_named(bad):
    with pytest.raises(pc.PodContractError, match=f"version {bad!r} cannot be part of a store key"):
        pc.model_cache_key("m", bad)


def test_rollout_derives_the_package_from_id_and_version_as_publish_does():
    """`llm-serving rollout start --io-fingerprint` without --package names the key `publish` wrote."""
    import argparse

    from infra.mockrun import stack_config_path
    from infra.rollout.cli import _version

    class Runner:
        def config_path(self, stack):
            return stack_config_path(stack)

    args = argparse.Namespace(version="9.9.9", package=None, io_fingerprint="sha256:" + "a" * 64, model="chat-large",
                              weights_gib=132.0)
    entry = _version(args, Runner(), ["prod-us-west-2"])
    assert entry["package"] == "s3://acme-llm-prod-us-east-1/models/model-cache/chat-large/9.9.9/"
    assert entry["weightsGib"] == 132.0  # the schema checks GPU fit and load time with it
    args.version = "../x"
    with pytest.raises(Exception, match="version '../x' cannot be part of a store key"):
        _version(args, Runner(), ["prod-us-west-2"])


def test_the_rehearsal_can_plan_every_shipped_stacks_pods(stack, tmp_path):
    """What `make rehearse STACK=<stack>` would start, planned from the rendered Deployments (nothing runs)."""
    from rehearsal import podspec

    run, cfg = stack
    for dep in _model_deployments(run):
        plans = podspec.pod_plans({"inputs": dep.inputs}, IMAGE, {"model-cache": str(tmp_path / "fsx")},
                                  lambda pod, volume: tmp_path / pod / volume,
                                  secret_sources={pc.API_KEYS_SECRET: str(tmp_path / "api-keys")})
        assert len(plans) == dep.inputs["spec"]["replicas"]
        for plan in plans:
            rendered = {e["name"]: e["value"] for e in dep.inputs["spec"]["template"]["spec"]["containers"][0]["env"]}
            assert {k: plan.env[k] for k in rendered} == rendered  # exactly the rendered env on the process
            assert plan.argv == list(IMAGE.entrypoint) and plan.uid == pc.RUN_AS_UID and plan.read_only_root


def test_the_rehearsals_gateway_namespace_is_the_programs():
    from infra.bootstrap import GATEWAY_NAMESPACE
    from rehearsal.net import GATEWAY_PROXY_NAMESPACE

    assert GATEWAY_PROXY_NAMESPACE == GATEWAY_NAMESPACE
