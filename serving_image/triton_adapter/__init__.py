"""Triton behind the served-model interface, in the serving process (docs/architecture.md, "Where the code runs"): the
served model the OpenAI front-end calls in the `openai` mode (triton_model.py), a client of the Triton this
process hosts (serving_image/triton). The tensors it sends and reads back are the vLLM backend's contract,
serving_image/engine/vllm_backend_tensors.py, which the in-stub engine (serving_image/triton_stub) writes too.
"""
