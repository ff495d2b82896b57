"""The pod contract (docs/architecture.md §3.10b): what the serving image and the Deployment that runs it must agree
on, stated once.

The Pulumi program (infra/serving.py, infra/storage.py), the startup procedure (serving_image/startup.py), the policy
pack, `llm-serving publish` (llm_serving/store.py) and the rehearsal (`make rehearse`) import these names; the
Dockerfile cannot import Python, so a test holds its `ENV`, `EXPOSE`, `USER` and `ENTRYPOINT` to this module.

Standard library only: both virtual environments and the bare base image (the Dockerfile's build-stage probe) can
import it.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import PurePosixPath

# -- ports (§3.2): name -> container port. The names are the Deployment's port names, probes refer to them. --------
KSERVE_HTTP_PORT_NAME = "kserve-http"
KSERVE_GRPC_PORT_NAME = "kserve-grpc"
METRICS_PORT_NAME = "metrics"
OPENAI_PORT_NAME = "openai"
PORTS: dict[str, int] = {KSERVE_HTTP_PORT_NAME: 8000, KSERVE_GRPC_PORT_NAME: 8001, METRICS_PORT_NAME: 8002,
                         OPENAI_PORT_NAME: 9000}
# Internal: Triton's metrics port, where `tritonserver --metrics-port` listens (standalone) or the process serves the
# embedded Triton's C API metrics text (openai); bound to 127.0.0.1 and read only by the metrics proxy, so it is not a
# container port.
TRITON_METRICS_PORT = 8004

# -- probes (§3.2, §3.7) ------------------------------------------------------------------------------------------
READY_PATH = "/v2/health/ready"
LIVE_PATH = "/v2/health/live"
PROBE_PORT_NAME = KSERVE_HTTP_PORT_NAME
METRICS_PATH = "/metrics"

# -- idle connections, from the client to the pod ----------------------------------------------
# Whoever closes an idle connection must be the side that would reuse it, or a request goes out on a socket the other
# side is closing (ReadError / 502). Each hop's idle timeout is therefore shorter than the next hop's keep-alive:
# Envoy (the Gateway's data plane) drops its idle upstream connections to a pod after GATEWAY_UPSTREAM_IDLE_TIMEOUT_S,
# before the pod's HTTP servers drop theirs (HTTP_KEEPALIVE_S); Envoy drops idle client connections after
# GATEWAY_CLIENT_IDLE_TIMEOUT_S, before the internal NLB in front of it forgets the flow (NLB_TCP_IDLE_TIMEOUT_S,
# fixed by AWS), so a client never writes into a flow the NLB has already dropped.
ENV_HTTP_KEEPALIVE = "LLM_SERVING_HTTP_KEEPALIVE_S"
HTTP_KEEPALIVE_S = 75
GATEWAY_UPSTREAM_IDLE_TIMEOUT_S = 60
NLB_TCP_IDLE_TIMEOUT_S = 350
GATEWAY_CLIENT_IDLE_TIMEOUT_S = 300

# -- retries at the gateway -----------------------------------------------------------------------------
# A request a pod could not serve is retried by the Gateway on another pod before the client sees a failure: a
# connection refused or reset before any answer (a pod that died or is going away) and the server-side statuses
# 500, 502, 503 and 504 (a candidate that serves errors, a pod that is not ready yet or draining). The answer is
# retried only before its first byte reaches the client (a stream is never restarted) and every retry goes to another
# pod (Envoy Gateway adds the `previous_hosts` predicate to its retry policy; HAProxy's `option redispatch 1` in the
# rehearsal). Never a 4xx: the request itself is wrong and would fail everywhere. Inference has no side effects to
# repeat; the cost of a retry is the capacity it takes, bounded by GATEWAY_RETRIES. The rollout gate still sees every
# failed attempt (Triton counts it on the pod that failed it), so a candidate that serves errors is rolled back while
# clients see none of them.
GATEWAY_RETRIES = 2
GATEWAY_RETRY_STATUS_CODES = (500, 502, 503, 504)
GATEWAY_RETRY_TRIGGERS = ("connect-failure", "reset", "retriable-status-codes")  # Envoy Gateway's RetryOn triggers

# -- caller authentication (docs/architecture.md §3.12) ------------------------------------------------------------
# Two walls: the Gateway checks every caller's key (Envoy Gateway's SecurityPolicy, apiKeyAuth) and forwards the
# request with its `Authorization: Bearer <key>` header; the model pod checks the same key again on every serving port
# (OpenAI, KServe HTTP, KServe gRPC's `authorization` metadata). The keys are one Secret per serving namespace
# (API_KEYS_SECRET), one data entry per client (the entry's name is the client id, its value the key), synced from
# AWS Secrets Manager by External Secrets (infra/gateway_auth.py); the pods mount it read-only at API_KEYS_MOUNT, one
# file per client. Health (READY_PATH, LIVE_PATH, the gRPC ServerLive/ServerReady, the OpenAI /health) and metrics
# stay open: the kubelet and Prometheus call them without a key.
ENV_API_KEYS = "LLM_SERVING_API_KEYS"  # comma-separated keys (local runs, tests)
# A file of keys (one a line, '#' comments) or a directory of them (a Secret volume: one key per file, the dot-files
# Kubernetes adds ignored). Named but missing, unreadable or holding no key: the server refuses to start.
ENV_API_KEYS_FILE = "LLM_SERVING_API_KEYS_FILE"
# "1" (the image's ENV, and every model pod's, policy serving-api-keys-required): the server refuses to start without
# a key, before any other step, and checks the keys on the KServe ports as well as the OpenAI port. "0" or unset
# (`make up` and local runs, never the image unless its runner says 0): keys, when given, are checked on the OpenAI
# port only, and no key means no authentication.
ENV_REQUIRE_API_KEYS = "LLM_SERVING_REQUIRE_API_KEYS"
API_KEYS_SECRET = "llm-serving-api-keys"
API_KEYS_VOLUME = "api-keys"
API_KEYS_MOUNT = "/etc/llm-serving/api-keys"
AUTHORIZATION_HEADER = "authorization"  # HTTP header and gRPC metadata key, "Bearer <key>"
BEARER = "Bearer"
# KServe gRPC methods answered without a key (health, as the HTTP health paths).
UNAUTHENTICATED_GRPC_METHODS = ("ServerLive", "ServerReady")


def bearer_value(key: str) -> str:
    """What a caller sends in AUTHORIZATION_HEADER."""
    return f"{BEARER} {key}"


def api_key_env(required: bool = True) -> dict[str, str]:
    """The model container's authentication environment: the Secret volume's mount, and the flag that makes the
    keys required on every serving port."""
    env = {ENV_API_KEYS_FILE: API_KEYS_MOUNT}
    if required:
        env[ENV_REQUIRE_API_KEYS] = "1"
    return env


# -- the user (non-root; above the host's system and user ranges) -------------------------------------------------
RUN_AS_UID = 10001
USER_NAME = "serving"

# -- mounts -------------------------------------------------------------------------------------------------------
MODEL_CACHE_MOUNT = "/mnt/model-cache"  # the FSx for Lustre file system's root, read-only
# Where the data repository association presents the bucket's model prefix on the file system (infra/storage.py).
FSX_MODELS_PATH = "/models"
SCRATCH_MOUNT = "/tmp"
RUN_MOUNT = "/var/run/llm-serving"  # work directory (plugins, generated Triton repository), metrics files
CACHE_MOUNT = "/var/cache/llm-serving"  # HOME and every compiler/model cache (vLLM, torch compile, Triton, HF)
SHM_MOUNT = "/dev/shm"
WORK_DIR = f"{RUN_MOUNT}/work"
# The image's WORKDIR: a writable volume's mount point itself, never a directory below one. The container runtime
# makes a missing working directory after it mounted the volumes, as root with mode 0755 (runc, measured in the
# rehearsal), so a WORKDIR of WORK_DIR left the startup (uid 10001) unable to write its own work directory; the
# volume's root exists once mounted and is the pod's (an emptyDir is world-writable). The startup makes WORK_DIR.
IMAGE_WORKDIR = RUN_MOUNT
MULTIPROC_DIR = f"{RUN_MOUNT}/prometheus"


@dataclass(frozen=True)
class Volume:
    name: str
    mount_path: str
    read_only: bool
    size_limit: str | None  # emptyDir size limit; None for the model cache and the memory-backed /dev/shm
    medium: str | None = None


MODEL_CACHE_VOLUME = "model-cache"
VOLUMES: tuple[Volume, ...] = (
    Volume(MODEL_CACHE_VOLUME, MODEL_CACHE_MOUNT, True, None),
    Volume("scratch", SCRATCH_MOUNT, False, "10Gi"),
    Volume("run", RUN_MOUNT, False, "1Gi"),
    Volume("cache", CACHE_MOUNT, False, "20Gi"),
    Volume("dshm", SHM_MOUNT, False, None, medium="Memory"),
)
WRITABLE_MOUNTS = tuple(v.mount_path for v in VOLUMES if not v.read_only)

# -- environment --------------------------------------------------------------------------------------------------
ENV_PACKAGE = "LLM_SERVING_PACKAGE"  # the package directory on the model cache, read in place
ENV_MODEL_ID = "LLM_SERVING_MODEL_ID"
ENV_MODEL_VERSION = "LLM_SERVING_MODEL_VERSION"
ENV_IO_FINGERPRINT = "LLM_SERVING_IO_FINGERPRINT"  # the stack's; startup refuses a package whose manifest differs
ENV_MODEL_CACHE = "LLM_SERVING_MODEL_CACHE"  # set: the package must be a directory below it (no tarball in a pod)
ENV_MULTIPROC_DIR = "PROMETHEUS_MULTIPROC_DIR"
ENV_RUNTIME = "LLM_SERVING_RUNTIME"
# The engine's parallel layout the stack declares for a vllm model (`models[].parallel`), as
# "tensor=<t>,pipeline=<p>,data=<d>": startup refuses a package whose [engine.parallel] differs, and a pod whose
# visible GPUs (NVIDIA_VISIBLE_DEVICES, set by the device plugin) are not t x p x d.
ENV_PARALLEL = "LLM_SERVING_PARALLEL"
PARALLEL_KEYS = ("tensor", "pipeline", "data")
# A vllm package starts one engine per task (serving_image/triton/models.py: `generate`, the pooling model of
# `embed`, the scoring model of `score`), each loading the weights on the pod's GPUs. The stack budgets each engine's
# share of the GPUs' memory (infra/model_fit.py) and renders the shares as "generate=0.45,embed=0.45"; the serving
# side writes each engine's share as its gpu_memory_utilization and refuses a package whose tasks differ.
ENV_ENGINE_MEMORY = "LLM_SERVING_ENGINE_MEMORY"
ENGINE_TASKS = ("generate", "embed", "score")
# What one engine may take of each GPU's memory (vLLM's default gpu_memory_utilization): all of a pod's engines
# together get at most this.
ENGINE_MEMORY_BUDGET = 0.9

# Every cache a library writes at start or at the first request, on the writable cache volume (the root file system
# is read-only). The startup procedure creates them.
CACHE_ENV: dict[str, str] = {
    "HOME": f"{CACHE_MOUNT}/home",
    "XDG_CACHE_HOME": f"{CACHE_MOUNT}/xdg",
    "VLLM_CACHE_ROOT": f"{CACHE_MOUNT}/vllm",
    "TORCHINDUCTOR_CACHE_DIR": f"{CACHE_MOUNT}/torchinductor",
    "TRITON_CACHE_DIR": f"{CACHE_MOUNT}/triton",
    "HF_HOME": f"{CACHE_MOUNT}/huggingface",
}
# Set by the Dockerfile (ENV) and by the Deployment alike: the pod does not depend on the image's defaults for them.
POD_ENV: dict[str, str] = {
    ENV_MULTIPROC_DIR: MULTIPROC_DIR,
    ENV_HTTP_KEEPALIVE: str(HTTP_KEEPALIVE_S),
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    **CACHE_ENV,
}
# The image's ENV: the above, what only the image knows (its engine runtime: Triton in-process), and callers' keys
# required (ENV_REQUIRE_API_KEYS): the image run without a key refuses to start rather than serve anyone.
IMAGE_ENV: dict[str, str] = {ENV_RUNTIME: "triton", ENV_REQUIRE_API_KEYS: "1", **POD_ENV}
# What the startup procedure reads from the environment of every pod (and ENV_COMPANION_PACKAGES below, on a pod
# that serves more than one package).
STARTUP_ENV = (ENV_PACKAGE, ENV_MODEL_ID, ENV_MODEL_VERSION, ENV_IO_FINGERPRINT, ENV_MODEL_CACHE, ENV_MULTIPROC_DIR)
# The other packages a pod serves on the same Triton (an ensemble's step models: a Triton ensemble only calls models
# of its own server), as package directories on the model cache joined by COMPANION_SEPARATOR, in the order of the
# ensemble's steps; set only on the Deployment of a model whose pod serves more than its own package. What the
# startup procedure's `--with-package` takes (serving_image/startup.py reads it when no --with-package is given).
ENV_COMPANION_PACKAGES = "LLM_SERVING_COMPANION_PACKAGES"
COMPANION_SEPARATOR = ":"

# Triton's own OpenTelemetry tracing in the `standalone` mode (serving_image/triton/tracing.py, docs/clients.md
# "Traces and per-stage records"): where tritonserver exports its spans (an OTLP/HTTP traces endpoint; unset: no
# tracing) and how many requests without a caller's trace context it traces too (every N-th; 0, the default: only
# those that carry a `traceparent`). Optional on any pod; the stacks render neither yet.
ENV_TRACE_OTLP_URL = "LLM_SERVING_TRACE_OTLP_URL"
ENV_TRACE_RATE = "LLM_SERVING_TRACE_RATE"

# -- the image's entrypoint ---------------------------------------------------------------------------------------
NVIDIA_ENTRYPOINT = "/opt/nvidia/nvidia_entrypoint.sh"  # driver check, CUDA forward compatibility
STARTUP_MODULE = "serving_image.startup"
# The startup procedure's command line (serving_image/startup.py parses it): its options by the StartupConfig field
# each sets, and the repeatable option naming a companion package. `startup_argv` is the one place that writes it: the
# image's ENTRYPOINT below, the local server (bench/local_server.py), the procedure's own re-execution for the
# embedded Triton and the tests.
STARTUP_OPTIONS: dict[str, str] = {
    "workdir": "--workdir", "host": "--host", "openai_port": "--openai-port",
    "kserve_http_port": "--kserve-http-port", "kserve_grpc_port": "--kserve-grpc-port",
    "metrics_port": "--metrics-port", "triton_metrics_port": "--triton-metrics-port",
}
STARTUP_COMPANION_OPTION = "--with-package"


def startup_argv(python: str | os.PathLike = "python3", package: str | os.PathLike | None = None, *,
                 companions: Iterable[str | os.PathLike] = (), **options: object) -> list[str]:
    """`<python> -m serving_image.startup [PACKAGE] [--option value ...] [--with-package COMPANION ...]`: the
    options are StartupConfig field names (STARTUP_OPTIONS), written in the order given; one set to None is left out
    (the procedure's default applies). Without a package the procedure reads ENV_PACKAGE, as in a pod."""
    unknown = sorted(set(options) - set(STARTUP_OPTIONS))
    if unknown:
        raise TypeError(f"startup_argv: no startup option for {unknown} (known: {sorted(STARTUP_OPTIONS)})")
    argv = [os.fspath(python), "-m", STARTUP_MODULE]
    if package is not None:
        argv.append(os.fspath(package))
    for name, value in options.items():
        if value is not None:
            argv += [STARTUP_OPTIONS[name], os.fspath(value) if isinstance(value, os.PathLike) else str(value)]
    for companion in companions:
        argv += [STARTUP_COMPANION_OPTION, os.fspath(companion)]
    return argv


ENTRYPOINT: tuple[str, ...] = (NVIDIA_ENTRYPOINT, *startup_argv("python3", workdir=WORK_DIR))

# -- where a published package lives (shared by `llm-serving publish` and the program) ----------------------------
PACKAGES_PREFIX = "packages"  # <store>/packages/<id>/<version>.tar.gz: the publishing format, never read by a pod
MODEL_CACHE_PREFIX = "model-cache"  # <store>/model-cache/<id>/<version>/: the package, unpacked and verified
_SEGMENT = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._+-]*$")


class PodContractError(ValueError):
    pass


def key_segment(what: str, value: str) -> str:
    if not isinstance(value, str) or not _SEGMENT.match(value) or value in (".", ".."):
        raise PodContractError(f"{what} {value!r} cannot be part of a store key (letters, digits, '.', '_', '+', "
                               f"'-', not starting with a punctuation mark)")
    return value


def model_cache_key(model_id: str, version: str) -> str:
    """The key, below a store's prefix, of the unpacked package of (model id, version): `model-cache/<id>/<version>`.
    `llm-serving publish` writes there; a stack names it; the pod reads it in place on FSx."""
    return f"{MODEL_CACHE_PREFIX}/{key_segment('model id', model_id)}/{key_segment('version', version)}"


def package_archive_key(model_id: str, version: str) -> str:
    """The key of the published archive (`packages/<id>/<version>.tar.gz`): what replication and immutability
    checks look at; pods never read it."""
    return f"{PACKAGES_PREFIX}/{key_segment('model id', model_id)}/{key_segment('version', version)}.tar.gz"


def package_uri(bucket: str, model_prefix: str, model_id: str, version: str) -> str:
    """`s3://<bucket>/<model prefix><model-cache key>/`: what a stack's `versions[].package` must say (a store
    published to `s3://<bucket>/<model prefix>` puts the package there)."""
    prefix = model_prefix.strip("/")
    return f"s3://{bucket}/{prefix + '/' if prefix else ''}{model_cache_key(model_id, version)}/"


def parse_package_uri(uri: str, model_prefix: str) -> tuple[str, str, str]:
    """(bucket, model id, package version) of a stack's `package` URI (the inverse of `package_uri`). The package's
    version may differ from the stack's version name: a new serving image rolls out as a candidate version that
    names the same package (docs/architecture.md §4)."""
    bucket, _, key = uri.removeprefix("s3://").partition("/")
    prefix = model_prefix.strip("/")
    head = f"{prefix}/{MODEL_CACHE_PREFIX}/" if prefix else f"{MODEL_CACHE_PREFIX}/"
    parts = key.removeprefix(head).rstrip("/").split("/")
    if not uri.startswith("s3://") or not key.startswith(head) or not key.endswith("/") or len(parts) != 2:
        raise PodContractError(f"{uri!r} is not a published package directory "
                               f"s3://<bucket>/{head}<model id>/<version>/")
    model_id, version = parts
    key_segment("model id", model_id)
    key_segment("version", version)
    return bucket, model_id, version


def package_path_in_pod(model_id: str, version: str) -> str:
    """Where the pod finds that package: the FSx root is mounted at MODEL_CACHE_MOUNT, the data repository
    association presents `s3://<bucket>/<model prefix>` at FSX_MODELS_PATH."""
    return str(PurePosixPath(MODEL_CACHE_MOUNT) / FSX_MODELS_PATH.lstrip("/") / model_cache_key(model_id, version))


def manifest_key(cache_uri_or_key: str) -> str:
    """The manifest's key inside a published package directory."""
    return f"{cache_uri_or_key.rstrip('/')}/package.toml"


def parallel_env_value(tensor: int, pipeline: int, data: int) -> str:
    """ENV_PARALLEL's value for a layout."""
    return ",".join(f"{k}={v}" for k, v in zip(PARALLEL_KEYS, (tensor, pipeline, data), strict=True))


def parse_parallel_env(value: str) -> dict[str, int]:
    """ENV_PARALLEL's value as {"tensor": t, "pipeline": p, "data": d}; every key exactly once, each a positive int."""
    out: dict[str, int] = {}
    for part in value.split(","):
        key, sep, number = part.strip().partition("=")
        if not sep or key not in PARALLEL_KEYS or key in out or not number.isdigit() or int(number) < 1:
            raise PodContractError(f"{ENV_PARALLEL}={value!r}: expected tensor=<n>,pipeline=<n>,data=<n> with each "
                                   f"n >= 1 (bad part {part!r})")
        out[key] = int(number)
    if set(out) != set(PARALLEL_KEYS):
        missing = ", ".join(k for k in PARALLEL_KEYS if k not in out)
        raise PodContractError(f"{ENV_PARALLEL}={value!r}: missing {missing}")
    return out


def visible_gpu_count(value: str | None) -> int | None:
    """How many GPUs NVIDIA_VISIBLE_DEVICES (set by NVIDIA's device plugin to the allocated GPUs' UUIDs or indices)
    gives the container; None when it does not list devices (unset, "all", "void", "none": nothing to compare)."""
    if value is None or value.strip().lower() in ("", "all", "void", "none"):
        return None
    return len([d for d in value.split(",") if d.strip()])


def engine_memory_shares(tasks: Iterable[str], budget: float = ENGINE_MEMORY_BUDGET) -> dict[str, float]:
    """Each task's engine's gpu_memory_utilization: equal shares of `budget`, rounded down to 1/1000 so that they
    add up to at most it."""
    tasks = list(tasks)
    unknown = [t for t in tasks if t not in ENGINE_TASKS]
    if not tasks or unknown or len(set(tasks)) != len(tasks):
        raise PodContractError(f"engine tasks {tasks}: expected each of {', '.join(ENGINE_TASKS)} at most once, at "
                               f"least one")
    share = int(budget * 1000 / len(tasks)) / 1000
    return dict.fromkeys(tasks, share)


def engine_memory_env_value(shares: dict[str, float]) -> str:
    """ENV_ENGINE_MEMORY's value for the shares."""
    return ",".join(f"{task}={share:g}" for task, share in shares.items())


def parse_engine_memory_env(value: str) -> dict[str, float]:
    """ENV_ENGINE_MEMORY's value as {task: share}: known tasks, each once, each share in (0, 1], together at most
    ENGINE_MEMORY_BUDGET (the tasks are named when they add up to more)."""
    out: dict[str, float] = {}
    for part in value.split(","):
        task, sep, number = part.strip().partition("=")
        try:
            share = float(number)
        except ValueError:
            share = 0.0
        if not sep or task not in ENGINE_TASKS or task in out or not 0 < share <= 1:
            raise PodContractError(f"{ENV_ENGINE_MEMORY}={value!r}: expected <task>=<share>,... with tasks among "
                                   f"{', '.join(ENGINE_TASKS)}, each once, and shares in (0, 1] (bad part {part!r})")
        out[task] = share
    total = sum(out.values())
    if total > ENGINE_MEMORY_BUDGET + 1e-9:
        raise PodContractError(f"{ENV_ENGINE_MEMORY}={value!r}: the engines of tasks {', '.join(out)} would take "
                               f"{total:g} of each GPU's memory together, more than the {ENGINE_MEMORY_BUDGET:g} one "
                               f"engine may take")
    return out


# The batch path: the model server's batch store (serving_image/batch/config.py) and the batch worker's Deployment
# (infra/batch.py renders it, serving_image/batch/worker.py reads it).
ENV_BATCH_STORE = "LLM_SERVING_BATCH_STORE"  # a directory or s3://bucket/prefix (llm_serving/object_store.py)
ENV_BATCH_KMS_KEY = "LLM_SERVING_BATCH_KMS_KEY_ID"  # SSE-KMS key for S3; without it SSE-S3
ENV_BATCH_WORKER_API_KEY = "LLM_SERVING_BATCH_WORKER_API_KEY"  # the worker's key for the model's front-end
ENV_BATCH_WORKER_API_KEY_FILE = "LLM_SERVING_BATCH_WORKER_API_KEY_FILE"  # the same from a file (a Secret); wins

# The model cache warmer's Job (infra/cache_warmer.py renders it, serving_image/cache_warmer.py reads it).
ENV_CACHE_BUCKET = "LLM_SERVING_CACHE_BUCKET"
ENV_CACHE_REGION = "LLM_SERVING_CACHE_REGION"
ENV_CACHE_MODEL_PREFIX = "LLM_SERVING_CACHE_MODEL_PREFIX"
ENV_CACHE_FILE_SYSTEM_ID = "LLM_SERVING_CACHE_FILE_SYSTEM_ID"
