"""Triton embedded in this process (the `openai` serving mode with Triton): the server this module starts
through the C API binding (serving_image/triton/capi) is the one instance the OpenAI front-end, the KServe
front-ends and the metrics proxy all use.

- In the image the library is the Triton release's and the backend directory its own (NVIDIA's vllm backend).
- Locally it is nvidia-pytriton's libtritonserver (2.51) with the backend directory of the standalone mode (NVIDIA's
  Python backend and this project's stand-in `vllm` backend, whose stub imports vLLM from .venv-serving).

Loading the library needs its dependency folder on the loader's path when the process starts
(serving_image/triton/capi/library.py): `reexec_with_loader_path` is what the startup procedure calls first, and it
replaces the process (same pid) with one started with `LD_LIBRARY_PATH` set, once.
"""

from __future__ import annotations

import asyncio
import logging
import os
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from serving_image.triton import capi
from serving_image.triton.capi.library import on_loader_path, with_loader_path

log = logging.getLogger(__name__)

REEXEC_MARK = "LLM_SERVING_TRITON_REEXEC"  # set in the re-executed process: never re-execute twice


def reexec_with_loader_path(argv: Sequence[str]) -> None:
    """Make sure libtritonserver's dependency folder is on LD_LIBRARY_PATH from the process's start: if it is not,
    replace this process (os.execve keeps the pid) with `python <argv>` and the folder on the path. Returns when
    nothing needs doing. Raises TritonLibraryError (naming what is missing) when the library cannot be found."""
    location = capi.library.locate_library()
    if on_loader_path(location.dependency_dir):
        return
    if os.environ.get(REEXEC_MARK):
        raise capi.TritonLibraryError(f"re-executed with LD_LIBRARY_PATH={location.dependency_dir} but the loader "
                                      "path still lacks it: something in between rewrote LD_LIBRARY_PATH")
    env = dict(os.environ, LD_LIBRARY_PATH=with_loader_path(location.dependency_dir,
                                                            os.environ.get("LD_LIBRARY_PATH")))
    env[REEXEC_MARK] = "1"
    # logging is not configured yet this early: say it on stderr, where the procedure's log goes
    print(f"llm_serving.startup: re-executing with {location.dependency_dir} on LD_LIBRARY_PATH (libtritonserver's "
          "dependencies)", file=sys.stderr)
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, [sys.executable, *argv], env)


@dataclass
class EmbeddedTriton:
    """The running in-process server and the models it was started with."""

    server: capi.Server
    models: tuple[str, ...]
    server_version: str
    started_s: float

    def is_ready(self) -> bool:
        return self.dead_reason is None

    @property
    def dead_reason(self) -> str | None:
        if self.server.stopped:
            return "Triton stopped"
        try:
            if not self.server.live():
                return "Triton reports itself not live"
            for model in self.models:
                if not self.server.model_ready(model):
                    return f"Triton reports {model} not ready (its engine failed and the model was unloaded)"
        except capi.TritonError as exc:
            return f"Triton health check failed: {exc}"
        return None

    def metrics_text(self) -> bytes:
        return self.server.metrics().encode("utf-8")

    async def stop(self) -> None:
        """Stop the server: in-flight requests finish (up to the exit timeout), models unload (their engines stop)."""
        await asyncio.to_thread(self.server.stop)


async def start_embedded(*, repository: Path, models: str | Sequence[str], backend_directory: Path | None,
                         env: dict[str, str] | None = None, exit_timeout_s: int = 30,
                         log_verbose: int = 0) -> EmbeddedTriton:
    """Start Triton in this process on `repository` in explicit model-control mode, load `models` one at a time in
    the order given (an ensemble after its steps; loading a vllm model is starting its engine) before it returns,
    and check each is ready.

    One at a time, not as startup models that Triton loads in parallel: with several Python-based models (the
    stand-in `vllm` backend's and the Python backend's) initialising at once, Triton 2.51 was seen to hang for good
    in one model's instance creation after its `initialize` had returned (the server's thread joining an instance
    thread, the stub idle). On 2 cores the engines' starts gain nothing from overlapping anyway."""
    models = (models,) if isinstance(models, str) else tuple(models)
    os.environ.update(env or {})  # read by the backends' child processes (the stubs)
    options = capi.ServerOptions(model_repository=repository, backend_directory=backend_directory,
                                 exit_timeout_s=exit_timeout_s, log_verbose=log_verbose)
    started = time.perf_counter()
    lib = capi.load_library()
    server = await asyncio.to_thread(capi.Server.start, options, lib)
    try:
        for model in models:
            await asyncio.to_thread(server.load_model, model)
        not_ready = [m for m in models if not server.model_ready(m)]
        if not_ready:
            raise RuntimeError(f"Triton started but reports {', '.join(not_ready)} not ready (its log above says why)")
        version = str(server.metadata().get("version", "unknown"))
    except BaseException:
        await asyncio.to_thread(server.stop)
        raise
    return EmbeddedTriton(server, models, version, time.perf_counter() - started)
