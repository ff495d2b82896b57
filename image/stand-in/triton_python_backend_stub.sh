#!/bin/sh
# The stand-in's Python backend stub, as Triton's python backend runs it (`<backend dir>/triton_python_backend_stub`
# with its arguments): NVIDIA's 2.51 stub for Python 3.11 (triton_python_backend_stub.bin beside this file), run with
# a PATH without /opt/venv/bin.
#
# Why: the stub embeds Python without naming its program, so Python looks `python3` up on PATH to find its prefix.
# The stand-in's PATH starts with /opt/venv/bin (vLLM's environment, NGC's image has no venv), which would make the
# stub's interpreter that environment, with its numpy 2 ahead of the stub's own numpy 1.26.4 in the backend's
# directory; 2.51's stub corrupts every BYTES tensor under numpy 2 (each length prefix reads as its first byte four
# times). The stand-in vllm backend adds the environment's packages after the stub's own
# (serving_image/triton_stub/backends/vllm/engine_in_stub.py), as it does outside the image.
PATH=/usr/local/bin:/usr/bin:/bin exec "$(dirname "$0")/triton_python_backend_stub.bin" "$@"
