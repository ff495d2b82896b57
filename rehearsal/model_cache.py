"""The rehearsal's model cache, cold and then warm: what the stack's cache warmer changes for a pod's startup
(docs/rehearsal.md, "The model cache: cold, then warm").

The rehearsal's FSx is a directory (storage.fsx_import: what the data repository association presents). Right after
the association imported a package, FSx holds its *metadata*; each file's data is loaded from S3 on its first read.
A lazy-loading view of the directory stands for that (lazy_cache.py beside this module, a FUSE passthrough: a
file's first read costs FIRST_BYTE_S plus its size at MIB_S, charged once; both numbers are this rehearsal's
assumption, not an FSx measurement). On that view, in order:

1. the resident markers the rollout reads are absent for every requested version (`llm-serving publish
   --warm-region` wrote the requests; nothing has warmed them);
2. a pod's startup step 1 (unpack-and-verify, which reads every file) on a cold view of one package: the lazy loads
   fall inside the pod's startup;
3. the stack's rendered CronJob (infra/cache_warmer.py) runs its container's command with its rendered environment
   on a second cold view, then every requested version's marker must be in S3 with the package's checksum;
4. step 1 again, on the now warm view.

The pods then start on the plain directory, as on a warm FSx. The warmer runs as a container of the built image
(`podman run`: its rendered command, env, user and read-only root, the view mounted read-only at the model-cache
claim's mountPath) in the node's network namespace; substitutions (what differs from the cluster): `--endpoint-url`
is the rehearsal's S3 and moto's credentials stand in for the CronJob's IRSA role.
"""

from __future__ import annotations

import contextlib
import json
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from image_build import containers
from llm_serving import pod_contract as pc
from llm_serving.store import PublishedPackage, resident_problem
from rehearsal import storage
from rehearsal.lazy_cache import FIRST_BYTE_S, MIB_S, MountedCache, step_one_seconds

CRONJOB = "kubernetes:batch/v1:CronJob"
WARMER_TIMEOUT_S = 600


class ModelCacheError(RuntimeError):
    pass


@dataclass
class ModelCacheResult:
    model_id: str
    version: str
    cold_step1_s: float
    warmer_s: float
    warm_step1_s: float
    cold_bytes: int  # what the cold pod's step 1 loaded lazily
    warmer_bytes: int  # what the warmer loaded (every requested package)
    markers: list[str] = field(default_factory=list)  # "<model> <version>" resident after the warmer
    weights_gib: float | None = None  # what the stack declares for this version (the demo package is tiny)

    def lines(self) -> list[str]:
        scale = [] if self.weights_gib is None else [
            f"  at the same assumed rate, the {self.weights_gib:g} GiB the stack declares for {self.model_id} "
            f"{self.version} would cost a cold pod {self.weights_gib * 1024 / MIB_S:.0f} s of its startup budget"]
        return [
            f"model cache ({self.model_id} {self.version}, lazy loads assumed {FIRST_BYTE_S} s + {MIB_S:g} MiB/s per "
            f"file): pod step 1 cold {self.cold_step1_s:.2f} s ({self.cold_bytes / 2**20:.1f} MiB loaded inside "
            f"the startup), warm {self.warm_step1_s:.2f} s after the warmer ({self.warmer_s:.2f} s, "
            f"{self.warmer_bytes / 2**20:.1f} MiB, before any rollout); resident: {', '.join(self.markers)}",
            *scale,
        ]


def warmer_container(rendered) -> dict[str, Any]:
    """The rendered CronJob's one container (its command, env, mounts)."""
    jobs = rendered.of_type(CRONJOB)
    if len(jobs) != 1:
        raise ModelCacheError(f"the stack renders {len(jobs)} CronJob(s), the model-cache warmer expected once")
    containers = jobs[0]["inputs"]["spec"]["jobTemplate"]["spec"]["template"]["spec"]["containers"]
    if len(containers) != 1:
        raise ModelCacheError(f"the warmer's CronJob has {len(containers)} containers, expected one")
    return containers[0]


def warmer_command(container: dict[str, Any], endpoint: str) -> list[str]:
    """The container's command and args as rendered, pointed at the rehearsal's S3."""
    command = list(container.get("command") or [])
    if command[:1] != ["python3"]:
        raise ModelCacheError(f"the warmer's command {command} does not start with the image's python3")
    mounts = {m["mountPath"] for m in container.get("volumeMounts", [])}
    if pc.MODEL_CACHE_MOUNT not in mounts:
        raise ModelCacheError(f"the warmer mounts {sorted(mounts)}, not the model cache at {pc.MODEL_CACHE_MOUNT}")
    return [*command, *container.get("args", []), "--endpoint-url", endpoint]


def warmer_env(container: dict[str, Any]) -> dict[str, str]:
    """The rendered env, then moto's credentials (the CronJob's IRSA role)."""
    return {**{e["name"]: e["value"] for e in container.get("env", [])}, **storage.CREDENTIALS}


# Runs the warmer: its rendered container, the cold view (the model cache's root) and the S3 endpoint.
WarmerRun = Callable[[dict[str, Any], Path, str], subprocess.CompletedProcess]


def warmer_in_image(image: str) -> WarmerRun:
    """The warmer as the CronJob's pod runs it: a container of the built image."""

    def run(container: dict[str, Any], view: Path, endpoint: str) -> subprocess.CompletedProcess:
        command = warmer_command(container, endpoint)
        security = container.get("securityContext") or {}
        argv = containers.podman("run", "--rm", "--network", "host", "--pull", "never",
                                 "--mount", f"type=bind,source={view},destination={pc.MODEL_CACHE_MOUNT},ro=true",
                                 "--entrypoint", json.dumps(command[:1]))
        if "runAsUser" in security:
            argv += ["--user", f"{security['runAsUser']}:{security.get('runAsGroup', security['runAsUser'])}"]
        if security.get("readOnlyRootFilesystem"):
            argv += ["--read-only", "--read-only-tmpfs=false"]
        for key, value in sorted(warmer_env(container).items()):
            argv += ["--env", f"{key}={value}"]
        return subprocess.run([*argv, image, *command[1:]], env=containers.environment(), capture_output=True,
                              text=True, timeout=WARMER_TIMEOUT_S)

    return run


@contextlib.contextmanager
def _lazy_view(source: Path, mountpoint: Path):
    """The lazy-loading view of `source` at `mountpoint`, every file cold; its FUSE operations (loaded_bytes)."""
    cache = MountedCache(source, mountpoint, MIB_S, FIRST_BYTE_S)
    try:
        ops = cache.__enter__()
    except RuntimeError as err:  # no /dev/fuse, fusepy or libfuse2: `make rehearse` installs libfuse2
        raise ModelCacheError(f"the lazy-loading FSx view at {mountpoint}: {err}") from None
    try:
        yield ops
    finally:
        cache.__exit__(None, None, None)


def _published(model_id: str, version: str, manifest: bytes) -> PublishedPackage:
    from llm_serving.cache_state import package_checksum

    return PublishedPackage(model_id=model_id, version=version, package_uri="", model_cache_uri="", sha256="",
                            already_published=True, manifest_sha256=package_checksum(manifest))


def rehearse_model_cache(rendered, fsx: Path, store: storage.S3Server, run_warmer: WarmerRun, workdir: Path,
                         model_id: str, version: str, view=_lazy_view) -> ModelCacheResult:
    """Steps 1-4 of the module's docstring for (model_id, version); raises ModelCacheError naming what failed.
    `view(source, mountpoint)`: the cold view of the FSx directory (a context manager yielding an object with
    `loaded_bytes`); the FUSE stand-in, or in `make test` (no root, no libfuse) a plain link to the directory."""
    s3 = store.client()
    bucket = rendered.bucket()
    region = rendered.region
    published = {}
    for model in rendered.models:
        for entry in model["versions"]:
            key_bucket, mid, ver = pc.parse_package_uri(entry["package"], rendered.model_prefix)
            key = pc.manifest_key(entry["package"].removeprefix(f"s3://{key_bucket}/").rstrip("/"))
            published[(mid, ver)] = _published(mid, ver, s3.get_object(Bucket=bucket, Key=key)["Body"].read())
    for (mid, ver), pub in published.items():
        why = resident_problem(lambda _region: s3, bucket, region, pub)
        if why is None:
            raise ModelCacheError(f"{mid} {ver} has a resident marker before any warmer ran")
    with view(fsx, workdir / "cold-view") as cold:
        cold_s = step_one_seconds(workdir / "cold-view", model_id, version, workdir / "step1-cold")
        cold_bytes = cold.loaded_bytes
    container = warmer_container(rendered)
    with view(fsx, workdir / "warm-view") as warm:
        t0 = time.perf_counter()
        proc = run_warmer(container, workdir / "warm-view", store.endpoint)
        warmer_s = time.perf_counter() - t0
        if proc.returncode != 0:
            raise ModelCacheError(f"the cache warmer ({' '.join(proc.args)}) exited {proc.returncode}:\n"
                                  f"{proc.stderr[-2000:]}")
        warmer_bytes = warm.loaded_bytes
        warm_s = step_one_seconds(workdir / "warm-view", model_id, version, workdir / "step1-warm")
        if warm.loaded_bytes != warmer_bytes:
            raise ModelCacheError(f"step 1 after the warmer still loaded {warm.loaded_bytes - warmer_bytes} bytes "
                                  f"lazily: the warmer left files of {model_id} {version} cold")
    cold_left = {f"{mid} {ver}": why for (mid, ver), pub in published.items()
                 if (why := resident_problem(lambda _region: s3, bucket, region, pub)) is not None}
    if cold_left:
        raise ModelCacheError("after the warmer, not resident: " + "; ".join(f"{k}: {v}" for k, v in
                                                                              cold_left.items()))
    declared = next((e.get("weightsGib") for m in rendered.models for e in m["versions"]
                     if pc.parse_package_uri(e["package"], rendered.model_prefix)[1:] == (model_id, version)), None)
    return ModelCacheResult(model_id, version, cold_s, warmer_s, warm_s, cold_bytes, warmer_bytes,
                            markers=[f"{mid} {ver}" for mid, ver in published], weights_gib=declared)
