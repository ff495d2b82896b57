"""The model store and the model cache of a rehearsal: moto's S3 server holding the stack's buckets, every (model,
version) of the stack packaged from a demo model of its kind (the demo LLM, the demo ranker) and published there by
`llm-serving publish`, and FSx's data repository association realised as a directory (the objects under its
dataRepositoryPath, at its fileSystemPath)."""

from __future__ import annotations

import json
import os
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from llm_serving.repository import REPO_ROOT

# Small enough for several engines on two CPU cores; the package carries them (no local overrides). Eager: no
# torch.compile warm-up, which took a minute of both cores per pod while the other pods served, and made a new
# pod's model load (the Python-backend stub's initialize, docs/rehearsal.md) long enough to lose Triton's stub
# handshake now and then.
REHEARSAL_ENGINE_ARGS = {"max_model_len": 512, "kv_cache_memory_bytes": 64 * 1024 * 1024, "dtype": "float32",
                         "enforce_eager": True}
CREDENTIALS = {"AWS_ACCESS_KEY_ID": "rehearsal", "AWS_SECRET_ACCESS_KEY": "rehearsal",
               "AWS_DEFAULT_REGION": "us-east-1"}


class StorageError(RuntimeError):
    pass


@dataclass
class S3Server:
    """moto's S3 server: the rehearsal's buckets, every region's, at one endpoint."""

    endpoint: str
    server: Any

    def client(self):
        import boto3

        return boto3.client("s3", endpoint_url=self.endpoint, region_name="us-east-1",
                            aws_access_key_id=CREDENTIALS["AWS_ACCESS_KEY_ID"],
                            aws_secret_access_key=CREDENTIALS["AWS_SECRET_ACCESS_KEY"])

    def stop(self) -> None:
        self.server.stop()


def start_s3_server(host: str = "127.0.0.1") -> S3Server:
    """moto's S3 server on `host` (the rehearsal gives the node's bridge address: the pods reach it there)."""
    import logging

    from moto.server import ThreadedMotoServer

    logging.getLogger("werkzeug").setLevel(logging.ERROR)  # one line per S3 request otherwise
    server = ThreadedMotoServer(ip_address=host, port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    return S3Server(f"http://{host}:{port}", server)


# What the rehearsal packages for a (model, version), by the model's kind: an LLM (`vllm`) from the demo LLM, with
# the (id, version); a Python-backend model (`python`) is the demo ranker (dev_packages/demo.py), its
# plain I/O (features -> score) at every (id, version) but those below, which have its second I/O contract (one more
# output, `rank`): the dev stack's ranker runs 1.0.0 and the versioned rollout scenario publishes 1.1.0.
RANKER_RANK_VERSIONS = frozenset({("ranker", "1.1.0")})

# The failing candidates the rollback scenarios publish (scenarios.py), each a mistake a model developer could make
# and publish, by the kinds they apply to:
# - "crash-on-start" (an LLM): model.json asks for a context far beyond the model's (max_model_len 2**20), so vLLM
#   refuses to start and the pod crash-loops;
# - "serves-errors" (a Python-backend model): the ranker whose new model code calibrates its scores with a file the
#   package does not ship (SERVES_ERRORS_MODEL below): it loads, Triton reports it ready, and every request fails
#   in the model with the server's error (Triton's 500), the client's input being fine.
DEFECTS = {"crash-on-start": "vllm", "serves-errors": "python"}
CRASH_ON_START_ENGINE_ARGS = {"max_model_len": 1 << 20}
SERVES_ERRORS_MODEL = '''
# -- appended by the rehearsal (rehearsal/storage.py, defect "serves-errors"): the version a developer
# changed to calibrate its scores with weights/calibration.json, which the package does not ship. It loads and is
# ready; every request fails here, after its input was accepted: the server's error, never the client's.
_RankerModel = TritonPythonModel


class TritonPythonModel(_RankerModel):
    def initialize(self, args):
        super().initialize(args)
        config = json.loads(args["model_config"])
        self.calibration = os.path.join(config["parameters"]["weights_dir"]["string_value"], "calibration.json")

    def execute(self, requests):
        with open(self.calibration) as f:  # FileNotFoundError: the package has no calibration file
            self.scale = json.load(f)["scale"]
        return super().execute(requests)
'''


def package_source(model: dict[str, Any], version: str) -> str:
    """What the rehearsal packages `version` of `model` (a stack's model entry) from, chosen by the model's kind and
    the version; another kind is refused, naming the model and the version."""
    kind = model["kind"]
    if kind == "vllm":
        return "the demo LLM (a vLLM package)"
    if kind == "python":
        return ("the demo ranker with its second I/O contract (features -> score, rank)"
                if (model["id"], version) in RANKER_RANK_VERSIONS else "the demo ranker (features -> score)")
    raise StorageError(f"{model['id']} {version}: the rehearsal packages LLMs (kind vllm, from the demo LLM) and "
                       f"Python-backend models (kind python, from the demo ranker); {model['id']} is kind {kind}")


def build_version(model: dict[str, Any], version: str, out: Path, *, demo_model: Path | None = None,
                  defect: str | None = None) -> Path:
    """The package of `version` of `model` (a stack's model entry; the version listed there or not yet: a rollout
    publishes the new version before `llm-serving rollout start` names it), from `package_source`, built as
    `<out>/<id>-<version>.tar.gz`; with `defect` (a DEFECTS key), that mistake built in. The ranker's booster is
    trained once per `out` (deterministically)."""
    from llm_serving.package import PackageSpec, build_package

    package_source(model, version)
    model_id = model["id"]
    if defect is not None and DEFECTS.get(defect) != model["kind"]:
        raise StorageError(f"{model_id} {version}: no defect {defect!r} for kind {model['kind']} (the rehearsal "
                           f"builds {', '.join(f'{d} into kind {k}' for d, k in DEFECTS.items())})")
    out.mkdir(parents=True, exist_ok=True)
    target = out / f"{model_id}-{version}.tar.gz"
    if model["kind"] == "vllm":
        if demo_model is None:
            raise StorageError(f"{model_id} {version}: an LLM (kind vllm) is packaged from the demo LLM; none given")
        args = {**REHEARSAL_ENGINE_ARGS, **(CRASH_ON_START_ENGINE_ARGS if defect == "crash-on-start" else {})}
        # the tasks the stack budgets (its models[].tasks): the pod refuses a package whose engines differ
        return build_package(PackageSpec(demo_model, model_id, version, engine_args=args,
                                         tasks=tuple(model.get("tasks") or ("generate",))), target)
    from dev_packages import demo as demo_packages

    weights = out / "ranker-weights"
    if not (weights / demo_packages.BOOSTER_FILE).is_file():
        demo_packages.train_ranker(weights)
    python_model = None
    if defect == "serves-errors":
        python_model = out / f"{model_id}-{version}-model" / "model.py"
        python_model.parent.mkdir(parents=True, exist_ok=True)
        python_model.write_text((demo_packages.RANKER_EXAMPLE / "model" / "model.py").read_text() + SERVES_ERRORS_MODEL)
    return demo_packages.build_ranker(target, version, weights=weights,
                                      rank=(model_id, version) in RANKER_RANK_VERSIONS, model_id=model_id,
                                      python_model=python_model)


def package_versions(models: list[dict[str, Any]], demo_model: Path | None, out: Path,
                     model_prefix: str = "models/") -> dict[str, Path]:
    """A package per package URI the stack names (normally one per (model id, version)), built by `build_version`
    with the version of that URI; its I/O fingerprint must be the one the stack declares."""
    from llm_serving.package import open_package
    from llm_serving.pod_contract import parse_package_uri

    built: dict[str, Path] = {}
    for model in models:
        for entry in model["versions"]:
            if entry["package"] in built:
                continue
            _, model_id, version = parse_package_uri(entry["package"], model_prefix)
            if model_id != model["id"]:
                raise StorageError(f"{model['id']} {entry['version']}: the package URI {entry['package']} names "
                                   f"another model ({model_id})")
            path = build_version(model, version, out, demo_model=demo_model)
            fingerprint = open_package(path, out / "verify").manifest.model.io_fingerprint
            if fingerprint != entry["ioFingerprint"]:
                raise StorageError(f"{model['id']} {entry['version']}: the stack declares ioFingerprint "
                                   f"{entry['ioFingerprint']}, but the package the rehearsal builds for {model_id} "
                                   f"{version} from {package_source(model, version)} has {fingerprint}: the "
                                   "rehearsal cannot package that I/O")
            built[entry["package"]] = path
    return built


def publish(package: Path, store_uri: str, store: S3Server, home_region: str, region: str) -> dict[str, Any]:
    """`llm-serving publish`, the command a model developer runs, against the rehearsal's S3, with the warm request
    for the home region and the stack's (`--no-wait`: the rehearsal runs the region's cache warmer itself,
    model_cache.py)."""
    env = {**os.environ, **CREDENTIALS, "AWS_ENDPOINT_URL": store.endpoint, "AWS_ENDPOINT_URL_S3": store.endpoint}
    cli = REPO_ROOT / ".venv-serving" / "bin" / "llm-serving"
    proc = subprocess.run([str(cli), "publish", str(package), "--store", store_uri, "--warm-region", home_region,
                           *(["--warm-region", region] if region != home_region else []), "--home-region",
                           home_region, "--no-wait"], capture_output=True,
                          text=True, env=env, cwd=REPO_ROOT, timeout=600)
    if proc.returncode != 0:
        raise StorageError(f"llm-serving publish {package.name} --store {store_uri} failed:\n{proc.stderr[-2000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def replicate(store: S3Server, source_bucket: str, target_bucket: str, prefix: str) -> int:
    """S3 replication from the home region's bucket (done at once here)."""
    s3 = store.client()
    copied = 0
    for page in s3.get_paginator("list_objects_v2").paginate(Bucket=source_bucket, Prefix=prefix):
        for obj in page.get("Contents", []):
            s3.copy_object(Bucket=target_bucket, Key=obj["Key"], CopySource={"Bucket": source_bucket,
                                                                              "Key": obj["Key"]})
            copied += 1
    return copied


def fsx_import(store: S3Server, data_repository_path: str, file_system_path: str, root: Path) -> int:
    """What the data repository association presents: every object under `data_repository_path` at
    `<file system>/<file_system_path>/<key below the path>`, readable by every user (the pods mount it read-only)."""
    if not data_repository_path.startswith("s3://"):
        raise StorageError(f"dataRepositoryPath {data_repository_path!r} is not an s3:// URI")
    bucket, _, prefix = data_repository_path.removeprefix("s3://").partition("/")
    target = root / file_system_path.strip("/")
    s3 = store.client()
    count = 0
    for page in s3.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix):
        for obj in page.get("Contents", []):
            rel = obj["Key"][len(prefix):].lstrip("/")
            if not rel or rel.endswith("/"):
                continue
            path = target / rel
            path.parent.mkdir(parents=True, exist_ok=True)
            s3.download_file(bucket, obj["Key"], str(path))
            count += 1
    for path in [root, *root.rglob("*")]:
        path.chmod(0o755 if path.is_dir() else 0o644)
    return count
