"""`make image-check`: the image `make image` built, run as a pod runs it, serving the demo packages
(docs/first-update.md, "The image built here").

    podman run  its user, a read-only root, no-new-privileges, the model cache mounted read-only at the pod's
                mountPath, the pod's writable volumes as fresh tmpfs, the startup reading the package from the env,
                a callers' key file mounted read-only where the pod mounts its keys' Secret
    refuses     a call without the key on each serving port (401 on 9000 and 8000, UNAUTHENTICATED on 8001): the
                image requires keys by default
    serves      the startup's steps to Ready; OpenAI on 9000 (the official `openai` client, a chat completion with
                `response_format`); KServe on 8000 (HTTP ready, generate) and 8001 (tritonclient: the LLM, the ranker
                and the ranker pipeline, an ensemble); the merged metrics on 8002 (the nv_* and vLLM families)
    stops       SIGTERM drains and exits 0 within the drain time

The packages are those `make up` serves (the demo LLM, the ranker and its pipeline), published to a local model
store under .cache/image/check/. The container runs the `local` runtime (the stand-in base has no NVIDIA vLLM
backend; compat.toml [stand_in]) and uses this machine's network (the contract's fixed ports, as `make up`).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

from image_build import containers
from image_build.build import built_ref
from image_build.containers import STATE, ContainerToolError
from llm_serving import pod_contract as pc
from llm_serving.manifest import ServingMode

NAME = "llm-serving-image-check"
CHECK_DIR = STATE / "check"
READY_TIMEOUT_S = 900  # an engine's start on this 2-core machine, Triton's and the ranker's beside it
# The Deployment's terminationGracePeriodSeconds for a model pod (infra/serving.py): what SIGTERM's drain must fit in.
DRAIN_BUDGET_S = 120


class ImageCheckFailed(RuntimeError):
    pass


def _say(text: str) -> None:
    print(f"== image-check: {text}", flush=True)


def publish_demo_packages() -> tuple[Path, Path, list[Path]]:
    """The demo LLM and its companions on a local model cache: (the cache's root, the LLM, the companions)."""
    from dev_packages.make_up import DEMO_ENGINE_ARGS, publish_for_up
    from serving_image.demo_model import DEMO_MODEL_ID, ensure_demo_model

    model_dir = ensure_demo_model(CHECK_DIR / "models" / DEMO_MODEL_ID)
    published = publish_for_up(CHECK_DIR, model_dir, DEMO_MODEL_ID, dict(DEMO_ENGINE_ARGS), ServingMode.OPENAI,
                               with_companions=True)
    return CHECK_DIR / "model-cache", published.package, list(published.companions)


def write_key(directory: Path) -> str:
    """A fresh callers' key in `directory`, one file as a Secret volume holds it (readable by the pod's user)."""
    import secrets

    directory.mkdir(parents=True, exist_ok=True)
    for old in directory.iterdir():
        old.unlink()
    key = f"image-check-{secrets.token_hex(16)}"
    (directory / "image-check").write_text(key + "\n")
    (directory / "image-check").chmod(0o444)
    return key


def run_argv(ref: str, cache: Path, package: Path, companions: list[Path], keys: Path) -> list[str]:
    """`podman run` of the image as a model pod runs it, the package read in place from the mounted cache, the
    callers' keys from a read-only directory where the pod mounts its keys' Secret."""
    from image_build.stand_in_env import IMAGE_ENV_OVERRIDES

    def inside(path: Path) -> str:
        return f"{pc.MODEL_CACHE_MOUNT}/{path.resolve().relative_to(cache.resolve()).as_posix()}"

    env = {**IMAGE_ENV_OVERRIDES, pc.ENV_PACKAGE: inside(package), pc.ENV_MODEL_CACHE: pc.MODEL_CACHE_MOUNT,
           pc.ENV_COMPANION_PACKAGES: pc.COMPANION_SEPARATOR.join(inside(c) for c in companions),
           pc.ENV_API_KEYS_FILE: pc.API_KEYS_MOUNT}  # ENV_REQUIRE_API_KEYS=1 is the image's own
    argv = containers.podman("run", "--rm", "--name", NAME, "--network", "host", "--pull", "never",
                             "--user", f"{pc.RUN_AS_UID}:{pc.RUN_AS_UID}", "--read-only", "--read-only-tmpfs=false",
                             "--security-opt", "no-new-privileges", "--stop-timeout", str(DRAIN_BUDGET_S),
                             "--mount", f"type=bind,source={cache},destination={pc.MODEL_CACHE_MOUNT},ro=true",
                             "--mount", f"type=bind,source={keys},destination={pc.API_KEYS_MOUNT},ro=true")
    for volume in pc.VOLUMES:
        if not volume.read_only:  # the pod's emptyDirs, fresh
            argv += containers.tmpfs_argv(volume.mount_path, "2g" if volume.mount_path == pc.SHM_MOUNT else None)
    for key, value in sorted(env.items()):
        argv += ["--env", f"{key}={value}"]
    return [*argv, ref]


def _get(url: str, timeout: float = 5, key: str | None = None) -> tuple[int, str]:
    request = urllib.request.Request(url, headers={pc.AUTHORIZATION_HEADER: pc.bearer_value(key)} if key else {})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:  # noqa: S310 (localhost)
            return response.status, response.read().decode()
    except urllib.error.HTTPError as err:
        return err.code, err.read().decode(errors="replace")
    except (urllib.error.URLError, OSError) as err:
        return 0, str(err)


def wait_ready(container: subprocess.Popen, log: Path) -> float:
    started = time.monotonic()
    while time.monotonic() - started < READY_TIMEOUT_S:
        if container.poll() is not None:
            raise ImageCheckFailed(f"the container exited ({container.returncode}) before it was ready; its log's "
                                   f"end:\n{''.join(log.read_text().splitlines(keepends=True)[-30:])}")
        status, _ = _get(f"http://127.0.0.1:{pc.PORTS[pc.KSERVE_HTTP_PORT_NAME]}{pc.READY_PATH}", timeout=2)
        if status == 200:
            return time.monotonic() - started
        time.sleep(1)  # polling a readiness endpoint, as the kubelet's probe does
    raise ImageCheckFailed(f"not ready on {pc.READY_PATH} within {READY_TIMEOUT_S} s (log: {log})")


def check_refused_without_key(model: str) -> str:
    """A call without the key on each serving port is refused; the line to print."""
    import tritonclient.grpc as grpcclient
    from tritonclient.utils import InferenceServerException

    outcomes = []
    for port_name, path in ((pc.OPENAI_PORT_NAME, "/v1/models"), (pc.KSERVE_HTTP_PORT_NAME, f"/v2/models/{model}")):
        status, body = _get(f"http://127.0.0.1:{pc.PORTS[port_name]}{path}")
        if status != 401:
            raise ImageCheckFailed(f"{pc.PORTS[port_name]}: {path} without a key answered {status}, not 401: "
                                   f"{body[:200]}")
        outcomes.append(f"{pc.PORTS[port_name]} 401")
    grpc = grpcclient.InferenceServerClient(f"127.0.0.1:{pc.PORTS[pc.KSERVE_GRPC_PORT_NAME]}")
    try:
        grpc.get_model_metadata(model)
    except InferenceServerException as exc:
        if "UNAUTHENTICATED" not in str(exc.status()):
            raise ImageCheckFailed(f"{pc.PORTS[pc.KSERVE_GRPC_PORT_NAME]}: without a key: {exc}") from exc
        outcomes.append(f"{pc.PORTS[pc.KSERVE_GRPC_PORT_NAME]} UNAUTHENTICATED")
    else:
        raise ImageCheckFailed(f"{pc.PORTS[pc.KSERVE_GRPC_PORT_NAME]}: model metadata served without a key")
    return f"without the key: {', '.join(outcomes)}"


def check_serving(model: str, companions: list[str], key: str) -> list[str]:
    """Each port answering a caller with the key; the lines to print."""
    import numpy as np
    import openai
    import tritonclient.grpc as grpcclient

    lines = []
    headers = {pc.AUTHORIZATION_HEADER: pc.bearer_value(key)}
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{pc.PORTS[pc.OPENAI_PORT_NAME]}/v1", api_key=key,
                           max_retries=0, timeout=120)
    schema = {"type": "object", "properties": {"greeting": {"type": "string", "maxLength": 20}},
              "required": ["greeting"]}
    chat = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "Say hello"}], max_tokens=32,
        response_format={"type": "json_schema", "json_schema": {"name": "greeting", "schema": schema}})
    answer = json.loads(chat.choices[0].message.content)
    if not isinstance(answer.get("greeting"), str):
        raise ImageCheckFailed(f"OpenAI 9000: the chat answer does not follow its schema: {answer}")
    lines.append(f"OpenAI 9000: chat completion with response_format, {chat.usage.completion_tokens} tokens, "
                 "schema-valid")
    status, body = _get(f"http://127.0.0.1:{pc.PORTS[pc.KSERVE_HTTP_PORT_NAME]}/v2/models/{model}", key=key)
    if status != 200:
        raise ImageCheckFailed(f"KServe HTTP 8000: /v2/models/{model} answered {status}: {body[:300]}")
    lines.append(f"KServe HTTP 8000: /v2/models/{model} metadata")
    grpc = grpcclient.InferenceServerClient(f"127.0.0.1:{pc.PORTS[pc.KSERVE_GRPC_PORT_NAME]}")
    served = sorted(m.name for m in grpc.get_model_repository_index(headers=headers).models)
    for name in [model, *companions]:
        if not grpc.is_model_ready(name, headers=headers):
            raise ImageCheckFailed(f"KServe gRPC 8001: {name} is not ready (served: {served})")
    ranked = []
    for name in companions:
        metadata = grpc.get_model_metadata(name, headers=headers)
        inputs = []
        for tensor in metadata.inputs:
            if tensor.datatype != "FP32":
                continue
            shape = [1 if d < 0 else d for d in tensor.shape]
            data = np.full(shape, 0.5, dtype=np.float32)
            item = grpcclient.InferInput(tensor.name, shape, "FP32")
            item.set_data_from_numpy(data)
            inputs.append(item)
        if len(inputs) != len(metadata.inputs):
            continue  # a model whose inputs are not all FP32 (none of the demo's)
        result = grpc.infer(name, inputs, headers=headers)
        ranked.append(f"{name} -> {', '.join(o.name for o in metadata.outputs)} "
                      f"{[result.as_numpy(o.name).ravel()[:1].tolist() for o in metadata.outputs]}")
    if len(ranked) != len(companions):
        raise ImageCheckFailed(f"KServe gRPC 8001: answered {len(ranked)} of the companions {companions}")
    lines.append(f"KServe gRPC 8001: {', '.join(ranked)}")
    status, metrics = _get(f"http://127.0.0.1:{pc.PORTS[pc.METRICS_PORT_NAME]}{pc.METRICS_PATH}")
    families = [f for f in ("nv_inference_count", "vllm:") if f in metrics]
    if status != 200 or len(families) != 2:
        raise ImageCheckFailed(f"metrics 8002: status {status}, families {families} of nv_inference_count, vllm:")
    lines.append("metrics 8002: Triton's nv_* and vLLM's families merged")
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="llm-serving image check", description=__doc__.splitlines()[0])
    parser.parse_args(argv)
    container = None
    try:
        ref = built_ref()
        cache, package, companions = publish_demo_packages()
        keys = CHECK_DIR / "api-keys"
        key = write_key(keys)
        # <model cache>/<id>/<version>/ (pod_contract.MODEL_CACHE_PREFIX's layout)
        model, companion_ids = package.parent.name, [c.parent.name for c in companions]
        log = STATE / "image-check.log"
        subprocess.run(containers.podman("rm", "--force", "--ignore", NAME), capture_output=True,
                       env=containers.environment())
        _say(f"podman run {ref} as uid {pc.RUN_AS_UID}, read-only root, the model cache read-only "
             f"(log: {log})")
        with open(log, "w") as out:
            container = subprocess.Popen(run_argv(ref, cache, package, companions, keys), stdout=out,
                                         stderr=subprocess.STDOUT, env=containers.environment())
        ready_s = wait_ready(container, log)
        _say(f"ready in {ready_s:.0f} s: {model} with {', '.join(companion_ids)}")
        _say(check_refused_without_key(model))
        for line in check_serving(model, companion_ids, key):
            _say(line)
        _say("SIGTERM")
        t0 = time.monotonic()
        subprocess.run(containers.podman("kill", "--signal", "TERM", NAME), check=True, capture_output=True,
                       env=containers.environment())
        status = container.wait(timeout=DRAIN_BUDGET_S + 30)
        drained_s = time.monotonic() - t0
        if status != 0 or drained_s > DRAIN_BUDGET_S:
            raise ImageCheckFailed(f"after SIGTERM the container exited {status} in {drained_s:.1f} s (expected 0 "
                                   f"within {DRAIN_BUDGET_S} s)")
        _say(f"drained and exited 0 in {drained_s:.1f} s after SIGTERM (budget {DRAIN_BUDGET_S} s)")
    except (ImageCheckFailed, ContainerToolError, subprocess.SubprocessError) as exc:
        print(f"image-check: FAILED: {exc}", file=sys.stderr)
        return 1
    except Exception as exc:  # a client's error while serving: the check failed, named
        print(f"image-check: FAILED: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    finally:
        if container is not None and container.poll() is None:
            subprocess.run(containers.podman("rm", "--force", NAME), capture_output=True,
                           env=containers.environment())
    _say("passed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
