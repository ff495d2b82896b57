"""Code that runs inside Triton's Python backend stub process, never in the serving process (docs/architecture.md,
"Where the code runs"): the stand-in `vllm` backend (backends/vllm/: `model.py`, the name Triton requires of a
python-based backend, and engine_in_stub.py, vLLM in the stub), vLLM's side of the in-stub engine (stub_vllm.py)
and the platform's scoring model (scoring_model/model.py, `model.py` being Triton's default model file name).

The serving process only points Triton at these files (serving_image/triton/local_install.py, repository.py): the
paths below, and the environment variables named in engine_in_stub.py.
"""

from pathlib import Path

STUB_DIR = Path(__file__).resolve().parent
STAND_IN_BACKENDS = STUB_DIR / "backends"  # python-based backends written by this project: <name>/model.py
SCORING_MODEL_PY = STUB_DIR / "scoring_model" / "model.py"
ENGINE_IN_STUB_PY = STAND_IN_BACKENDS / "vllm" / "engine_in_stub.py"
