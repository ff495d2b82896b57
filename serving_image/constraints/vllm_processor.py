"""The class vLLM loads from the `vllm.logits_processors` entry point: one processor for either model runner.

vLLM instantiates every class in that entry-point group. Model runner V1 (the CPU build; GPUs with
VLLM_USE_V2_MODEL_RUNNER=0) wants a subclass of `vllm.v1.sample.logits_processor.LogitsProcessor`; model runner V2
(vLLM 0.31+ on GPUs by default) wants a subclass of `vllm.v1.worker.gpu.sample.logits_processor.LogitsProcessor`
and refuses to start with anything else in the group. So the entry-point class subclasses both and hands every call
to the V1 or V2 implementation, chosen by the constructor vLLM calls. On a vLLM without the V2 interface (older
releases, e.g. the one a Triton image pins) it is simply the V1 processor.
"""

from __future__ import annotations

from typing import Any

from vllm.v1.sample.logits_processor import LogitsProcessor as V1LogitsProcessor

from serving_image.constraints.vllm_v1 import ConstraintLogitsProcessorV1

try:
    from vllm.v1.worker.gpu.sample.logits_processor import LogitsProcessor as V2LogitsProcessor
except ImportError:  # vLLM before 0.31
    V2LogitsProcessor = None


if V2LogitsProcessor is None:

    class ConstraintLogitsProcessor(ConstraintLogitsProcessorV1):
        """The V1 processor (this vLLM has no model runner V2)."""

else:

    class ConstraintLogitsProcessor(V1LogitsProcessor, V2LogitsProcessor):  # type: ignore[misc,no-redef]
        """Per-request constraints for whichever model runner constructs it."""

        @classmethod
        def validate_params(cls, sampling_params) -> None:
            ConstraintLogitsProcessorV1.validate_params(sampling_params)

        def __init__(self, vllm_config, *args: Any) -> None:
            if len(args) == 2:  # V1: (vllm_config, device, is_pin_memory)
                self._impl = ConstraintLogitsProcessorV1(vllm_config, *args)
            elif len(args) == 1:  # V2: (vllm_config, req_states)
                from serving_image.constraints.vllm_v2 import ConstraintLogitsProcessorV2

                self._impl = ConstraintLogitsProcessorV2(vllm_config, *args)
            else:
                raise TypeError(f"unexpected constructor arguments for a logits processor: {len(args) + 1}")

        @property
        def impl(self):
            return self._impl

        # V1 interface
        def is_argmax_invariant(self) -> bool:
            return False

        def update_state(self, batch_update) -> None:
            self._impl.update_state(batch_update)

        # both: V1 calls apply(logits), V2 apply(logits, ctx)
        def apply(self, logits, ctx=None):
            return self._impl.apply(logits) if ctx is None else self._impl.apply(logits, ctx)

        # V2 interface
        def add_request(self, req_idx: int, sampling_params) -> bool:
            return self._impl.add_request(req_idx, sampling_params)

        def apply_staged_writes(self) -> None:
            pass  # the state lives on the host; nothing to stage
