"""The stack's `llm-serving:models`, typed by the program's own schema (infra.config, docs/architecture.md §3.6).

Policies read the same typed models as the program, so a rule and the program can never disagree about a default
(the startup budget's `loadTimeSeconds`, for example). A model entry that does not parse is reported by the rule
that needed it, with the schema's message. `newest_version` and `active_version` are infra.config's, re-exported: the
stack outputs and the rollout tool need the same answer, and infra never imports policies.
"""

from __future__ import annotations

from pydantic import ValidationError

from infra.config import ModelConfig, active_version, newest_version

from .context import PolicyContextError, StackContext

__all__ = ["ModelConfig", "active_version", "model_configs", "newest_version"]


def model_configs(ctx: StackContext) -> dict[str, ModelConfig]:
    out: dict[str, ModelConfig] = {}
    for i, raw in enumerate(ctx.models()):
        try:
            model = ModelConfig.model_validate(raw)
        except ValidationError as err:
            first = err.errors()[0]
            where = ".".join(str(p) for p in first["loc"])
            raise PolicyContextError(
                f"stack {ctx.stack!r}: llm-serving:models[{i}].{where}: {first['msg']}"
            ) from err
        out[model.id] = model
    return out

