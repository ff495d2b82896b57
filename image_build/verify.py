"""What a real deploy needs of the image, checked on the built image (the last step of `make image`), not on the
Dockerfile's text:

- its configuration (`podman image inspect`) against the pod contract: ENTRYPOINT, ENV, USER, ports, WORKDIR
  (llm_serving/dockerfile.py pod_contract_problems, the same check the unit tests run on the Dockerfile);
- run as the pod runs it (its user, a read-only root, no network): every module the startup, the servers and the
  stub's models import imports; the pins as installed (the build's probe again); the image's directories owned by
  its user; the `llm-serving` command answering; the SBOM present.
"""

from __future__ import annotations

from image_build import containers
from llm_serving import dockerfile
from llm_serving import pod_contract as pc

SBOM_PATH = "/usr/share/llm-serving/sbom.cdx.json"
# What the startup procedure and the servers it starts import (their modules import the rest), and what runs in the
# Python backend stub's process (the stand-in vllm backend's engine side, the scoring model).
MODULES = (
    "serving_image.startup",
    "serving_image.http_server",
    "serving_image.openai_api.app",
    "serving_image.metrics.proxy",
    "serving_image.batch.worker",
    "serving_image.cache_warmer",
    "serving_image.triton.embedded",
    "serving_image.triton.standalone",
    "serving_image.triton.runtime",
    "serving_image.triton_adapter.triton_model",
    "serving_image.constraints._native",
    "serving_image.constraints.vllm_processor",
    "serving_image.triton.capi._response_path",
    "serving_image.triton_stub.backends.vllm.engine_in_stub",
    "serving_image.engine.async_llm_model",
    "tritonclient.grpc",
    "tritonclient.http",
    "vllm",
)


class ImageCheckError(RuntimeError):
    pass


def run_in_image(ref: str, *command: str, env: dict[str, str] | None = None, volumes: bool = True) -> str:
    """`command` in a container of `ref` as a pod runs it: its user, a read-only root with the pod's writable volumes
    (fresh), no network."""
    argv = containers.podman("run", "--rm", "--read-only", "--read-only-tmpfs=false", "--network", "none",
                             "--user", str(pc.RUN_AS_UID), "--entrypoint", command[0])
    for volume in pc.VOLUMES if volumes else ():
        if not volume.read_only:
            argv += containers.tmpfs_argv(volume.mount_path)
    for key, value in (env or {}).items():
        argv += ["--env", f"{key}={value}"]
    try:
        done = containers.run([*argv, ref, *command[1:]])
    except containers.ContainerToolError as exc:
        raise ImageCheckError(f"in the image, {' '.join(command)[:200]} failed: {exc}") from exc
    return done.stdout


def built_image(ref: str) -> None:
    """Every check above; raises ImageCheckError naming the first thing that is wrong."""
    config = containers.inspect(ref)["Config"]
    facts = dockerfile.from_image_config(config)
    problems = dockerfile.pod_contract_problems(facts)
    if problems:
        raise ImageCheckError(f"{ref}'s configuration breaks the pod contract: " + "; ".join(problems))
    print(f"   pod contract: user {facts.user}, ENTRYPOINT {' '.join(facts.entrypoint)}, ports "
          f"{', '.join(map(str, facts.exposed))}: as llm_serving/pod_contract.py says", flush=True)
    code = f"import importlib\nfor m in {MODULES!r}:\n    importlib.import_module(m)"
    run_in_image(ref, "python3", "-c", code)
    print(f"   {len(MODULES)} modules import as uid {pc.RUN_AS_UID} on a read-only root", flush=True)
    probe = run_in_image(ref, "python3", "-m", "serving_image.triton.probe", "--runtime", "local")
    print(f"   {probe.strip()}", flush=True)
    # The image's own directories (what a pod's volumes hide; a container without them writes there).
    owners = run_in_image(ref, "stat", "-c", "%u %n", pc.MULTIPROC_DIR, pc.WORK_DIR, pc.CACHE_MOUNT,
                          volumes=False).split()
    wrong = [owners[i + 1] for i in range(0, len(owners), 2) if owners[i] != str(pc.RUN_AS_UID)]
    if wrong:
        raise ImageCheckError(f"{', '.join(wrong)} in the image are not owned by uid {pc.RUN_AS_UID}")
    run_in_image(ref, "llm-serving", "--help")
    run_in_image(ref, "test", "-s", SBOM_PATH)
    print(f"   `llm-serving --help` answers; the SBOM is at {SBOM_PATH}", flush=True)
