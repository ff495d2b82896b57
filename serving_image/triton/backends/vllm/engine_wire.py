"""The wire between the stand-in `vllm` backend (model.py, in Triton's Python backend stub) and its engine process
(serving_image/triton/engine_host.py, in .venv-serving): length-prefixed JSON messages over a Unix socket pair.

Standard library only: the stub's interpreter has the system's standard library and numpy, nothing else.

stub -> engine   {"op": "generate", "id": ID, "prompt": TEXT, "params": JSON-TEXT | null, "root": FIELD-NAME}
                 {"op": "embed", "id": ID, "input": TEXT | [TOKEN-ID, ...]}              a pooling engine
                 {"op": "score", "id": ID, "prompt": TEXT, "candidates": [TEXT, ...]}     a generation engine
                 {"op": "abort", "id": ID}
engine -> stub   {"op": "ready", "info": {...}} | {"op": "failed", "error": TEXT}        once, at start; info holds
                                                  "tasks" (["generate"] or ["embed"]) and "embedding_dim"
                 {"id": ID, "p": PROMPT-TOKENS, "out": [[INDEX, TEXT, TOKENS, FINISH-OR-NULL], ...], "done": BOOL}
                 {"id": ID, "p": PROMPT-TOKENS, "embedding": [FLOAT, ...], "done": true}
                 {"id": ID, "p": PROMPT-TOKENS, "scores": [[LOGPROB, TOKENS], ...], "done": true}
                 {"id": ID, "error": TEXT, "code": "INVALID_ARG" | "UNAVAILABLE" | "INTERNAL", "field": NAME?}
                 {"op": "dead", "error": TEXT}                                            the engine died
"""

from __future__ import annotations

import json
import socket
import struct
import subprocess
import threading
from collections.abc import Callable

HEADER = struct.Struct("<I")
MAX_MESSAGE = 256 * 1024 * 1024
# The environment variable that names the .venv-serving interpreter the engine process runs in (set by the startup
# procedure before it starts tritonserver; the stub passes its environment on).
ENGINE_PYTHON_ENV = "LLM_SERVING_ENGINE_PYTHON"
ENGINE_MODULE = "serving_image.triton.engine_host"
# An optional niceness (1..19) the engine process takes before it starts vLLM, which its engine core and workers
# inherit: set where several pods' engines share a machine's cores (the rehearsal, llm_serving_cli/rehearsal/
# substitutions.py), so that vLLM's busy-polling workers cannot starve the pods' Triton and stub threads (the Python
# backend's stub must answer its parent's health check within a second, or the model's load fails).
ENGINE_NICE_ENV = "LLM_SERVING_ENGINE_NICE"


def encode(message: dict) -> bytes:
    data = json.dumps(message, separators=(",", ":"), ensure_ascii=False).encode("utf-8")
    return HEADER.pack(len(data)) + data


def read_message(stream) -> dict | None:
    """One message from a blocking binary file object (socket.makefile("rb")); None at end of stream."""
    header = stream.read(HEADER.size)
    if len(header) < HEADER.size:
        return None
    (size,) = HEADER.unpack(header)
    if size > MAX_MESSAGE:
        raise ValueError(f"engine wire: message of {size} bytes")
    data = stream.read(size)
    if len(data) < size:
        return None
    return json.loads(data)


async def read_message_async(reader) -> dict | None:
    """One message from an asyncio StreamReader; None at end of stream."""
    import asyncio

    try:
        header = await reader.readexactly(HEADER.size)
        (size,) = HEADER.unpack(header)
        if size > MAX_MESSAGE:
            raise ValueError(f"engine wire: message of {size} bytes")
        return json.loads(await reader.readexactly(size))
    except asyncio.IncompleteReadError:
        return None


def spawn_engine(python: str, model_json: str, model_name: str, model_version: str):
    """Start the engine process on one end of a Unix socket pair and wait for its first message. Returns
    (process, socket, reader, first message); the first message is None when the process ended before saying
    anything. The caller checks that it is {"op": "ready"}. Shared by the stand-in vllm backend's models and the
    platform's scoring model (serving_image/triton/scoring_model), through EngineConnection."""
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    command = [python, "-m", ENGINE_MODULE, "--model-json", model_json, "--fd", str(theirs.fileno()),
               "--model-name", model_name, "--model-version", model_version]
    process = subprocess.Popen(command, pass_fds=(theirs.fileno(),))  # its log goes where Triton's goes
    theirs.close()
    reader = ours.makefile("rb")
    return process, ours, reader, read_message(reader)


class EngineConnection:
    """One engine process and the socket to it, as a Python-backend model holds it (the stand-in vllm backend's
    models and the platform's scoring model): start, send, a reader thread, stop.

    Ordering rules: `send` may be called from any thread (one writer at a time); `on_message` and `on_dead` run on
    the reader thread, one call at a time, in the order the engine wrote; `on_dead` is called when the engine says
    it died, when the connection ends (the process exited), and when `on_message` raises (a message the model cannot
    read: the engine is unusable, and dying loudly beats a reader gone silent with every request waiting forever).
    `close` makes the engine drain and exit, and returns once the reader has stopped."""

    def __init__(self, python: str, model_json: str, model_name: str, model_version: str):
        self.process, self._socket, self._reader, self.first = spawn_engine(python, model_json, model_name,
                                                                            model_version)
        self._write_lock = threading.Lock()
        self._thread: threading.Thread | None = None

    def start_failure(self) -> str | None:
        """None when the engine said it is ready; else why it did not (the process is reaped, the socket closed)."""
        if self.first is not None and self.first.get("op") == "ready":
            return None
        code = self.process.wait()
        self._socket.close()
        return self.first.get("error") if self.first else f"the engine process exited with status {code}"

    def send(self, message: dict) -> None:
        """Raises OSError when the engine process is gone."""
        data = encode(message)
        with self._write_lock:
            self._socket.sendall(data)

    def start_reading(self, on_message: Callable[[dict], None], on_dead: Callable[[str], None], name: str) -> None:
        def read_loop() -> None:
            while True:
                try:
                    message = read_message(self._reader)
                except (OSError, ValueError) as exc:
                    message, reason = None, f"engine connection failed: {exc}"
                else:
                    reason = f"the engine process exited (status {self.process.poll()})"
                if message is None:
                    on_dead(reason)
                    return
                if message.get("op") == "dead":
                    on_dead(message.get("error", "the engine died"))
                    continue
                try:
                    on_message(message)
                except Exception as exc:  # noqa: BLE001 - see the class's docstring
                    on_dead(f"unreadable message from the engine process ({type(exc).__name__}: {exc})")
                    return

        self._thread = threading.Thread(target=read_loop, name=name, daemon=True)
        self._thread.start()

    def close(self, timeout_s: float = 60) -> None:
        try:
            self._socket.shutdown(socket.SHUT_WR)  # the engine process drains, shuts vLLM down and exits
        except OSError:  # the engine closed its end already: nothing left to tell it
            pass
        try:
            self.process.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        if self._thread is not None:
            self._thread.join(timeout=10)
        self._socket.close()
