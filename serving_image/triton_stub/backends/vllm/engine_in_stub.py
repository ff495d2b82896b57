"""vLLM in the Python backend stub's own process, as NVIDIA's backend runs it: the in-stub engine a Python-backend
model of this project holds (the stand-in `vllm` backend's models, the platform's scoring model; docs/architecture.md
§2.3).

The stub's interpreter is the system's libpython3.11 with its own `sys.path` (the standard library, the model's
directory, the backend's directory with the stub's numpy < 2) and ignores `PYTHONPATH`. `prepare_environment` makes
.venv-serving's packages (vLLM, torch, this project) importable *after* those, so the stub keeps its numpy 1.26.4
(numpy 2 corrupts BYTES tensors in this stub) and vLLM runs beside it (docs/kserve.md, "vLLM in the stub"). The one
contract of the stub's environment: `$LLM_SERVING_ENGINE_PYTHON` names the interpreter whose site-packages are
appended, after `$PYTHONPATH`'s entries (the startup procedure's plugin directory); vLLM's helper processes (its
model-registry probe, its engine core and worker, started with multiprocessing's `spawn`, which the CPU platform
forces) run *that* interpreter with *its own* `sys.path` (and `$PYTHONPATH`'s entries first), because an
embedded interpreter's `sys.executable` is not a Python and the stub's standard library is not theirs.

`InStubEngine` runs the engine on an asyncio loop in a thread of its own (the stub's main thread keeps answering
Triton: `execute`, health checks) and speaks in plain dicts, the messages of serving_image/triton_stub/stub_vllm.py:

    model -> engine   {"op": "generate", "id": ID, "prompt": TEXT, "params": JSON-TEXT | null, "root": FIELD-NAME,
                       "interval": TOKENS?}   vLLM's stream_interval for it: how many tokens vLLM merges per delta
                      {"op": "embed", "id": ID, "input": TEXT | [TOKEN-ID, ...]}          a pooling engine
                      {"op": "score", "id": ID, "prompt": TEXT, "candidates": [TEXT, ...]} a generation engine
                      {"op": "abort", "id": ID}
    engine -> model   {"id": ID, "p": PROMPT-TOKENS, "out": [[INDEX, TEXT, TOKENS, FINISH, LOGPROBS], ...],
                       "done": BOOL}
                      {"id": ID, "p": PROMPT-TOKENS, "embedding": [FLOAT, ...], "done": true}
                      {"id": ID, "p": PROMPT-TOKENS, "scores": [[LOGPROB, TOKENS], ...], "done": true}
                      {"id": ID, "error": TEXT, "code": "INVALID_ARG" | "UNAVAILABLE" | "INTERNAL", "field": NAME?}

No copy, no encoding, no process hop: a delta is a dict handed to the model's callback on the engine's loop, which
builds the Triton response and sends it. While that send blocks (the stub's `send` waits for Triton), vLLM's own
output collector merges the request's next deltas, so a lagging consumer gets fewer, fuller responses.

Ordering rules (the ones the models rely on): `send` may be called from any thread; `on_message` and `on_dead` run
on the engine's thread, one call at a time, in the order the engine produced them; `on_dead` is called once, when
the engine died (vLLM's engine core exited or failed), when the loop itself failed, or when `on_message` raised (a
message the model cannot handle: dying loudly beats a model gone silent with every request waiting forever).
`close` drains the engine, shuts it down, and returns once its thread has stopped.

Standard library only at import: this file is loaded by the stub before .venv-serving is on its path.
"""

from __future__ import annotations

import asyncio
import json
import locale
import logging
import multiprocessing
import multiprocessing.spawn
import os
import site
import subprocess
import sys
import threading
from collections.abc import Callable

# The environment variable that names the .venv-serving interpreter (set by the startup procedure before Triton
# starts; the stub inherits Triton's environment).
ENGINE_PYTHON_ENV = "LLM_SERVING_ENGINE_PYTHON"
# An optional niceness (1..19) for the engine: set where several pods' engines share a machine's cores (the
# rehearsal, rehearsal/substitutions.py; the test suite's servers, tests/serving/conftest.py), so that
# vLLM's busy-polling engine core and worker cannot starve the pods' Triton and stub threads (the stub must answer its
# parent's health check within a second, or the model's load fails). On Linux a niceness belongs to a thread and is
# inherited by the processes it starts: the engine's thread takes it before vLLM spawns its processes; the stub's main
# thread keeps its own.
ENGINE_NICE_ENV = "LLM_SERVING_ENGINE_NICE"
# The level of this project's loggers (`llm_serving.*`) in the stub: DEBUG, INFO (the default), WARNING or ERROR.
# A request's way into the engine is logged at DEBUG: the front-end's request record is the request log, and a line
# per request here cost the engine's thread 60-80 µs a request (a 32-request wave's admission is all on one core).
# The test suite's servers run at DEBUG (tests/serving/conftest.py): their cancellation tests wait for that line.
STUB_LOG_LEVEL_ENV = "LLM_SERVING_STUB_LOG_LEVEL"
STUB_LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")

log = logging.getLogger("llm_serving.triton.engine_in_stub")

_prepared: str | None = None
_prepare_lock = threading.Lock()


class StubEnvironmentError(RuntimeError):
    """The stub cannot reach .venv-serving's packages; the message says what is wrong."""


def _interpreter_paths(python: str) -> dict:
    try:
        out = subprocess.run([python, "-I", "-c", "import json, site, sys; "
                              "print(json.dumps({'site': site.getsitepackages(), 'path': sys.path[1:]}))"],
                             check=True, capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.SubprocessError) as exc:
        raise StubEnvironmentError(f"${ENGINE_PYTHON_ENV}={python}: cannot ask the interpreter for its packages "
                                   f"({exc})") from exc
    return json.loads(out.stdout)


def prepare_environment(python: str) -> None:
    """Append `python`'s site-packages to the stub's path (their .pth files run: the editable install of this
    project) and make vLLM's helper processes run `python` with its own path. Idempotent within a process."""
    global _prepared
    with _prepare_lock:
        if _prepared is not None:
            if _prepared != python:
                raise StubEnvironmentError(f"this stub's packages already come from {_prepared}, not {python}")
            return
        # The stub's interpreter is configured isolated, without touching the C locale: its text encoding is then
        # ASCII, and vLLM (torch's kernel templates) reads UTF-8 files with open()'s default encoding, which
        # Python 3.11 takes from LC_CTYPE at each call.
        if locale.getpreferredencoding(False).lower().replace("-", "") != "utf8":
            locale.setlocale(locale.LC_CTYPE, "C.UTF-8")
        paths = _interpreter_paths(python)
        # $PYTHONPATH, which the stub's interpreter ignores and `python -I` leaves out: where the startup procedure
        # installed the package's plugin wheels (vLLM finds them through their entry points, in this process and
        # in the processes it spawns). After the stub's own path (its numpy stays first), before the venv's.
        extra = [entry for entry in os.environ.get("PYTHONPATH", "").split(os.pathsep) if entry]
        for entry in extra:
            if entry not in sys.path:
                sys.path.append(entry)
        for directory in paths["site"]:
            site.addsitedir(directory)
        sys.executable = python  # vLLM runs helpers with sys.executable (its model registry's inspection)
        multiprocessing.set_executable(python)
        original = multiprocessing.spawn.get_preparation_data
        child_path = [*extra, *(entry for entry in paths["path"] if entry not in extra)]

        def preparation_data(name):
            data = original(name)
            data["sys_path"] = child_path  # the child's own standard library and packages (its numpy 2)
            data.pop("init_main_from_path", None)  # the stub's __main__ is not a file a child could run
            data.pop("main_path", None)
            return data

        multiprocessing.spawn.get_preparation_data = preparation_data
        _prepared = python


def lower_priority(value: str | None) -> None:
    """Take the niceness `value` names ($LLM_SERVING_ENGINE_NICE) in the calling thread (see ENGINE_NICE_ENV)."""
    if not value:
        return
    if not value.isdigit() or not 1 <= int(value) <= 19:
        raise StubEnvironmentError(f"${ENGINE_NICE_ENV}={value!r}: a niceness from 1 to 19")
    os.setpriority(os.PRIO_PROCESS, 0, int(value))  # 0: the calling thread (Linux)


def stub_log_level(value: str | None) -> int:
    """The logging level `value` names ($LLM_SERVING_STUB_LOG_LEVEL; unset or empty: INFO)."""
    if not value:
        return logging.INFO
    if value not in STUB_LOG_LEVELS:
        raise StubEnvironmentError(f"${STUB_LOG_LEVEL_ENV}={value!r}: one of {', '.join(STUB_LOG_LEVELS)}")
    return getattr(logging, value)


ERROR_CODES = ("INVALID_ARG", "UNAVAILABLE")  # the engine's codes a model answers as they are; anything else INTERNAL


def error_answer(message: dict) -> tuple[str, str]:
    """An error message of the engine (serving_image/triton_stub/stub_vllm.py `error_message`) as every model of this
    project answers it: (text, the name of its pb_utils.TritonError code). INVALID_ARG and UNAVAILABLE as sent,
    anything else INTERNAL; the text leads with the field an input error names (`field: ...`) unless it already
    does, so the field reaches the client whichever model answers (generation, embeddings, scores)."""
    field, text = message.get("field"), str(message["error"])
    if field and not text.startswith(field):
        text = f"{field}: {text}"
    code = message.get("code")
    return text, code if code in ERROR_CODES else "INTERNAL"


class InStubEngine:
    """One vLLM engine in this process, on a thread and loop of its own (see the module's docstring)."""

    def __init__(self, python: str, model_json: str, model_name: str, model_version: str):
        level = stub_log_level(os.environ.get(STUB_LOG_LEVEL_ENV))
        prepare_environment(python)
        if not logging.getLogger().handlers:  # the stub configures no logging: our lines go to Triton's stderr
            logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                                format="%(asctime)s %(levelname)s %(name)s: %(message)s")
        logging.getLogger("llm_serving").setLevel(level)
        self.pid = os.getpid()
        self.first: dict | None = None
        self._model_json, self._model_name, self._model_version = model_json, model_name, model_version
        # uvloop, as vLLM's own server runs AsyncLLM (a [serving] dependency, importable once the environment is
        # prepared): the stdlib loop's self-pipe wake-ups (every message the stub's threads hand over) were half
        # of this thread's samples under load.
        import uvloop

        self._loop = uvloop.new_event_loop()
        self._started = threading.Event()
        self._dispatcher = None
        self._on_message: Callable[[dict], None] | None = None
        self._on_dead: Callable[[str], None] | None = None
        self._dead = False
        self._closing = False
        self._stop: asyncio.Event | None = None
        self._reading: asyncio.Event | None = None
        self._thread = threading.Thread(target=self._run, name=f"vllm-engine-{model_name}", daemon=True)
        self._thread.start()
        self._started.wait()

    # -- the engine's thread --------------------------------------------------------------------------------------

    def _run(self) -> None:
        try:
            lower_priority(os.environ.get(ENGINE_NICE_ENV))
            asyncio.set_event_loop(self._loop)
            self._loop.run_until_complete(self._main())
        except BaseException as exc:  # noqa: BLE001 - the loop itself failed: the engine is unusable
            if not self._started.is_set():
                self.first = {"op": "failed", "error": f"{type(exc).__name__}: {exc}"}
                self._started.set()
            else:
                self._died(f"the engine's loop failed: {type(exc).__name__}: {exc}")
        finally:
            self._loop.close()

    async def _main(self) -> None:
        from pathlib import Path

        from serving_image.triton_stub import stub_vllm

        self._stop, self._reading = asyncio.Event(), asyncio.Event()
        try:
            engine, tasks = await stub_vllm.start_engine(Path(self._model_json), self._model_name,
                                                         self._model_version)
        except Exception as exc:
            log.exception("engine start failed")
            self.first = {"op": "failed", "error": f"{type(exc).__name__}: {exc}"}
            self._started.set()
            return
        self.first = {"op": "ready", "info": stub_vllm.ready_info(engine, tasks)}
        self._dispatcher = stub_vllm.MessageDispatcher(engine, self._deliver)
        self._started.set()
        await self._reading.wait()
        watcher = asyncio.create_task(self._dispatcher.watch())
        try:
            await self._stop.wait()
        finally:
            watcher.cancel()
            await self._dispatcher.stop()
            await engine.shutdown()

    def _deliver(self, message: dict) -> None:
        if self._dead:
            return
        if message.get("op") == "dead":
            self._died(message.get("error", "the engine died"))
            return
        try:
            self._on_message(message)
        except Exception as exc:  # noqa: BLE001 - see the module's docstring
            self._died(f"a message the model could not handle ({type(exc).__name__}: {exc})")

    def _died(self, reason: str) -> None:
        if self._dead:
            return
        self._dead = True
        if self._on_dead is not None and not self._closing:
            self._on_dead(reason)

    # -- the model's side -----------------------------------------------------------------------------------------

    def start_failure(self) -> str | None:
        """None when the engine is ready; else why it did not start (its thread has ended)."""
        if self.first is not None and self.first.get("op") == "ready":
            return None
        self._thread.join(timeout=60)
        return self.first.get("error") if self.first else "the engine's thread ended before it said anything"

    def start_reading(self, on_message: Callable[[dict], None], on_dead: Callable[[str], None], name: str = "") -> None:
        self._on_message, self._on_dead = on_message, on_dead
        self._loop.call_soon_threadsafe(self._reading.set)

    def send(self, message: dict) -> None:
        """Hand a message to the engine. Raises OSError when the engine is gone (as a closed connection would)."""
        if self._dead or self._closing:
            raise OSError("the engine has stopped")
        try:
            self._loop.call_soon_threadsafe(self._dispatcher.dispatch, message)
        except RuntimeError as exc:  # the loop is closed
            raise OSError(f"the engine has stopped: {exc}") from exc

    def close(self, timeout_s: float = 60) -> None:
        self._closing = True
        if self._stop is not None and not self._loop.is_closed():
            try:
                self._loop.call_soon_threadsafe(self._stop.set)
            except RuntimeError:  # the loop has just closed: nothing left to stop
                pass
        self._thread.join(timeout=timeout_s)
