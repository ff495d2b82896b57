"""The stack's `llm-serving:models`, typed by the program's own schema (infra.config, docs/architecture.md §3.6).

Policies read the same typed models as the program, so a rule and the program can never disagree about a default
(the startup budget's `loadTimeSeconds`, for example). A model entry that does not parse is reported by the rule
that needed it, with the schema's message.
"""

from __future__ import annotations

from pydantic import ValidationError

from infra.config import ModelConfig

from .context import PolicyContextError, StackContext

__all__ = ["ModelConfig", "model_configs", "newest_version"]


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


def _version_key(version: str):
    from packaging.version import InvalidVersion, Version

    try:
        return (0, Version(version), version)
    except InvalidVersion:
        return (1, None, version)


def newest_version(model: ModelConfig) -> str:
    """The newest version: by PEP 440 order when every version parses (v1 < v2 < v10), else the last listed
    (versions are listed in the order they were published)."""
    names = [v.version for v in model.versions]
    keys = [_version_key(n) for n in names]
    if all(k[0] == 0 for k in keys):
        return max(names, key=lambda n: _version_key(n)[1])
    return names[-1]
