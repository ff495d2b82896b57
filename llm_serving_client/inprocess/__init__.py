"""Small CPU models in the caller's process (docs/clients.md, "In the caller's process"): the same published package
the pods serve, the same `model.py`, run by `InProcessModel` with what Triton's Python backend gives it."""
