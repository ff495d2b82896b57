"""The engine arguments of the suite's vLLM engines.

Eager: no graph compilation at start. Compilation is most of an engine's start on 2 cores (55-75 s of a compiled
demo-tiny start, against seconds eager) and made up most of `make test`'s time. One server keeps the compiled path,
as production runs it: the standalone tritonserver shared by the KServe, example and model-kind tests
(tests/serving/conftest.py, TRITON_ENGINE_ARGS). float32: see docs/local-environment.md (this VM SIGILLs in vLLM's
bf16 AMX attention kernel).
"""

from __future__ import annotations

from bench.local_server import ENGINE_ARGS

EAGER_ENGINE_ARGS = {**ENGINE_ARGS, "enforce_eager": True}
