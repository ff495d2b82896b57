"""The policy pack as the rollout runner's gate (`infra.rollout.runner.PolicyGate`).

`llm-serving rollout --runner mock` checks every stack update with the pack's rules offline before any resource
changes, as `pulumi up --policy-pack policies` would. The gate lives here, not in infra: policies check infra and
import it, infra never imports policies (the import-linter contracts in pyproject.toml), so the command line above
both planes (llm_serving_cli) hands this function to `infra.rollout.cli.main(argv, policy_gate=...)`.

Importing this module is cheap: `policies.offline` (which needs pulumi_policy, in .venv-infra only) is imported when
the gate is first called, so `llm-serving rollout` in .venv-serving still reaches the rollout CLI's own message.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from infra.mockrun import StackRun


def blocking_violations(run: StackRun) -> list[str]:
    """Every mandatory violation (and every rule that failed) on one stack's mock run, as `[policy] resource:
    message`; advisory and not-applicable findings never block."""
    from .offline import ADVISORY, NOT_APPLICABLE, evaluate

    return [f"[{f.policy}] {f.resource}: {f.message}"
            for f in evaluate(run.resources, run.stack, run.project, run.config)
            if f.enforcement not in (ADVISORY, NOT_APPLICABLE)]
