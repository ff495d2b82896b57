"""A vLLM general plugin that keeps the CPU engine alive on requests it is known to die on.

vLLM rewinds a seeded request's random generator when it discards a token sampled for a row still in chunked
prefill (a long prompt, or a preempted request being prefilled again): `gen.set_offset(gen.get_offset() - 4)` in
the model runner. CPU generators have no offset (that is CUDA's Philox), so the call raises
`RuntimeError: CPU Generator does not use offset` inside the engine core, and every request in flight dies with it
(docs/local-environment.md, "vLLM on CPU"). Any client could take the engine down by sending `seed` at the wrong moment.

The plugin gives the model runner, on the CPU only, a generator whose offset calls are no-ops. The cost: a seeded
request whose sample was discarded has drawn a few extra random numbers, so its output can differ from a run in
which it was never chunked or preempted; identical runs under identical load still give identical outputs. GPUs keep
vLLM's own generators. Registered through the `vllm.general_plugins` entry point, so vLLM loads it in every
process it starts, before the model runner creates a generator.
"""

from __future__ import annotations

import logging
import types

log = logging.getLogger(__name__)
_PATCHED_ATTR = "_llm_serving_cpu_generator"


def _cpu_generator_class(torch):
    class CpuSafeGenerator(torch.Generator):
        """torch.Generator for the CPU whose offset calls (a CUDA Philox notion) do nothing instead of raising."""

        def get_offset(self) -> int:
            if self.device.type == "cpu":
                return 0
            return super().get_offset()

        def set_offset(self, offset: int):
            if self.device.type == "cpu":
                return self
            return super().set_offset(offset)

    return CpuSafeGenerator


def patch_model_runner() -> bool:
    """Give vLLM's model-runner module a `torch` whose Generator is CPU-safe. Idempotent; returns True if applied."""
    import torch
    from vllm.v1.worker import gpu_model_runner

    if getattr(gpu_model_runner, _PATCHED_ATTR, False):
        return False
    # A module object sharing torch's namespace, with Generator replaced: only the runner's own `torch.Generator(`
    # calls change; torch itself, and every other module, keep the real class.
    shim = types.ModuleType("torch")
    shim.__dict__.update(torch.__dict__)
    shim.Generator = _cpu_generator_class(torch)
    gpu_model_runner.torch = shim
    setattr(gpu_model_runner, _PATCHED_ATTR, True)
    return True


def register() -> None:
    from vllm.platforms import current_platform

    from serving_image.engine.shm_ledger import record_created_segments

    record_created_segments()  # every platform: the shutdown leak it repairs is not a CPU one

    if not current_platform.is_cpu():
        return
    if patch_model_runner():
        log.info("llm-serving: CPU-safe generators for seeded requests (chunked prefill no longer kills the engine)")
