"""The startup procedure (docs/architecture.md §3.7): the image's entrypoint, and what `make up` runs.

    1 unpack-and-verify   open the model package, verify the manifest and every checksum (§3.4); the big safetensors
                          files' checksums are computed beside step 4, which reads the same bytes, and readiness
                          (step 5) waits for them: a mismatch still fails step 1, naming the file
    2 install-plugins     install the package's plugin wheels; vLLM finds them through their entry points
    3 clear-metrics-dir   empty PROMETHEUS_MULTIPROC_DIR (stale .db files from a previous process corrupt counters)
    4 start-engine        start the engine and wait until it reports ready
    5 open-ports          only now: the front-ends and the metrics proxy start listening

Each step logs its duration. A failing step logs its name and the cause and exits with status 10 + its number, so
the orchestrator (and a person reading `kubectl logs`) sees where it stopped. After startup the process serves until
SIGINT/SIGTERM (exit 0, after draining) or until the engine dies (exit 1: readiness turns false first and every
in-flight caller gets an error, then Kubernetes restarts the container).
"""

from __future__ import annotations

import argparse
import asyncio
import importlib
import importlib.metadata
import logging
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path

from packaging.requirements import InvalidRequirement, Requirement

from llm_serving import pod_contract as pc
from llm_serving.manifest import Backend
from llm_serving.package import (
    ChecksumsCancelled,
    PackageError,
    PendingChecksums,
    VerifiedPackage,
    check_python_dependencies,
    open_package,
)
from serving_image.cpu_placement import (
    ENV_FRONT_PLACEMENT,
    describe,
    keep_front_off_engine_cores,
    placement_mode,
    remember_engine_cpus,
)
from serving_image.descendants import adopt_orphans, kill_descendants

log = logging.getLogger("llm_serving.startup")

OPENAI_PORT = pc.PORTS[pc.OPENAI_PORT_NAME]
PLUGIN_GROUPS = ("vllm.general_plugins", "vllm.logits_processors")
_PROTECTED_TOP_LEVEL = ("vllm", "torch", "tritonserver")
ENGINE_WATCH_INTERVAL_S = 0.5


class StartupError(RuntimeError):
    def __init__(self, step: str, number: int, cause: str):
        super().__init__(f"startup failed at step {number} '{step}': {cause}")
        self.step = step
        self.number = number
        self.cause = cause

    @property
    def exit_code(self) -> int:
        return 10 + self.number


@dataclass
class StartupConfig:
    package: Path  # a package directory (the model cache) or a .tar.gz
    workdir: Path  # unpacked tarballs and installed plugins go here
    host: str = "0.0.0.0"
    openai_port: int = OPENAI_PORT
    kserve_http_port: int = pc.PORTS[pc.KSERVE_HTTP_PORT_NAME]
    kserve_grpc_port: int = pc.PORTS[pc.KSERVE_GRPC_PORT_NAME]
    metrics_port: int = pc.PORTS[pc.METRICS_PORT_NAME]
    triton_metrics_port: int = pc.TRITON_METRICS_PORT
    multiproc_dir: Path | None = None  # default: $PROMETHEUS_MULTIPROC_DIR, else <workdir>/prometheus
    engine_overrides: dict = field(default_factory=dict)  # local runs only (e.g. a smaller KV cache in tests)
    # Packages the same Triton serves beside `package` (standalone mode only): e.g. the LLM that a Python-backend
    # model calls through business-logic scripting (BLS), which must be a model of the same server.
    companions: list[Path] = field(default_factory=list)
    # After SIGTERM, readiness is false and new requests get 503 for this long before the listeners close, so the
    # load balancer stops sending traffic first (Kubernetes removes endpoints asynchronously). SIGINT skips it.
    drain_delay_s: float = field(default_factory=lambda: float(os.environ.get("LLM_SERVING_DRAIN_DELAY_S", "5")))
    # What the Deployment says the package is (docs/architecture.md §3.10b; None outside a pod): step 1 refuses a
    # package whose manifest differs, naming both values.
    expected: PodExpectation | None = None
    # Whether the serving processes move off the cores vLLM's CPU worker bound itself to once startup is complete
    # (cpu_placement.py): `auto` or `off`, from $LLM_SERVING_FRONT_PLACEMENT.
    front_placement: str = field(default_factory=lambda: os.environ.get(ENV_FRONT_PLACEMENT, "auto"))


@dataclass(frozen=True)
class PodExpectation:
    """The pod contract's view of the package, from the Deployment's env (`from_env`)."""

    model_id: str | None = None
    version: str | None = None
    io_fingerprint: str | None = None
    model_cache: Path | None = None  # set: the package is read in place, a directory below it
    # The stack's declared engine layout (pc.ENV_PARALLEL: {"tensor", "pipeline", "data"}) and the GPUs the device
    # plugin gave the container (NVIDIA_VISIBLE_DEVICES; None when it lists none).
    parallel: dict[str, int] | None = None
    visible_gpus: int | None = None

    @classmethod
    def from_env(cls, env: dict[str, str] | None = None) -> PodExpectation | None:
        env = os.environ if env is None else env
        values = {k: env.get(k) or None for k in (pc.ENV_MODEL_ID, pc.ENV_MODEL_VERSION, pc.ENV_IO_FINGERPRINT,
                                                  pc.ENV_MODEL_CACHE, pc.ENV_PARALLEL)}
        if not any(values.values()):
            return None
        cache = values[pc.ENV_MODEL_CACHE]
        parallel = values[pc.ENV_PARALLEL]
        return cls(values[pc.ENV_MODEL_ID], values[pc.ENV_MODEL_VERSION], values[pc.ENV_IO_FINGERPRINT],
                   Path(cache) if cache else None,
                   pc.parse_parallel_env(parallel) if parallel else None,
                   pc.visible_gpu_count(env.get("NVIDIA_VISIBLE_DEVICES")))

    def check_location(self, package: Path) -> None:
        """Before anything is read: in a pod the package is the published directory on the model cache."""
        if self.model_cache is None:
            return
        if not package.is_dir():
            raise RuntimeError(f"{pc.ENV_PACKAGE}={package} is not a directory: in a pod the package is read in place "
                               f"from the model cache ({pc.ENV_MODEL_CACHE}={self.model_cache}); a tarball is only "
                               "a publishing format")
        if not package.resolve().is_relative_to(self.model_cache.resolve()):
            raise RuntimeError(f"{pc.ENV_PACKAGE}={package} is not below the model cache "
                               f"{pc.ENV_MODEL_CACHE}={self.model_cache}")

    def check_manifest(self, package: VerifiedPackage) -> None:
        ident = package.manifest.model
        for env, what, expected, actual in (
                (pc.ENV_MODEL_ID, "model.id", self.model_id, ident.id),
                (pc.ENV_MODEL_VERSION, "model.version", self.version, ident.version),
                (pc.ENV_IO_FINGERPRINT, "model.io_fingerprint", self.io_fingerprint, ident.io_fingerprint)):
            if expected is not None and expected != actual:
                raise RuntimeError(f"the Deployment's {env}={expected} differs from the published manifest's "
                                   f"{what} {actual} ({package.root}); refusing to serve it")
        self.check_parallel(package)

    def check_parallel(self, package: VerifiedPackage) -> None:
        """The engine layout the stack declared is the package's [engine.parallel], and it uses exactly the GPUs the
        pod was given: a TP-8 package on a 1-GPU pod fails here with both values, not inside vLLM's load."""
        engine = package.manifest.engine
        if engine is None:
            if self.parallel is not None:
                raise RuntimeError(f"the Deployment sets {pc.ENV_PARALLEL}, but {package.root} is a "
                                   f"{package.manifest.model.backend} package without an engine")
            return
        stated = engine.parallel
        if self.parallel is not None and self.parallel != stated.model_dump():
            raise RuntimeError(f"the Deployment's {pc.ENV_PARALLEL}={pc.parallel_env_value(**self.parallel)} "
                               f"differs from the published manifest's engine.parallel ({stated.describe()}, "
                               f"{package.root}); refusing to serve it")
        if self.visible_gpus is not None and self.visible_gpus != stated.gpus:
            raise RuntimeError(f"the package's engine.parallel is {stated.describe()}, but the pod sees "
                               f"{self.visible_gpus} GPU(s) (NVIDIA_VISIBLE_DEVICES); vLLM would fail to start or "
                               f"leave GPUs idle")


@dataclass
class StepTiming:
    name: str
    seconds: float
    detail: str


@dataclass
class Started:
    """What the procedure brought up; `serve_until_stopped` runs it, `close` tears it down."""

    package: VerifiedPackage
    served_model: object  # what step 4 returned: the embedded Triton (EmbeddedTritonModel) or tritonserver
    timings: list[StepTiming]
    companions: list[VerifiedPackage] = field(default_factory=list)
    servers: list = field(default_factory=list)  # objects with .stop() (threads) or uvicorn servers
    uvicorn_servers: list = field(default_factory=list)
    grpc_servers: list = field(default_factory=list)  # KServe gRPC servers (stopped with a grace period)
    tasks: list = field(default_factory=list)
    draining: bool = False


STEPS = ("unpack-and-verify", "install-plugins", "clear-metrics-dir", "start-engine", "open-ports")


async def _run_step(number: int, timings: list[StepTiming], fn: Callable[[], Awaitable[str] | str]) -> object:
    name = STEPS[number - 1]
    log.info("startup step %d/%d %s: starting", number, len(STEPS), name)
    started = time.perf_counter()
    try:
        result = fn()
        if asyncio.iscoroutine(result):
            result = await result
    except StartupError:
        raise
    except Exception as exc:  # every failure of a step is reported as that step's failure, with its cause
        raise StartupError(name, number, f"{type(exc).__name__}: {exc}") from exc
    seconds = time.perf_counter() - started
    detail, value = result if isinstance(result, tuple) else (str(result), None)
    timings.append(StepTiming(name, seconds, detail))
    log.info("startup step %d/%d %s: done in %.2fs (%s)", number, len(STEPS), name, seconds, detail)
    return value


def _unpack(config: StartupConfig, defer_data: bool = False) -> tuple[str, list[VerifiedPackage]]:
    """Step 1. With `defer_data` (the procedure's own run) each package's big safetensors files are checked for
    completeness here and left in its `pending` for _Checksums; without, every file is hashed here."""
    if config.expected is not None:
        config.expected.check_location(Path(config.package))
    packages = [open_package(path, config.workdir / "packages", defer_data=defer_data)
                for path in (config.package, *config.companions)]
    if config.expected is not None:
        config.expected.check_manifest(packages[0])
    for package in packages:  # after the identity checks: a package that is not the Deployment's is named so first
        package.pending.check_complete()
    details = [f"{p.manifest.model.id} {p.manifest.model.version}, backend {p.manifest.model.backend}, "
               f"{len(p.manifest.files) - len(p.pending.files)} files verified" +
               (f", {len(p.pending.files)} data file(s) ({p.pending.bytes / 2**30:.2f} GiB) complete, their checksums "
                "computed while the engine loads them" if p.pending.files else "") for p in packages]
    # Every Python-backend package's [python] dependencies, the companions' too, are met by this runtime's stub
    # (compat.toml: [triton.stub] in the image, [local.triton] here) or by its own execution environment: refused
    # here, naming the distribution, rather than failing at `import` inside Triton after the pod was scheduled.
    from serving_image.triton.runtime import runtime

    details += [line for p in packages if (line := check_python_dependencies(p, runtime()))]
    return "; ".join(details), packages


CHECKSUM_THREADS = max(1, min(8, (os.cpu_count() or 1) // 4))


class _Checksums:
    """The deferred half of step 1: the data files' SHA-256, computed on threads of their own while steps 2-4 run
    (the engine reads the same files then, so on a cold cache the bytes come off the disk once, and the hashing
    overlaps the engine's start instead of preceding it). The hashing runs in a process of its own at nice 19 while
    the engine starts: on a node short of cores the engine keeps nearly all of the CPUs (bench.startup), yet the
    hashing never starves, and being another process it never holds this one's GIL. Once the engine is ready
    (`hurry`), what is left is hashed at the server's own priority: readiness waits for it.
    `result` is awaited before step 5: the ports open, and readiness turns true, only once every file matched."""

    def __init__(self, packages: list[VerifiedPackage], on_failure: Callable[[StartupError], None] | None = None):
        self.pending = PendingChecksums(tuple(f for p in packages for f in p.pending.files))
        self.stop = threading.Event()
        self.hurry = threading.Event()
        self.error: PackageError | None = None
        # Called from the checking thread with step 1's failure while steps 2-4 still run (None once they are done:
        # then `result` reports it); the entrypoint's exits at once instead of finishing the engine's start first.
        self.on_failure = on_failure
        self.seconds = 0.0
        self.done = threading.Event()
        self._thread = threading.Thread(target=self._run, name="package-checksums", daemon=True)
        if self.pending.files:
            self._thread.start()
        else:
            self.done.set()

    def _run(self) -> None:
        started = time.perf_counter()
        try:
            self.pending.verify(CHECKSUM_THREADS, self.stop, low_priority=True, hurry=self.hurry)
        except ChecksumsCancelled:
            pass
        except PackageError as exc:
            self.error = exc
        except Exception as exc:  # anything else unexpected in the check: fail closed, naming it
            self.error = PackageError(f"checksum verification failed: {type(exc).__name__}: {exc}")
        finally:
            self.seconds = time.perf_counter() - started
            self.done.set()
        if self.error is not None:
            log.error("startup step 1/%d %s: %s; this server will not become ready", len(STEPS), STEPS[0], self.error)
            if (on_failure := self.on_failure) is not None:
                on_failure(self.failure())

    def failure(self) -> StartupError | None:
        """Step 1's failure if the check has already failed (it does not wait)."""
        if self.done.is_set() and self.error is not None:
            return StartupError(STEPS[0], 1, f"PackageError: {self.error}")
        return None

    def cancel(self) -> None:
        self.stop.set()

    async def result(self) -> None:
        """Wait for the check; raise step 1's StartupError naming the file when a checksum differs."""
        waited = time.perf_counter()
        while not self.done.is_set():
            await asyncio.to_thread(self.done.wait, 0.5)
        if (failure := self.failure()) is not None:
            raise failure
        if self.pending.files:
            log.info("startup step 1/%d %s: data files' checksums verified (%d files, %.2f GiB) in %.2fs beside the "
                     "engine's start; waited %.2fs after the engine", len(STEPS), STEPS[0], len(self.pending.files),
                     self.pending.bytes / 2**30, self.seconds, time.perf_counter() - waited)


def _exit_refused(failure: StartupError) -> None:
    """The entrypoint's answer to a package refused while the engine was still starting: log the failure as any
    step's, kill what the procedure started (Triton's stubs, vLLM's engine processes) and exit with step 1's status
    now, rather than after a start whose result will never serve."""
    log.error("%s", failure)
    kill_descendants()
    logging.shutdown()
    os._exit(failure.exit_code)


def _install_plugins(packages: list[VerifiedPackage], config: StartupConfig) -> str:
    wheels = [package.root / plugin.wheel for package in packages for plugin in package.manifest.plugins]
    if not wheels:
        return "no plugins"
    target = config.workdir / "plugins"
    target.mkdir(parents=True, exist_ok=True)
    # --no-deps --no-index: nothing is downloaded at start, and nothing the image fixes (vllm, torch) can be
    # replaced; the plugins' own requirements are checked against what is installed below instead.
    subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-index", "--upgrade",
                    "--target", str(target), *map(str, wheels)], check=True, capture_output=True, text=True)
    for name in _PROTECTED_TOP_LEVEL:
        if (target / name).exists():
            raise RuntimeError(f"a plugin installed '{name}', whose version is fixed by the image")
    for path in (str(target),):
        if path not in sys.path:
            sys.path.insert(0, path)
    # vLLM starts its engine core in spawned processes: they find the plugins through PYTHONPATH.
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(target), os.environ.get("PYTHONPATH")) if p)
    importlib.invalidate_caches()
    names = []
    for dist in importlib.metadata.distributions(path=[str(target)]):
        for requirement in dist.requires or []:
            _check_requirement(dist.metadata["Name"], requirement)
        names.append(f"{dist.metadata['Name']} {dist.version}")
    points = [f"{ep.group}:{ep.name}" for group in PLUGIN_GROUPS
              for ep in importlib.metadata.entry_points(group=group)]
    return f"installed {', '.join(sorted(names))}; entry points: {', '.join(points) or 'none'}"


def _check_requirement(owner: str, text: str) -> None:
    try:
        requirement = Requirement(text)
    except InvalidRequirement as exc:
        raise RuntimeError(f"plugin {owner}: invalid requirement {text!r}") from exc
    if requirement.marker is not None and not requirement.marker.evaluate({"extra": ""}):
        return
    try:
        installed = importlib.metadata.version(requirement.name)
    except importlib.metadata.PackageNotFoundError:
        raise RuntimeError(f"plugin {owner} requires {text}, which the image does not have") from None
    if requirement.specifier and not requirement.specifier.contains(installed, prereleases=True):
        raise RuntimeError(f"plugin {owner} requires {text}; the image has {requirement.name} {installed}")


def _resolve_multiproc_dir(config: StartupConfig) -> Path:
    """Fix PROMETHEUS_MULTIPROC_DIR before anything imports prometheus_client: it picks its storage at import."""
    directory = Path(config.multiproc_dir or os.environ.get("PROMETHEUS_MULTIPROC_DIR")
                     or config.workdir / "prometheus")
    os.environ["PROMETHEUS_MULTIPROC_DIR"] = str(directory)
    config.multiproc_dir = directory
    return directory


def _clear_metrics_dir(config: StartupConfig) -> str:
    directory = Path(config.multiproc_dir)
    directory.mkdir(parents=True, exist_ok=True)
    from prometheus_client import values

    if values.ValueClass.__name__ != "MmapedValue":
        raise RuntimeError("prometheus_client was imported before PROMETHEUS_MULTIPROC_DIR was set: vLLM's metrics "
                           "would stay in memory and never reach the metrics proxy")
    from serving_image.metrics.multiproc import clear_multiproc_dir

    removed = clear_multiproc_dir(directory)
    return f"{directory}: removed {removed} stale file(s)"


async def _start_engine(packages: list[VerifiedPackage], config: StartupConfig):
    package = packages[0]
    manifest = package.manifest
    from serving_image.triton.runtime import check_pins, is_standalone, runtime, start_standalone_triton
    from serving_image.triton_adapter.triton_model import start_embedded_triton_model

    pins = check_pins()  # the vLLM here must be compat.toml's, before anything is loaded (§3.9)
    where = "image" if runtime() == "triton" else "local"
    if is_standalone(package):
        # tritonserver alone on the KServe ports: the image's, or the local one with the stand-in vllm backend. Its
        # gRPC port opens only once the model is loaded (serving_image/triton/standalone.py).
        triton = await start_standalone_triton(packages, config.workdir, http_port=config.kserve_http_port,
                                               grpc_port=config.kserve_grpc_port,
                                               metrics_port=config.triton_metrics_port, host=config.host,
                                               engine_overrides=config.engine_overrides)
        served = ", ".join(f"{p.manifest.model.id} {p.manifest.model.version} ({p.manifest.model.backend})"
                           for p in packages)
        return f"{pins}; Triton {triton.server_version} ({where}) ready: {served}", triton
    if manifest.model.backend is not Backend.VLLM:
        # Python-backend models run in Triton's Python backend, which this project serves in the standalone mode.
        raise RuntimeError(f"a {manifest.model.backend}-backend package is served by Triton in the standalone serving "
                           "mode; package it with --serving-mode standalone")
    args = {**manifest.engine.args, **config.engine_overrides}
    # Triton embedded in this process (openai mode): every task through it, embeddings and scoring by the package's
    # pooling and scoring models beside the LLM (serving_image/triton/models.py), loaded with it
    model = await start_embedded_triton_model(package, config.workdir, int(args.get("max_model_len", 4096)),
                                              config.engine_overrides, companions=packages[1:])
    return (f"{pins}; Triton {model.triton.server_version} ({where}) embedded in this process, ready: "
            f"{model.info.name} {model.info.version}, Triton models {', '.join(model.triton.models)}"), model


def _uvicorn_server(app, host: str, port: int):
    """uvicorn's server without its own signal handling: the procedure owns SIGINT/SIGTERM (drain first)."""
    from serving_image.http_server import uvicorn_server

    return uvicorn_server(app, host, port)


async def _open_ports(started: Started, config: StartupConfig) -> str:
    from serving_image.metrics.proxy import ProxyConfig, start_proxy
    from serving_image.openai_api.admission import APIConfig
    from serving_image.openai_api.app import create_app

    api_config = APIConfig.from_env()  # a bad LLM_SERVING_* value fails this step, naming the variable
    from serving_image.triton.runtime import is_standalone

    if is_standalone(started.package):
        # Triton alone: its own KServe ports are already up (step 4) and this project's KServe front-ends stay off;
        # the proxy merges Triton's metrics (its internal port) with vLLM's multiprocess files.
        proxy = start_proxy(ProxyConfig(multiproc_dir=config.multiproc_dir, host=config.host, port=config.metrics_port,
                                        upstream_url=f"http://127.0.0.1:{config.triton_metrics_port}/metrics"))
        started.servers.append(proxy)
        return (f"serving mode standalone: Triton's KServe HTTP :{config.kserve_http_port} gRPC "
                f":{config.kserve_grpc_port}, metrics :{proxy.port} (Triton's :{config.triton_metrics_port}); "
                "no OpenAI front-end")

    # Triton counts every request itself (nv_*, the OpenAI front-end's too): its C API's metrics are the upstream
    from serving_image.metrics.frontend import serve_exposition

    triton = started.served_model.triton  # Triton in this process (EmbeddedTritonModel)
    triton_metrics = serve_exposition(triton.metrics_text, port=config.triton_metrics_port)
    started.servers.append(triton_metrics)
    proxy = start_proxy(ProxyConfig(multiproc_dir=config.multiproc_dir, upstream_url=triton_metrics.url,
                                    host=config.host, port=config.metrics_port))
    started.servers.append(proxy)
    from serving_image.kserve.frontends import start_kserve

    # `openai` mode: the OpenAI front-end and the KServe v2 front-ends over the same embedded Triton.
    # The keys on the KServe ports too where they are required (every model pod, pc.ENV_REQUIRE_API_KEYS).
    kserve = await start_kserve(triton, host=config.host, grpc_port=config.kserve_grpc_port,
                                http_port=config.kserve_http_port, is_draining=lambda: started.draining,
                                api_keys=api_config.api_keys if api_config.required else ())
    started.grpc_servers.append(kserve.grpc_server)
    started.uvicorn_servers.append(kserve.http_server)
    started.tasks.append(kserve.http_task)
    kserve_detail = f"KServe HTTP :{config.kserve_http_port} gRPC :{kserve.grpc_port}"
    from serving_image.batch.api import mounted
    from serving_image.batch.config import BatchConfig

    batch_config = BatchConfig.from_env()  # the Batch API (docs/batch.md): on when LLM_SERVING_BATCH_STORE is set
    app = create_app(started.served_model, is_draining=lambda: started.draining, config=api_config,
                     extensions=() if batch_config is None else (mounted(batch_config),))
    openai_server = _uvicorn_server(app, config.host, config.openai_port)
    started.uvicorn_servers.append(openai_server)
    task = asyncio.create_task(openai_server.serve(), name="openai-http")
    while not openai_server.started:
        if task.done():
            task.result()  # raises the bind error (port in use, ...)
            raise RuntimeError(f"OpenAI front-end stopped before listening on {config.openai_port}")
        await asyncio.sleep(0.02)
    started.tasks.append(task)
    return (f"serving mode openai: OpenAI :{config.openai_port}, {kserve_detail}, metrics :{proxy.port} "
            f"(Triton's :{triton_metrics.port})")


def _make_cache_dirs() -> None:
    """The pod contract's caches (HOME, vLLM, torch compile, Triton, Hugging Face) live on a writable volume whose
    directories start empty: create those the environment names."""
    for name in pc.CACHE_ENV:
        value = os.environ.get(name)
        if value:
            Path(value).mkdir(parents=True, exist_ok=True)


async def start(config: StartupConfig, *, exit_on_refusal: bool = False) -> Started:
    """The five steps. `exit_on_refusal` (the entrypoint's): a data file whose checksum fails while steps 2-4 run ends
    the process at once with step 1's status (_exit_refused); otherwise the failure is raised before step 5."""
    timings: list[StepTiming] = []
    config.workdir.mkdir(parents=True, exist_ok=True)
    _make_cache_dirs()
    _resolve_multiproc_dir(config)
    packages = await _run_step(1, timings, lambda: _unpack(config, defer_data=True))
    checksums = _Checksums(packages, _exit_refused if exit_on_refusal else None)
    try:
        await _run_step(2, timings, lambda: _install_plugins(packages, config))
        await _run_step(3, timings, lambda: _clear_metrics_dir(config))
        served_model = await _run_step(4, timings, lambda: _start_engine(packages, config))
        checksums.on_failure = None  # from here on `result` reports it, and closing the engine is the way out
        checksums.hurry.set()  # only the hashing is left before readiness: it no longer yields the CPUs
    except BaseException as exc:
        checksums.cancel()
        # A package whose checksum already failed is the cause to report, not what a later step made of it.
        failure = checksums.failure()
        if failure is not None and isinstance(exc, StartupError):
            raise failure from exc
        raise
    started = Started(package=packages[0], served_model=served_model, timings=timings, companions=packages[1:])
    try:
        await checksums.result()  # readiness is held until every data file matched (§3.7 step 1)
        await _run_step(5, timings, lambda: _open_ports(started, config))
    except BaseException:
        checksums.cancel()
        await close(started)
        raise
    total = sum(t.seconds for t in timings)
    log.info("startup complete in %.2fs: %s", total, ", ".join(f"{t.name} {t.seconds:.2f}s" for t in timings))
    return started


async def close(started: Started) -> None:
    for server in started.uvicorn_servers:
        server.should_exit = True
    for grpc_server in started.grpc_servers:
        await grpc_server.stop(30)  # in-flight calls get up to 30 s, new ones are refused
    for task in started.tasks:
        try:
            await asyncio.wait_for(task, timeout=35)
        except Exception as exc:  # shutting down: report, keep tearing down the rest
            log.warning("front-end did not stop cleanly: %r", exc)
    for server in started.servers:
        server.stop()
    await started.served_model.shutdown()


async def serve_until_stopped(started: Started, drain_delay_s: float = 0.0,
                              settle: Callable[[], None] | None = None) -> int:
    """Serve until SIGINT/SIGTERM (returns 0) or until the engine dies (returns 1). `settle` runs once the signal
    handlers are in place: the ports are open already, so a SIGTERM that comes while it runs must drain, not kill."""
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    reason: list[str] = []

    signals_seen: list[int] = []

    def on_signal(signum: int) -> None:
        signals_seen.append(signum)
        if not stop.is_set():
            log.info("%s received: draining, readiness is now false", signal.Signals(signum).name)
            started.draining = True
            reason.append("signal")
            stop.set()

    for signum in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(signum, on_signal, signum)
    if settle is not None:
        settle()  # a signal meanwhile is handled (on_signal) as soon as it returns

    async def watch_engine() -> None:
        while not stop.is_set():
            dead = started.served_model.dead_reason
            if dead:
                log.error("engine died, exiting so the orchestrator restarts the container: %s", dead)
                reason.append("engine")
                stop.set()
                return
            for task in started.tasks:
                if task.done():
                    log.error("front-end %s stopped unexpectedly: %r", task.get_name(), task.exception())
                    reason.append("frontend")
                    stop.set()
                    return
            await asyncio.sleep(ENGINE_WATCH_INTERVAL_S)

    watcher = asyncio.create_task(watch_engine())
    await stop.wait()
    watcher.cancel()
    if reason[:1] == ["signal"] and signals_seen[:1] == [signal.SIGTERM] and drain_delay_s > 0:
        log.info("draining for %.1fs before closing the listeners", drain_delay_s)
        await asyncio.sleep(drain_delay_s)
    await close(started)
    for signum in (signal.SIGINT, signal.SIGTERM):
        loop.remove_signal_handler(signum)
    return 0 if reason[:1] == ["signal"] else 1


def configure_logging() -> None:
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")


async def _main_async(config: StartupConfig, on_ready: Callable[[Started], None] | None) -> int:
    try:
        placement_mode({ENV_FRONT_PLACEMENT: config.front_placement})
        # The caller authentication's keys, before anything loads: a pod whose key Secret is missing or empty (or
        # that requires keys and names none) refuses to start, never serves without them (docs/architecture.md
        # §3.12).
        from serving_image.api_keys import load_api_keys

        load_api_keys()
    except ValueError as exc:  # before anything starts: a setting the procedure cannot read
        log.error("%s", exc)
        return 2
    remember_engine_cpus()  # before Triton and its stubs start: they inherit it (cpu_placement.py)
    adopt_orphans()  # before anything is forked: what a killed stub leaves is re-parented here (descendants.py)
    try:
        started = await start(config, exit_on_refusal=True)
    except StartupError as exc:
        log.error("%s", exc)
        return exc.exit_code
    from serving_image.gc_heap import freeze_startup_heap

    def settle() -> None:
        # Triton's bindings, the front-ends and what they imported stay for the process's life: out of the
        # collector's way, as vLLM's API server does after its startup (gc_heap.py)
        log.info("startup heap frozen out of the collector: %d objects", freeze_startup_heap())
        if config.front_placement == "auto":  # the engine is up: its workers have bound their cores by now
            log.info("%s", describe(keep_front_off_engine_cores()))
        else:
            log.info("serving processes left where the kernel puts them: %s=off", ENV_FRONT_PLACEMENT)
        if on_ready is not None:
            on_ready(started)

    return await serve_until_stopped(started, config.drain_delay_s, settle)


def run(config: StartupConfig, on_ready: Callable[[Started], None] | None = None) -> int:
    configure_logging()
    # uvloop, as vLLM's own server runs: the front-end's loop does per-token work (responses, SSE chunks), and
    # uvloop's costs less per callback and per socket write than the standard library's.
    import uvloop

    return uvloop.run(_main_async(config, on_ready))


def companions_from_env(value: str) -> list[Path]:
    """The Deployment's companion packages (pc.ENV_COMPANION_PACKAGES): package directories on the model cache,
    joined by pc.COMPANION_SEPARATOR. An empty entry (a doubled or trailing separator) is refused, naming the
    variable, rather than dropped."""
    if not value:
        return []
    parts = value.split(pc.COMPANION_SEPARATOR)
    if any(not p.strip() for p in parts):
        raise SystemExit(f"{pc.ENV_COMPANION_PACKAGES}={value!r}: an empty package path (entries are separated by "
                         f"'{pc.COMPANION_SEPARATOR}')")
    return [Path(p) for p in parts]


def argument_parser() -> argparse.ArgumentParser:
    """The command line pc.startup_argv writes: each option's destination is the StartupConfig field it sets."""
    option = pc.STARTUP_OPTIONS
    parser = argparse.ArgumentParser(description="Serving startup procedure (docs/architecture.md §3.7)")
    parser.add_argument("package", type=Path, nargs="?", default=os.environ.get(pc.ENV_PACKAGE),
                        help=f"package directory on the model cache, or a .tar.gz outside a pod "
                             f"(default: ${pc.ENV_PACKAGE}, what the Deployment sets)")
    parser.add_argument(option["workdir"], dest="workdir", type=Path, default=None,
                        help="default: a new temporary directory")
    parser.add_argument(option["host"], dest="host", default="0.0.0.0")
    parser.add_argument(option["openai_port"], dest="openai_port", type=int, default=OPENAI_PORT)
    parser.add_argument(option["kserve_http_port"], dest="kserve_http_port", type=int,
                        default=pc.PORTS[pc.KSERVE_HTTP_PORT_NAME])
    parser.add_argument(option["kserve_grpc_port"], dest="kserve_grpc_port", type=int,
                        default=pc.PORTS[pc.KSERVE_GRPC_PORT_NAME])
    parser.add_argument(option["metrics_port"], dest="metrics_port", type=int, default=pc.PORTS[pc.METRICS_PORT_NAME])
    parser.add_argument(option["triton_metrics_port"], dest="triton_metrics_port", type=int,
                        default=pc.TRITON_METRICS_PORT,
                        help="Triton's internal metrics port (loopback), which the metrics proxy reads")
    parser.add_argument(pc.STARTUP_COMPANION_OPTION, type=Path, action="append", default=[], dest="companions",
                        help="a package the same Triton serves beside the main one (repeatable): e.g. the LLM a "
                             "Python-backend model calls through BLS, an ensemble's step models (default: "
                             f"${pc.ENV_COMPANION_PACKAGES}, what the Deployment of such a pod sets, "
                             f"'{pc.COMPANION_SEPARATOR}'-separated)")
    return parser


def main(argv: list[str] | None = None) -> None:
    parser = argument_parser()
    args = parser.parse_args(argv)
    if args.package is None:
        parser.error(f"give the package path or set {pc.ENV_PACKAGE}")
    if not args.companions:
        args.companions = companions_from_env(os.environ.get(pc.ENV_COMPANION_PACKAGES, ""))
    _reexec_for_embedded_triton(argv)
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="llm-serving-"))
    config = StartupConfig(package=args.package, workdir=workdir, host=args.host, openai_port=args.openai_port,
                           kserve_http_port=args.kserve_http_port, kserve_grpc_port=args.kserve_grpc_port,
                           metrics_port=args.metrics_port, triton_metrics_port=args.triton_metrics_port,
                           companions=list(args.companions), expected=_expectation(parser))
    sys.exit(run(config))


def _expectation(parser: argparse.ArgumentParser) -> PodExpectation | None:
    try:
        return PodExpectation.from_env()
    except pc.PodContractError as err:  # a Deployment's value the pod cannot read: a usage error naming it
        parser.error(str(err))


def _reexec_for_embedded_triton(argv: list[str] | None) -> None:
    """Triton embedded in this process needs libtritonserver's dependency folder on the loader's path from the
    start: re-execute once with it (same pid). When that cannot be arranged (no library, a bad setting), step 4
    reports it after the pin check, naming what is missing."""
    try:
        from serving_image.triton.embedded import reexec_with_loader_path

        reexec_with_loader_path([*pc.startup_argv(sys.executable)[1:], *(sys.argv[1:] if argv is None else argv)])
    except Exception as exc:  # reported by step 4, in its order (the vLLM pin first)
        print(f"llm_serving.startup: not re-executing for the embedded Triton: {exc}", file=sys.stderr)


if __name__ == "__main__":
    main()
