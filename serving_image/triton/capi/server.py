"""Triton's server through the C API: options, start (TRITONSERVER_ServerNew), health, models, metadata, metrics,
stop. Every call here is synchronous; the blocking ones (starting, loading a model, stopping) are run by callers in
a worker thread (`asyncio.to_thread`), so an event loop stays free meanwhile."""

from __future__ import annotations

import ctypes
import enum
import json
import threading
from ctypes import c_bool, c_size_t, c_uint32, c_void_p
from dataclasses import dataclass, field
from pathlib import Path

from serving_image.triton.capi.errors import check
from serving_image.triton.capi.library import Ptr, load_library

METRIC_FORMAT_PROMETHEUS = 0
MODEL_INDEX_READY = 1  # TRITONSERVER_INDEX_FLAG_READY
TXN_DECOUPLED = 2  # TRITONSERVER_TXN_DECOUPLED
LATEST_VERSION = -1  # a model version of -1 means "the version policy's choice"


class ModelControlMode(enum.IntEnum):
    NONE = 0
    POLL = 1
    EXPLICIT = 2


@dataclass
class ServerOptions:
    """What `tritonserver`'s command line sets, for the options this project uses."""

    model_repository: Path
    backend_directory: Path | None = None
    repo_agent_directory: Path | None = None
    model_control_mode: ModelControlMode = ModelControlMode.EXPLICIT
    startup_models: tuple[str, ...] = ()  # explicit mode: loaded by ServerNew, before it returns
    strict_readiness: bool = True  # ready only when every loaded model is ready
    strict_model_config: bool = False  # let backends auto-complete the configuration (the vllm backend does)
    exit_on_error: bool = True
    exit_timeout_s: int = 30
    server_id: str = "triton"
    log_info: bool = True
    log_warn: bool = True
    log_error: bool = True
    log_verbose: int = 0
    log_file: Path | None = None  # None: Triton logs to this process's stderr
    metrics: bool = True
    gpu_metrics: bool = False
    cpu_metrics: bool = True
    metrics_config: dict[str, str] = field(default_factory=lambda: {"histogram_latencies": "true"})
    backend_config: dict[tuple[str, str], str] = field(default_factory=dict)  # (backend, setting) -> value
    min_compute_capability: float | None = 0.0  # CPU-only locally: no GPU requirement

    def _build(self, lib) -> Ptr:
        options = Ptr()
        check(lib, lib.TRITONSERVER_ServerOptionsNew(ctypes.byref(options)))
        try:
            calls = [
                ("SetServerId", self.server_id.encode()),
                ("SetModelRepositoryPath", str(self.model_repository).encode()),
                ("SetModelControlMode", int(self.model_control_mode)),
                ("SetStrictReadiness", self.strict_readiness),
                ("SetStrictModelConfig", self.strict_model_config),
                ("SetExitOnError", self.exit_on_error),
                ("SetExitTimeout", self.exit_timeout_s),
                ("SetLogInfo", self.log_info),
                ("SetLogWarn", self.log_warn),
                ("SetLogError", self.log_error),
                ("SetLogVerbose", self.log_verbose),
                ("SetMetrics", self.metrics),
                ("SetGpuMetrics", self.gpu_metrics),
                ("SetCpuMetrics", self.cpu_metrics),
            ]
            if self.backend_directory is not None:
                calls.append(("SetBackendDirectory", str(self.backend_directory).encode()))
            if self.log_file is not None:
                calls.append(("SetLogFile", str(self.log_file).encode()))
            if self.repo_agent_directory is not None:
                calls.append(("SetRepoAgentDirectory", str(self.repo_agent_directory).encode()))
            if self.min_compute_capability is not None:
                calls.append(("SetMinSupportedComputeCapability", float(self.min_compute_capability)))
            for model in self.startup_models:
                calls.append(("SetStartupModel", model.encode()))
            for name, value in calls:
                check(lib, getattr(lib, f"TRITONSERVER_ServerOptions{name}")(options, value))
            for setting, value in self.metrics_config.items():
                check(lib, lib.TRITONSERVER_ServerOptionsSetMetricsConfig(options, b"", setting.encode(),
                                                                          value.encode()))
            for (backend, setting), value in self.backend_config.items():
                check(lib, lib.TRITONSERVER_ServerOptionsSetBackendConfig(options, backend.encode(), setting.encode(),
                                                                          value.encode()))
        except BaseException:
            lib.TRITONSERVER_ServerOptionsDelete(options)
            raise
        return options


def _message_json(lib, message: Ptr) -> dict:
    try:
        base, size = c_void_p(), c_size_t()
        check(lib, lib.TRITONSERVER_MessageSerializeToJson(message, ctypes.byref(base), ctypes.byref(size)))
        return json.loads(ctypes.string_at(base, size.value))
    finally:
        lib.TRITONSERVER_MessageDelete(message)


class Server:
    """A Triton server in this process. `Server.start(options)` returns once the startup models are loaded; `stop()`
    unloads every model (their backends finalize) and waits up to the exit timeout for in-flight requests."""

    def __init__(self, lib, handle: Ptr):
        self.lib = lib
        self._handle = handle
        self._lock = threading.Lock()
        self._stopped = False

    @classmethod
    def start(cls, options: ServerOptions, lib=None) -> Server:
        lib = lib or load_library()
        built = options._build(lib)
        handle = Ptr()
        try:
            check(lib, lib.TRITONSERVER_ServerNew(ctypes.byref(handle), built))
        finally:
            lib.TRITONSERVER_ServerOptionsDelete(built)
        return cls(lib, handle)

    @property
    def handle(self) -> Ptr:
        if self._stopped:
            from serving_image.triton.capi.errors import ErrorCode, TritonError

            raise TritonError(ErrorCode.UNAVAILABLE, "the server is stopped")
        return self._handle

    @property
    def stopped(self) -> bool:
        return self._stopped

    def _flag(self, function, *args) -> bool:
        value = c_bool()
        check(self.lib, function(self.handle, *args, ctypes.byref(value)))
        return value.value

    def live(self) -> bool:
        return not self._stopped and self._flag(self.lib.TRITONSERVER_ServerIsLive)

    def ready(self) -> bool:
        return not self._stopped and self._flag(self.lib.TRITONSERVER_ServerIsReady)

    def model_ready(self, name: str, version: int = LATEST_VERSION) -> bool:
        return not self._stopped and self._flag(self.lib.TRITONSERVER_ServerModelIsReady, name.encode(), version)

    def model_is_decoupled(self, name: str, version: int = LATEST_VERSION) -> bool:
        flags, unused = c_uint32(), c_void_p()
        check(self.lib, self.lib.TRITONSERVER_ServerModelTransactionProperties(
            self.handle, name.encode(), version, ctypes.byref(flags), ctypes.byref(unused)))
        return bool(flags.value & TXN_DECOUPLED)

    def load_model(self, name: str) -> None:
        """Load (or reload) a model; blocks until it is loaded or failed."""
        check(self.lib, self.lib.TRITONSERVER_ServerLoadModel(self.handle, name.encode()))

    def unload_model(self, name: str) -> None:
        """Start unloading a model; its in-flight requests finish first. Returns before the unload completes."""
        check(self.lib, self.lib.TRITONSERVER_ServerUnloadModel(self.handle, name.encode()))

    def _message(self, function, *args) -> dict:
        message = Ptr()
        check(self.lib, function(self.handle, *args, ctypes.byref(message)))
        return _message_json(self.lib, message)

    def metadata(self) -> dict:
        return self._message(self.lib.TRITONSERVER_ServerMetadata)

    def model_metadata(self, name: str, version: int = LATEST_VERSION) -> dict:
        return self._message(self.lib.TRITONSERVER_ServerModelMetadata, name.encode(), version)

    def model_config(self, name: str, version: int = LATEST_VERSION) -> dict:
        return self._message(self.lib.TRITONSERVER_ServerModelConfig, name.encode(), version, 1)

    def model_statistics(self, name: str = "", version: int = LATEST_VERSION) -> dict:
        return self._message(self.lib.TRITONSERVER_ServerModelStatistics, name.encode(), version)

    def model_index(self, ready_only: bool = False) -> list[dict]:
        return self._message(self.lib.TRITONSERVER_ServerModelIndex, MODEL_INDEX_READY if ready_only else 0)

    def metrics(self) -> str:
        """The server's metrics in Prometheus text format (what `--metrics-port` serves)."""
        metrics = Ptr()
        check(self.lib, self.lib.TRITONSERVER_ServerMetrics(self.handle, ctypes.byref(metrics)))
        try:
            base, size = c_void_p(), c_size_t()
            check(self.lib, self.lib.TRITONSERVER_MetricsFormatted(metrics, METRIC_FORMAT_PROMETHEUS,
                                                                   ctypes.byref(base), ctypes.byref(size)))
            return ctypes.string_at(base, size.value).decode("utf-8", "replace")
        finally:
            self.lib.TRITONSERVER_MetricsDelete(metrics)

    def stop(self) -> None:
        """Stop the server (blocks: models unload, in-flight requests get up to the exit timeout), then free it.
        Idempotent."""
        with self._lock:
            if self._stopped:
                return
            self._stopped = True
        try:
            check(self.lib, self.lib.TRITONSERVER_ServerStop(self._handle))
        finally:
            check(self.lib, self.lib.TRITONSERVER_ServerDelete(self._handle))
