"""The stack's models in the rehearsal's store, published as a model developer publishes them (docs/rehearsal.md,
"What it does", the store and FSx rows): the buckets the stack names, every (model, version) it names packaged and
`llm-serving publish`ed, replicated to the stack's own region, and imported by the FSx association. storage.py holds
the pieces (moto's S3, packaging, publish, replication, the import); this module does them in the stack's order and
keeps what a later publish needs (the rollout scenarios publish new versions into the same store).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rich.console import Console

from llm_serving import cache_state
from llm_serving.repository import REPO_ROOT
from rehearsal import render, storage


@dataclass(frozen=True)
class StackPackages:
    """Where the stack's packages live, and the FSx association that imports them."""

    store: storage.S3Server
    demo: Path  # the demo LLM the packages are built from
    store_uri: str  # s3://<home bucket>/<modelPrefix>: `llm-serving publish --store`
    home_bucket: str
    region_bucket: str  # the stack's own region's bucket (the home bucket in the home region)
    home_region: str
    aws_region: str
    dra: dict[str, Any]  # the data repository association's rendered inputs
    fsx: Path  # the association's file system: the model-cache claim
    packages: Path  # where packages are built

    def publish(self, model: dict[str, Any], version: str, defect: str | None, console: Console) -> dict[str, str]:
        """Package `version` of `model` (with a storage.DEFECTS mistake built in, or none) as a model developer
        would, publish it to the rehearsal's S3 and let the FSx association import it; returns the rollout's version
        entry (package URI, I/O fingerprint)."""
        from llm_serving.package import open_package

        path = storage.build_version(model, version, self.packages, demo_model=self.demo, defect=defect)
        record = storage.publish(path, self.store_uri, self.store, self.home_region, self.aws_region)
        if self.region_bucket != self.home_bucket:
            for prefix in ("models/", cache_state.CACHE_STATE_PREFIX + "/"):
                storage.replicate(self.store, self.home_bucket, self.region_bucket, prefix)
        storage.fsx_import(self.store, self.dra["dataRepositoryPath"], self.dra["fileSystemPath"], self.fsx)
        fingerprint = open_package(path, self.packages / "verify" / version).manifest.model.io_fingerprint
        console.print(f"published {model['id']} {version} -> {record['model_cache_uri']}")
        return {"package": record["model_cache_uri"], "ioFingerprint": fingerprint}


def publish_stack(store: storage.S3Server, rendered: render.Rendered, workdir: Path, console: Console) -> StackPackages:
    """Every (model, version) the stack names, in `store` at the URI the stack names, and on the FSx directory."""
    s3 = store.client()
    home, region = rendered.bucket(rendered.home_region), rendered.bucket()
    for bucket in {home, region, *rendered.buckets()}:  # the batch bucket too: the worker lists it from start
        s3.create_bucket(Bucket=bucket)
    from serving_image.demo_model import ensure_demo_model

    with console.status("packaging every (model, version) of the stack from the demo model"):
        demo = ensure_demo_model(REPO_ROOT / ".cache" / "llm-serving" / "models" / "demo-tiny")
        packages = storage.package_versions(rendered.models, demo, workdir / "packages", rendered.model_prefix)
    store_uri = f"s3://{home}/{rendered.model_prefix.rstrip('/')}"
    for uri, package in packages.items():
        record = storage.publish(package, store_uri, store, rendered.home_region, rendered.region)
        if record["model_cache_uri"] != uri:
            raise storage.StorageError(f"`llm-serving publish {package.name} --store {store_uri}` put the package "
                                       f"at {record['model_cache_uri']}, the stack names {uri}")
        console.print(f"published {record['model_id']} {record['version']} -> {record['model_cache_uri']}")
    if region != home:
        copied = sum(storage.replicate(store, home, region, prefix)
                     for prefix in (rendered.model_prefix, cache_state.CACHE_STATE_PREFIX + "/"))
        console.print(f"replicated {copied} objects {home} -> {region}")
    (dra,) = rendered.of_type(render.DRA)
    fsx = workdir / "fsx"
    count = storage.fsx_import(store, dra["inputs"]["dataRepositoryPath"], dra["inputs"]["fileSystemPath"], fsx)
    console.print(f"FSx: {count} objects of {dra['inputs']['dataRepositoryPath']} at "
                  f"{dra['inputs']['fileSystemPath']} ({fsx})")
    return StackPackages(store, demo, store_uri, home, region, rendered.home_region, rendered.region, dra["inputs"],
                         fsx, workdir / "packages")
