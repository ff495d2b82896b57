"""A stand-in for serving_image/triton/engine_host.py that speaks its wire protocol without vLLM: the stand-in vllm
backend's behaviour when its engine process dies can then be tested in seconds.

Started by the backend through $LLM_SERVING_ENGINE_PYTHON (a wrapper script that runs this file with the backend's
arguments). Answers every request with one delta and keeps it running; answers the prompt "internal" with an INTERNAL
error; exits at once, with status 1, when a request's prompt is "die".
"""

from __future__ import annotations

import argparse
import os
import socket
import sys

from serving_image.triton.backends.vllm import engine_wire as wire


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("-m", dest="module")
    parser.add_argument("--model-json")
    parser.add_argument("--fd", type=int)
    parser.add_argument("--model-name")
    parser.add_argument("--model-version")
    args = parser.parse_args()
    sock = socket.socket(fileno=args.fd)
    reader = sock.makefile("rb")
    sock.sendall(wire.encode({"op": "ready", "info": {"max_model_len": 64, "vocab_size": 10}}))
    while (message := wire.read_message(reader)) is not None:
        if message.get("op") != "generate":
            continue
        if message["prompt"] == "internal":
            sock.sendall(wire.encode({"id": message["id"], "error": "a bug", "code": "INTERNAL"}))
            continue
        if message["prompt"] == "die":
            print("fake engine: dying", file=sys.stderr, flush=True)
            os._exit(1)
        sock.sendall(wire.encode({"id": message["id"], "p": 1, "out": [[0, "tok", 1, None, None]], "done": False}))


if __name__ == "__main__":
    main()
