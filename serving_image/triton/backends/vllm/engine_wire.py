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

HEADER = struct.Struct("<I")
MAX_MESSAGE = 256 * 1024 * 1024
# The environment variable that names the .venv-serving interpreter the engine process runs in (set by the startup
# procedure before it starts tritonserver; the stub passes its environment on).
ENGINE_PYTHON_ENV = "LLM_SERVING_ENGINE_PYTHON"
ENGINE_MODULE = "serving_image.triton.engine_host"


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
    platform's scoring model (serving_image/triton/scoring_model)."""
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    command = [python, "-m", ENGINE_MODULE, "--model-json", model_json, "--fd", str(theirs.fileno()),
               "--model-name", model_name, "--model-version", model_version]
    process = subprocess.Popen(command, pass_fds=(theirs.fileno(),))  # its log goes where Triton's goes
    theirs.close()
    reader = ours.makefile("rb")
    return process, ours, reader, read_message(reader)
