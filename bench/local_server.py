"""Run the real serving entrypoint (`python -m serving_image.startup`) as a child process: for the tests and the
benchmarks, which must exercise exactly what the image runs. Test and benchmark support, so it lives in bench/ (which
the tests may import too), not in the serving image: the image never imports it. It only starts the entrypoint as a
command; it imports nothing of serving_image."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from llm_serving import pod_contract as pc
from llm_serving.package import PackageSpec, build_package
from llm_serving.ports import accepts, free_port
from llm_serving.store import LocalStore

START_TIMEOUT_S = 600  # generous: CI machines are small and shared
# How often a start is polled for readiness: both sides of bench.startup alike, fine enough that the poll's own
# granularity (up to one interval late) stays well below the seconds compared.
READY_POLL_S = 0.1
# float32: vLLM's bf16 CPU attention dies with SIGILL now and then on the VMs seen here (AMX reported but not
# usable), which would make tests flaky; the demo model's weights are float32 anyway.
ENGINE_ARGS = {"max_model_len": 2048, "kv_cache_memory_bytes": 128 * 1024 * 1024, "dtype": "float32"}
# vLLM's CPU worker busy-polls for a second after its last message (shm_broadcast's SpinCondition, busy_loop_s = 1)
# before it sleeps, on the core every worker here is pinned to (VLLM_CPU_OMP_THREADS_BIND=auto: core 0). A benchmark
# that keeps several engines up and measures one after another waits that spin out before each measurement: right
# after another side, a side's worker shared that core with the previous side's spinning worker for the first second
# of a ~2 s measurement (bench.kserve, bench.openai_frontend).
ENGINE_SPIN_S = 1.5


@dataclass
class Server:
    proc: subprocess.Popen
    log_path: Path
    ports: dict[str, int]
    workdir: Path
    early_connect: list[str] = field(default_factory=list)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.ports['openai']}"

    @property
    def metrics_url(self) -> str:
        return f"http://127.0.0.1:{self.ports['metrics']}/metrics"

    def log(self) -> str:
        return self.log_path.read_text()

    def stop(self, sig: int = signal.SIGINT, timeout: float = 60) -> int:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, sig)
            try:
                return self.proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                raise
        return self.proc.returncode

    def kill(self) -> None:
        """SIGKILL to the server's whole process group, also when the entrypoint itself is already gone: a server
        that died (Triton aborting) leaves its stubs' vLLM engine processes in the group, and they would run on,
        a gigabyte each, under init."""
        with contextlib.suppress(ProcessLookupError):  # nothing left of the group
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(timeout=30)


def publish_demo(demo_model_dir: Path, root: Path, *, version: str = "1.0.0", tasks=("generate",),
                 plugins: tuple[Path, ...] = (), engine_args: dict | None = None) -> Path:
    """Package the demo model, publish it to a local store and return its model-cache directory."""
    package = build_package(PackageSpec(demo_model_dir, "demo-tiny", version, engine_args=engine_args or ENGINE_ARGS,
                                        tasks=tuple(tasks), plugins=plugins), root / f"demo-{version}.tar.gz")
    return Path(LocalStore(root / "store", root / "model-cache").publish(package).model_cache_uri)


PORT_NAMES = ("openai", "metrics", "triton_metrics", "kserve_http", "kserve_grpc")


def local_startup_argv(package: Path, workdir: Path, ports: dict[str, int]) -> list[str]:
    """This interpreter's `python -m serving_image.startup` on loopback, with `ports` (PORT_NAMES -> port)."""
    return pc.startup_argv(sys.executable, package, workdir=workdir, host="127.0.0.1", openai_port=ports["openai"],
                           metrics_port=ports["metrics"], triton_metrics_port=ports["triton_metrics"],
                           kserve_http_port=ports["kserve_http"], kserve_grpc_port=ports["kserve_grpc"])


def _launch(package: Path, workdir: Path, extra_env: dict | None, extra_args: list[str],
            own_session: bool = True) -> Server:
    """The entrypoint (`python -m serving_image.startup`) on free ports, logging to a file, in a process group of
    its own (`Server.stop`/`kill` signal the whole group) and, with `own_session`, in a session of its own."""
    workdir.mkdir(parents=True, exist_ok=True)
    ports = {name: free_port() for name in PORT_NAMES}
    log_path = workdir / "server.log"
    env = dict(os.environ, HF_HUB_OFFLINE="1", **(extra_env or {}))
    with open(log_path, "w") as log:
        proc = subprocess.Popen(
            [*local_startup_argv(package, workdir / "run", ports), *extra_args],
            stdout=log, stderr=subprocess.STDOUT, env=env,
            **({"start_new_session": True} if own_session else {"process_group": 0}),
        )
    return Server(proc, log_path, ports, workdir)


def start_server(package: Path, workdir: Path, *, extra_env: dict | None = None,
                 extra_args: list[str] | None = None, own_session: bool = True) -> Server:
    """Start the entrypoint on free ports and wait until /health/ready answers 200. Records whether the OpenAI
    port accepted a connection before the engine step had finished (it must not).

    `own_session=False` keeps the server in the caller's session, for a benchmark whose other sides run in the
    caller's session too: with the kernel's autogroup scheduling (on by default, as on this machine) each session
    is one scheduling group, so a server in a session of its own shares its group's CPU with its own engine
    processes (vLLM's CPU worker pinned to one core and spinning), and on two cores its front-end's threads waited
    100-500 ms to run (bench/kserve.py, measured there)."""
    server = _launch(package, workdir, extra_env, list(extra_args or []), own_session)
    proc, log_path, ports = server.proc, server.log_path, server.ports
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            server.kill()
            raise AssertionError(f"server exited with {proc.returncode}:\n{log_path.read_text()[-5000:]}")
        # Probe the ports first, then read the log: a port that accepted before the log said the engine was done
        # really opened early (read the other way round, a port opening between the two reads looked early).
        grpc_open, openai_open = accepts(ports["kserve_grpc"]), accepts(ports["openai"])
        engine_done = "start-engine: done" in log_path.read_text()
        if not engine_done and grpc_open:
            server.early_connect.append("KServe gRPC port accepted before the engine was ready")
        if openai_open:
            if not engine_done:
                server.early_connect.append("openai port accepted before the engine was ready")
            try:
                if httpx.get(f"{server.url}/health/ready", timeout=2).status_code == 200:
                    return server
            except httpx.HTTPError:
                pass
        time.sleep(READY_POLL_S)
    server.kill()  # the whole process group: vLLM's engine core and worker too
    raise AssertionError(f"server not ready after {START_TIMEOUT_S}s:\n{log_path.read_text()[-5000:]}")


def start_standalone_server(package: Path, workdir: Path, *, companions: tuple[Path, ...] = (),
                            extra_env: dict | None = None) -> Server:
    """Start the entrypoint on a `standalone` package (tritonserver owns the KServe ports) and wait until Triton's
    /v2/health/ready answers 200. Records whether the gRPC port ever accepted a connection while the models were not
    ready (it must not: Triton opens it once they are loaded, a moment before step 4 logs that it is done)."""
    server = _launch(package, workdir, extra_env,
                     [arg for path in companions for arg in ("--with-package", str(path))])
    proc, log_path, ports = server.proc, server.log_path, server.ports
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            server.kill()
            raise AssertionError(f"server exited with {proc.returncode}:\n{log_path.read_text()[-5000:]}")
        if accepts(ports["kserve_grpc"]):
            try:
                ready = httpx.get(f"http://127.0.0.1:{ports['kserve_http']}/v2/health/ready", timeout=10)
            except httpx.HTTPError:
                ready = None  # HTTP binds a moment after gRPC
            if ready is not None and ready.status_code != 200:
                server.early_connect.append(f"KServe gRPC port accepted while Triton was not ready "
                                            f"({ready.status_code})")
            if ready is not None and ready.status_code == 200 and "startup complete" in log_path.read_text():
                return server
        time.sleep(READY_POLL_S)
    server.kill()
    raise AssertionError(f"server not ready after {START_TIMEOUT_S}s:\n{log_path.read_text()[-5000:]}")
