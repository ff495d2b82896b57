"""Stack runners: what runs `pulumi up` for one stack after the rollout tool has edited its config file.

- `AutomationRunner`: Pulumi's Automation API (`pulumi.automation`) on the project directory, so the update reads
  the edited `stacks/Pulumi.<stack>.yaml` exactly as `pulumi up` would. The Automation API drives the Pulumi CLI,
  which cannot be installed on this machine (docs/local-environment.md, "Pulumi offline"): the tests run it against
  a fake `pulumi` that records its arguments and answers as the CLI does (tests/infra/test_rollout_automation.py);
  what that leaves unproven is in docs/first-update.md, "The rollout's Automation runner".
- `MockRunner`: runs the real program (`infra/__main__.py`) under Pulumi's mock runtime on the edited config file
  (infra.mockrun), then plays the update of the recorded resource graph through `infra.rollout.simulator` against the
  stack's recorded live state (a JSON file per stack). This is what the tests and `--runner mock` use. Before each
  update it asks its `PolicyGate` (when given one), as `pulumi up --policy-pack` would.
- `GraphRunner`: the same engine on `infra.rollout.graph.model_graph` of the config file's models, without running
  the program: fast enough for property tests over thousands of updates.
- `RehearsalRunner`: the mock runner's program run and update order, each step carried out by the production
  rehearsal (`make rehearse`) on real pods and a real proxy, over its control socket (infra.rollout.remote).
"""

from __future__ import annotations

import json
import subprocess
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from infra.rollout import simulator
from infra.rollout.simulator import Faults, Live, Node
from infra.rollout.stackfile import StackFile

if TYPE_CHECKING:
    from infra.mockrun import StackRun


@dataclass
class UpResult:
    stack: str
    ok: bool
    message: str = ""
    outputs: dict = field(default_factory=dict)
    # model id -> the most replicas its Deployments held at any moment of the update (the simulator's worst order)
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
    """The runner cannot run here (no usable Pulumi CLI, no Pulumi project); raised before any stack file is
    edited."""


class StackUnavailable(RunnerUnavailable):
    """The CLI runs but this stack cannot be updated from here (no such stack in the backend, no backend login, its
    refresh failed); raised by `prepare`, before this stack's file is edited."""


class AutomationRunner:
    """`pulumi up` through the Automation API on the project directory, with the `pulumi` on PATH.

    Each command's stdout and stderr go to `on_output` line by line as the CLI prints them; a failed command is
    reported by what the CLI said went wrong (`cli_failure`), not by its whole output. Tested against a fake CLI
    (tests/infra/test_rollout_automation.py); what that cannot show is listed in docs/first-update.md."""

    def __init__(self, project_dir: Path, on_output: Callable[[str], None] | None = None,
                 policy_pack: Path | None = None):
        self.project_dir = Path(project_dir)
        if not (self.project_dir / "Pulumi.yaml").is_file():
            raise RunnerUnavailable(f"{self.project_dir} is not a Pulumi project: it has no Pulumi.yaml")
        if policy_pack is not None and not (Path(policy_pack) / "PulumiPolicy.yaml").is_file():
            raise RunnerUnavailable(f"policy pack {policy_pack}: no PulumiPolicy.yaml there")
        self.on_output = on_output
        self.policy_pack = policy_pack
        self._command: Any = None  # pulumi.automation.PulumiCommand, checked once

    def config_path(self, stack: str) -> Path:
        from infra.mockrun import stack_config_path

        return stack_config_path(stack, self.project_dir)

    def _cli(self) -> Any:
        """The CLI on PATH, its version checked once against the SDK's minimum (what `LocalWorkspace` does on every
        construction when given none)."""
        if self._command is None:
            from pulumi import automation as auto

            try:
                self._command = auto.PulumiCommand()
            except FileNotFoundError:  # what subprocess raises for a `pulumi` that is not on PATH
                raise RunnerUnavailable("the Automation API runs the Pulumi CLI and there is no `pulumi` on PATH; "
                                        "install it, or use --runner mock offline") from None
            except PermissionError as err:
                raise RunnerUnavailable(f"the `pulumi` on PATH cannot be run: {err}") from None
            except subprocess.CalledProcessError as err:
                raise RunnerUnavailable(f"`pulumi version` failed (exit status {err.returncode}); the CLI on PATH "
                                        f"is not usable") from None
            except auto.InvalidVersionError as err:
                raise RunnerUnavailable(f"the `pulumi` on PATH is not one this SDK can drive: {err}") from None
        return self._command

    def _stack(self, stack: str, output: _CliOutput) -> Any:
        from pulumi import automation as auto

        # LocalWorkspace reads Pulumi.yaml (and its stackConfigDir) from work_dir, so the edited file is used as is;
        # `stack select` fails here for a stack the backend does not hold.
        output.command = "pulumi stack select"
        return auto.select_stack(stack_name=stack, work_dir=str(self.project_dir),
                                 opts=auto.LocalWorkspaceOptions(pulumi_command=self._cli()))

    def prepare(self, stack: str) -> None:
        """Refresh first: the update must start from what is really deployed, not from the last recorded state."""
        from pulumi import automation as auto

        output = _CliOutput(self.on_output)
        try:
            selected = self._stack(stack, output)
            output.command = "pulumi refresh"
            selected.refresh(on_output=output.out, on_error=output.err, color="never",
                             config_file=str(self.config_path(stack)))
        except auto.CommandError as err:
            raise StackUnavailable(f"stack {stack}: {output.failure(err)} (its stack file was not edited)") from None

    def up(self, stack: str) -> UpResult:
        from pulumi import automation as auto

        output = _CliOutput(self.on_output)
        try:
            selected = self._stack(stack, output)
            output.command = "pulumi up"
            result = selected.up(
                on_output=output.out, on_error=output.err, color="never", config_file=str(self.config_path(stack)),
                policy_packs=[str(self.policy_pack)] if self.policy_pack else None)
        except auto.CommandError as err:
            return UpResult(stack, ok=False, message=output.failure(err))
        outputs = {k: v.value for k, v in result.outputs.items()}
        # The SDK raises for a non-zero exit, so this is the CLI's record of an update it reported as finished.
        ok = result.summary.result == "succeeded"
        return UpResult(stack, ok=ok, message=result.summary.message or result.summary.result, outputs=outputs)

    def outputs(self, stack: str) -> dict:
        from pulumi import automation as auto

        output = _CliOutput(None)
        try:
            selected = self._stack(stack, output)
            output.command = "pulumi stack output"
            return {k: v.value for k, v in selected.outputs().items()}
        except auto.CommandError as err:
            raise StackUnavailable(f"stack {stack}: {output.failure(err)}") from None


class _CliOutput:
    """One Automation API call's output: forwarded line by line (the SDK strips each line's newline), and kept so
    that a failure can be reported by what the CLI said went wrong."""

    def __init__(self, forward: Callable[[str], None] | None):
        self.forward = forward
        self.command = "pulumi"
        self.stdout: list[str] = []
        self.stderr: list[str] = []

    def out(self, line: str) -> None:
        self.stdout.append(line)
        if self.forward:
            self.forward(line)

    def err(self, line: str) -> None:
        self.stderr.append(line)
        if self.forward:
            self.forward(line)

    def failure(self, err: Exception) -> str:
        stdout, stderr = self.stdout, self.stderr
        if not stdout and not stderr:
            # A command the SDK runs without callbacks (`stack select`): its output is only in the CommandError's
            # text, which the SDK writes as "\n code: N\n stdout: ...\n stderr: ..." (pulumi/automation/_cmd.py).
            head, _, err_text = str(err).rpartition("\n stderr: ")
            stdout, stderr = head.partition("\n stdout: ")[2].splitlines(), err_text.splitlines()
        return f"`{self.command}` failed: {cli_failure(stdout, stderr)}"


def cli_failure(stdout: Sequence[str], stderr: Sequence[str]) -> str:
    """What went wrong, from a failed command's output as the CLI prints it (`--color never`, non-interactive):

    - the `Diagnostics:` section's errors, one per resource (`  <type> (<name>):` then `    error: ...` and its
      continuation lines), without the stack's bare `error: update failed` when a resource says more;
    - the `Policies:` section's mandatory violations (`        - [mandatory]  <policy>  (<type>: <name>)`, then the
      policy's description and the violation's message, indented under it);
    - the `error:` lines on stderr (a missing stack, no project, no backend login, a config file that is missing).
    Failing all three, the last lines of stderr, else of stdout, so the message is never empty."""
    found: list[str] = []
    section, resource, block = "", "", []

    def flush() -> None:
        if block:
            found.append(f"{resource}: {' '.join(block)}" if resource else " ".join(block))
        block.clear()

    for raw in stdout:
        line = raw.rstrip()
        if line and not line.startswith(" "):  # a top-level section: `Diagnostics:`, `Policies:`, `Resources:`, ...
            flush()
            section, resource = line.rstrip(":"), ""
            continue
        text = line.strip()
        if section == "Diagnostics":
            if line.startswith("  ") and not line.startswith("   ") and text.endswith(":"):
                flush()
                resource = text[:-1]
            elif text.startswith(("error:", "mandatory:")):
                flush()
                block.append(text)
            elif text and block:
                block.append(text)
            elif not text:
                flush()
        elif section == "Policies":
            if text.startswith("- [mandatory]"):
                flush()
                resource = ""
                block.append(" ".join(text.split()))
            elif text.startswith("- ["):  # an advisory finding: not why the update failed
                flush()
            elif text and block and not text.startswith(("❌", "✅", "⚠")):
                block.append(text)
    flush()
    specific = [f for f in found if not f.endswith(("error: update failed", "error: refresh failed"))]
    found = specific or found
    found += [line.strip() for line in stderr if line.strip().startswith("error:")]
    if not found:
        tail = [line.strip() for line in (stderr if any(s.strip() for s in stderr) else stdout) if line.strip()]
        found = tail[-3:] or ["the CLI printed nothing"]
    return "; ".join(dict.fromkeys(found))


# -- the simulator, on two graph sources -----------------------------------------------------------------------


class _SimulatedRunner:
    """Keeps each stack's live state in `state_dir/<stack>.json` and plays every update through the simulator."""

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

    def cluster(self, stack: str) -> simulator.Cluster:
        """What carries out the update's steps: the simulation (with this stack's injected faults)."""
        return simulator.SimulatedCluster(self.faults.get(stack, Faults()))

    def live(self, stack: str) -> Live:
        path = self._state_file(stack)
        if not path.is_file():
            raise RuntimeError(f"stack {stack}: no recorded state in {path}; prepare() deploys the current config "
                               f"first")
        return simulator.live_from_json(json.loads(path.read_text())["live"])

    def _save(self, stack: str, live: Live, outputs: dict) -> None:
        self._state_file(stack).write_text(json.dumps({"live": simulator.live_to_json(live), "outputs": outputs}))

    def prepare(self, stack: str) -> None:
        """The stack as its file stands is taken as deployed and healthy (the state a real stack starts from)."""
        if self._state_file(stack).is_file():
            return
        nodes, outputs = self.desired(stack)
        self._save(stack, simulator.converge(nodes), outputs)

    def up(self, stack: str) -> UpResult:
        live = self.live(stack)
        try:
            nodes, outputs = self.desired(stack)
        except Exception as err:  # the program, the config or a policy failed before any resource changed
            what = "a mandatory policy blocked it" if type(err).__name__ == "PolicyBlocked" else "the program failed"
            return UpResult(stack, ok=False, message=f"{what}: {err}")
        peaks: dict[str, int] = {}

        def observe(state: Live, step: str) -> None:
            for model in {i[0] for r in state.values() if (i := simulator.identity(r))}:
                peaks[model] = max(peaks.get(model, 0), sum(simulator.model_replicas(state, model).values()))
            if self.observe:
                self.observe(stack, state, step)

        for model in {i[0] for r in live.values() if (i := simulator.identity(r))}:
            peaks[model] = sum(simulator.model_replicas(live, model).values())
        try:
            outcome = simulator.apply_update(live, nodes, observe=observe, cluster=self.cluster(stack))
        except simulator.UpdateError as err:  # a step the cluster could not carry out: the update stops there
            outcome = simulator.UpdateOutcome(ok=False, message=str(err))
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
    """The real program under Pulumi's mock runtime on the (edited) config file, then the simulator.

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

    def cluster(self, stack: str) -> simulator.Cluster:
        from infra.rollout.remote import RemoteCluster

        return RemoteCluster(self.control)


class GraphRunner(_SimulatedRunner):
    """The simulator on `model_graph` of every model in the config file (no program run; property tests)."""

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
            raise simulator.UpdateError(f"{r.name} depends on unrecorded resources {unknown}")
        nodes.append(Node(r.type, r.name, r.inputs, frozenset(keys[d] for d in r.dependencies if d in keys)))
    return nodes
