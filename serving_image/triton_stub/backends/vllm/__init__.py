"""The project's stand-in for NVIDIA's `vllm` backend (see model.py). Triton loads model.py from this directory as a
python-based backend; the package form only lets the tests import its modules."""
