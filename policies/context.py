"""Which stack a policy is looking at: its name, environment and configuration.

Two ways in, one shape out:
- offline (`policies.offline`, the tests): the runner passes `{"stack": ..., "project": ..., "stackConfig": {...}}`
  as the policy configuration of every validation call (`ResourceValidationArgs.config`,
  `StackValidationArgs.config`);
- under `pulumi preview --policy-pack policies`, the CLI starts the pack with `PULUMI_STACK`, `PULUMI_PROJECT` and
  the stack's configuration in its environment (pulumi_policy configures the runtime from them before each
  analysis), so the same values come from `pulumi.get_stack()` and the runtime's config.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import pulumi

PROJECT = "llm-serving"
ENVIRONMENTS = ("dev", "staging", "prod")


class PolicyContextError(ValueError):
    """The stack's name or config cannot be interpreted; the message names the value."""


@dataclass(frozen=True)
class StackContext:
    stack: str
    project: str = PROJECT
    # Keys without the project prefix ("models", not "llm-serving:models"); JSON strings already decoded.
    config: Mapping[str, Any] = field(default_factory=dict)

    @property
    def env(self) -> str:
        """`llm-serving:env` (or `environment`) when the stack sets it, else the stack name's `<env>-` prefix."""
        for key in ("env", "environment"):
            value = self.config.get(key)
            if isinstance(value, str) and value:
                return value
        prefix = self.stack.split("-", 1)[0]
        if prefix not in ENVIRONMENTS:
            raise PolicyContextError(
                f"stack {self.stack!r}: cannot tell its environment; name stacks <env>-<region> with env one of "
                f"{', '.join(ENVIRONMENTS)}, or set llm-serving:env"
            )
        return prefix

    @property
    def is_prod(self) -> bool:
        return self.env == "prod"

    def models(self) -> list[Mapping[str, Any]]:
        value = self.config.get("models")
        if value is None:
            return []
        if not isinstance(value, list) or not all(isinstance(m, Mapping) for m in value):
            raise PolicyContextError(f"stack {self.stack!r}: llm-serving:models must be a list of objects")
        return list(value)


def normalise_config(raw: Mapping[str, Any], project: str = PROJECT) -> dict[str, Any]:
    """`{"llm-serving:models": "[...]", "aws:region": "..."}` -> `{"models": [...]}` (this project's keys only;
    keys given without a namespace are kept as they are)."""
    out: dict[str, Any] = {}
    for key, value in raw.items():
        if ":" in key:
            namespace, _, short = key.partition(":")
            if namespace != project:
                continue
        else:
            short = key
        out[short] = _decode(value)
    return out


def _decode(value: Any) -> Any:
    # Pulumi hands object and list config values to programs as JSON strings.
    if isinstance(value, str) and value[:1] in ("[", "{"):
        try:
            return json.loads(value)
        except json.JSONDecodeError:
            return value
    return value


def offline_policy_config(stack: str, project: str, config: Mapping[str, Any]) -> dict[str, Any]:
    """What the offline runner passes as each policy's configuration."""
    return {"stack": stack, "project": project, "stackConfig": dict(config)}


def stack_context(args: Any) -> StackContext:
    """The context of a ResourceValidationArgs or StackValidationArgs (see the module docstring)."""
    policy_config = args.get_config() or {}
    if "stack" in policy_config:
        project = policy_config.get("project") or PROJECT
        return StackContext(
            stack=policy_config["stack"],
            project=project,
            config=normalise_config(policy_config.get("stackConfig") or {}, project),
        )
    project = pulumi.get_project()
    return StackContext(
        stack=pulumi.get_stack(),
        project=project,
        config=normalise_config(pulumi.runtime.get_config_env(), project),
    )
