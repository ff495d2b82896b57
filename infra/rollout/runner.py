"""Stack runners: what runs `pulumi up` for one stack after the rollout tool has edited its config file.

- `AutomationRunner`: Pulumi's Automation API (`pulumi.automation`) on the project directory, so the update reads
  the edited `stacks/Pulumi.<stack>.yaml` exactly as `pulumi up` would. Written against the real API but NOT
  runnable on this machine: the Automation API drives the Pulumi CLI, which cannot be installed here
  (docs/local-environment.md, "Pulumi offline"). Nothing in the tests calls it.
- `MockRunner`: runs the real program (`infra/__main__.py`) under Pulumi's mock runtime on the edited config file
  (infra.mockrun), then plays the update of the recorded resource graph through `infra.rollout.engine` against the
  stack's recorded live state (a JSON file per stack). This is what the tests and `--runner mock` use. Before each
  update it asks its `PolicyGate` (when given one), as `pulumi up --policy-pack` would.
- `GraphRunner`: the same engine on `infra.rollout.graph.model_graph` of the config file's models, without running
  the program: fast enough for property tests over thousands of updates.
- `RehearsalRunner`: the mock runner's program run and update order, each step carried out by the production
  rehearsal (`make rehearse`) on real pods and a real proxy, over its control socket (infra.rollout.remote).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from infra.rollout import engine
from infra.rollout.engine import Faults, Live, Node
from infra.rollout.stackfile import StackFile

if TYPE_CHECKING:
    from infra.mockrun import StackRun


@dataclass
class UpResult:
    stack: str
    ok: bool
    message: str = ""
    outputs: dict = field(default_factory=dict)
    # model id -> the most replicas its Deployments held at any moment of the update (the engine's worst order)
    peak_replicas: dict[str, int] = field(default_factory=dict)
    steps: list[str] = field(default_factory=list)


class StackRunner(Protocol):
    def config_path(self, stack: str) -> Path:
        """The stack config file this runner's updates read (the rollout tool edits it)."""

    def prepare(self, stack: str) -> None:
        """Called once per stack before its config file is first edited."""

    def up(self, stack: str) -> UpResult:
        """Run one update of `stack` from its config file as it is now."""

    def outputs(self, stack: str) -> dict:
        """The stack's current outputs (`models`: strategy, routeWeights, replicas, ...)."""


# -- Automation API -------------------------------------------------------------------------------------------


class RunnerUnavailable(RuntimeError):
    """The runner cannot run here (no Pulumi CLI); raised before any stack file is edited."""


class AutomationRunner:
    """`pulumi up` through the Automation API. Not runnable here (no Pulumi CLI); see the module docstring."""

    def __init__(self, project_dir: Path, on_output: Callable[[str], None] | None = None,
                 policy_pack: Path | None = None):
        self.project_dir = Path(project_dir)
        self.on_output = on_output
        self.policy_pack = policy_pack

    def config_path(self, stack: str) -> Path:
        from infra.mockrun import stack_config_path

        return stack_config_path(stack, self.project_dir)

    def _stack(self, stack: str):
        from pulumi import automation as auto

        # LocalWorkspace reads Pulumi.yaml (and its stackConfigDir) from work_dir, so the edited file is used as is.
        try:
            return auto.select_stack(stack_name=stack, work_dir=str(self.project_dir))
        except FileNotFoundError as err:
            raise RunnerUnavailable(f"the Automation API needs the Pulumi CLI ({err}); offline, use --runner mock"
                                    ) from None

    def prepare(self, stack: str) -> None:
        # Refresh first: the update must start from what is really deployed, not from the last recorded state.
        self._stack(stack).refresh(on_output=self.on_output, color="never")

    def up(self, stack: str) -> UpResult:
        from pulumi import automation as auto

        try:
            result = self._stack(stack).up(
                on_output=self.on_output, color="never", config_file=str(self.config_path(stack)),
                policy_packs=[str(self.policy_pack)] if self.policy_pack else None)
        except auto.CommandError as err:
            return UpResult(stack, ok=False, message=str(err))
        outputs = {k: v.value for k, v in result.outputs.items()}
        ok = result.summary.result == "succeeded"
        return UpResult(stack, ok=ok, message=result.summary.message or result.summary.result, outputs=outputs)

    def outputs(self, stack: str) -> dict:
        return {k: v.value for k, v in self._stack(stack).outputs().items()}


# -- the engine simulation, on two graph sources ---------------------------------------------------------------


class _SimulatedRunner:
    """Keeps each stack's live state in `state_dir/<stack>.json` and plays every update through the engine."""

    def __init__(self, config_dir: Path, state_dir: Path, faults: dict[str, Faults] | None = None,
                 observe: Callable[[str, Live, str], None] | None = None):
        self.config_dir = Path(config_dir)
        self.state_dir = Path(state_dir)
        self.state_dir.mkdir(parents=True, exist_ok=True)
        self.faults = dict(faults or {})
        self.observe = observe  # (stack, live state, step) after every step of every update

    def config_path(self, stack: str) -> Path:
        return self.config_dir / f"Pulumi.{stack}.yaml"

    def _state_file(self, stack: str) -> Path:
        return self.state_dir / f"{stack}.json"

    def desired(self, stack: str) -> tuple[list[Node], dict]:
        raise NotImplementedError

    def cluster(self, stack: str) -> engine.Cluster:
        """What carries out the update's steps: the simulation (with this stack's injected faults)."""
        return engine.SimulatedCluster(self.faults.get(stack, Faults()))

    def live(self, stack: str) -> Live:
        path = self._state_file(stack)
        if not path.is_file():
            raise RuntimeError(f"stack {stack}: no recorded state in {path}; prepare() deploys the current config "
                               f"first")
        return engine.live_from_json(json.loads(path.read_text())["live"])

    def _save(self, stack: str, live: Live, outputs: dict) -> None:
        self._state_file(stack).write_text(json.dumps({"live": engine.live_to_json(live), "outputs": outputs}))

    def prepare(self, stack: str) -> None:
        """The stack as its file stands is taken as deployed and healthy (the state a real stack starts from)."""
        if self._state_file(stack).is_file():
            return
        nodes, outputs = self.desired(stack)
        self._save(stack, engine.converge(nodes), outputs)

    def up(self, stack: str) -> UpResult:
        live = self.live(stack)
        try:
            nodes, outputs = self.desired(stack)
        except Exception as err:  # the program, the config or a policy failed before any resource changed
            what = "a mandatory policy blocked it" if type(err).__name__ == "PolicyBlocked" else "the program failed"
            return UpResult(stack, ok=False, message=f"{what}: {err}")
        peaks: dict[str, int] = {}

        def observe(state: Live, step: str) -> None:
            for model in {i[0] for r in state.values() if (i := engine.identity(r))}:
                peaks[model] = max(peaks.get(model, 0), sum(engine.model_replicas(state, model).values()))
            if self.observe:
                self.observe(stack, state, step)

        for model in {i[0] for r in live.values() if (i := engine.identity(r))}:
            peaks[model] = sum(engine.model_replicas(live, model).values())
        try:
            outcome = engine.apply_update(live, nodes, observe=observe, cluster=self.cluster(stack))
        except engine.UpdateError as err:  # a step the cluster could not carry out: the update stops there
            outcome = engine.UpdateOutcome(ok=False, message=str(err))
        previous = json.loads(self._state_file(stack).read_text())["outputs"]
        self._save(stack, live, outputs if outcome.ok else previous)
        return UpResult(stack, ok=outcome.ok, message=outcome.message, outputs=outputs if outcome.ok else previous,
                        peak_replicas=peaks, steps=outcome.steps)

    def outputs(self, stack: str) -> dict:
        path = self._state_file(stack)
        return json.loads(path.read_text())["outputs"] if path.is_file() else {}


class PolicyBlocked(RuntimeError):
    """A mandatory policy of the pack rejected the update's resources (before any resource changed)."""


class PolicyGate(Protocol):
    """Checks one update's resources before any of them changes, as `pulumi up --policy-pack policies` would.

    Takes the stack's mock run (its resources, stack name, project and config) and returns the blocking violations,
    one message each (`[policy] resource: message`); an empty sequence lets the update go.

    Why injected rather than imported: `policies/` is the checker and infra is what it checks, so policies import
    infra and infra never imports policies (the import-linter contracts in pyproject.toml, run by `make test`).
    The caller that sees both planes builds the gate and hands it down: `llm-serving rollout` (llm_serving_cli)
    passes `policies.gate.blocking_violations` to `infra.rollout.cli.main`, and the tests pass it explicitly.
    """

    def __call__(self, run: StackRun) -> Sequence[str]: ...


class MockRunner(_SimulatedRunner):
    """The real program under Pulumi's mock runtime on the (edited) config file, then the engine simulation.

    With a `policy_gate` every update is first checked by it (`llm-serving rollout` gives the policy pack's rules,
    run offline), as `pulumi up --policy-pack policies` would: a blocking violation stops the update before any
    resource changes. Without one (None) the updates are not policy-checked; see `PolicyGate` for why the gate is
    injected."""

    def __init__(self, config_dir: Path, state_dir: Path, faults: dict[str, Faults] | None = None,
                 observe: Callable[[str, Live, str], None] | None = None, project_dir: Path | None = None,
                 policy_gate: PolicyGate | None = None):
        super().__init__(config_dir, state_dir, faults, observe)
        self.project_dir = project_dir
        self.policy_gate = policy_gate

    def desired(self, stack: str) -> tuple[list[Node], dict]:
        from infra.mockrun import run_stack

        run = run_stack(stack, config_file=self.config_path(stack), project=self.project_dir)
        if self.policy_gate is not None:
            blocking = list(self.policy_gate(run))
            if blocking:
                raise PolicyBlocked("; ".join(blocking))
        return nodes_of_run(run), run.outputs


class RehearsalRunner(MockRunner):
    """The mock runner's update (the real program under the mock runtime, Pulumi's order, the policy gate), each step
    carried out by the rehearsal's cluster: real pods that must pass their probes, a real proxy whose routes change.
    The stack as its file stands when the rollout begins is what the rehearsal brought up (prepare records it)."""

    def __init__(self, config_dir: Path, state_dir: Path, control: Path, project_dir: Path | None = None,
                 policy_gate: PolicyGate | None = None):
        super().__init__(config_dir, state_dir, project_dir=project_dir, policy_gate=policy_gate)
        self.control = Path(control)

    def cluster(self, stack: str) -> engine.Cluster:
        from infra.rollout.remote import RemoteCluster

        return RemoteCluster(self.control)


class GraphRunner(_SimulatedRunner):
    """The engine on `model_graph` of every model in the config file (no program run; property tests)."""

    def desired(self, stack: str) -> tuple[list[Node], dict]:
        from infra.rollout.graph import model_graph

        typed = StackFile.load(self.config_path(stack)).typed()
        nodes = [n for m in typed.models for n in model_graph(m)]
        return nodes, {}


def nodes_of_run(run: Any) -> list[Node]:
    """A StackRun (infra.mockrun) as engine nodes: inputs as registered, dependencies as keys."""
    keys = {r.urn: f"{r.type}::{r.name}" for r in run.resources}
    nodes = []
    for r in run.resources:
        # The root stack is not recorded (mockrun skips it); any other unknown dependency is an error.
        unknown = [d for d in r.dependencies if d not in keys and "::pulumi:pulumi:Stack::" not in d]
        if unknown:
            raise engine.UpdateError(f"{r.name} depends on unrecorded resources {unknown}")
        nodes.append(Node(r.type, r.name, r.inputs, frozenset(keys[d] for d in r.dependencies if d in keys)))
    return nodes
