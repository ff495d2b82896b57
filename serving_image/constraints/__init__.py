"""Per-request step-wise constraints (docs/architecture.md §3.5): the native core and its thin Python layer.

- `validate_constraint` (spec.py): the one validation every front-end calls; light, no torch/vLLM imports.
- `machines`: compile a spec into the C++ core's machine, the rows' states, bitmask fill/apply.
- `reference`: the pure-Python per-request reference semantics.
- `vllm_v1` / `vllm_v2`: the vLLM batch logits processors (model runner V1 / V2 interfaces).
"""

from serving_image.constraints.spec import (
    AllowedTokensSpec,
    ChoiceSequenceSpec,
    ConstraintError,
    ConstraintSpec,
    TokenDfaSpec,
    spec_to_json,
    validate_constraint,
)

__all__ = [
    "AllowedTokensSpec",
    "ChoiceSequenceSpec",
    "ConstraintError",
    "ConstraintSpec",
    "TokenDfaSpec",
    "spec_to_json",
    "validate_constraint",
]
