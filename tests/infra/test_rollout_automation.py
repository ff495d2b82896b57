"""`AutomationRunner` (the runner a real rollout uses) through the real Automation API (pulumi 3.272's
`pulumi.automation`) against a fake `pulumi` on PATH.

Stand-in: the fake CLI (tests/infra/fake_pulumi/cli.py), because the real one cannot be installed here. It records
every invocation and answers in the CLI's shapes (`pulumi version`, `stack select`, `refresh`, `up`, `stack history
--json`, `stack output --json`, the CLI's error texts). So these tests prove the commands and flags the runner makes
the SDK issue, where they run, how the SDK's parsing of the answers reaches `UpResult`, and how each failure is
reported; not what the real engine, backend or policy pack do (docs/first-update.md, "The rollout's Automation
runner").
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from pulumi import automation as auto

from infra.rollout.cli import main
from infra.rollout.runner import AutomationRunner, RunnerUnavailable, StackUnavailable, cli_failure
from infra.rollout.stackfile import StackFile
from tests.infra.fake_pulumi import FakePulumi
from tests.infra.rollout_support import REPO_ROOT, copy_stacks

STACK = "prod-us-east-1"
MODEL = "chat-large"  # at 25% of a red-black rollout 2.3.0 -> 2.4.0 in the shipped prod-us-east-1
OUTPUTS = {"models": {MODEL: {"routeWeights": {"2.3.0": 75, "2.4.0": 25}, "replicas": {"2.3.0": 4, "2.4.0": 1}}},
           "kubeconfig": "apiVersion: v1"}
FAILED_UP = """\
 ~  kubernetes:apps/v1:Deployment chat-large-2-4-0 updating (0s) [diff: ~spec]
 ~  kubernetes:apps/v1:Deployment chat-large-2-4-0 **updating failed** [diff: ~spec]; error: 1 error occurred:
    pulumi:pulumi:Stack llm-serving-prod-us-east-1 running error: update failed
    pulumi:pulumi:Stack llm-serving-prod-us-east-1 **failed** 1 error
Diagnostics:
  kubernetes:apps/v1:Deployment (chat-large-2-4-0):
    error: 1 error occurred:
    \t* the Kubernetes API server reported that "llm-serving/chat-large-2-4-0" failed to fully initialize or become \
live: Timeout occurred polling for 'chat-large-2-4-0'

  pulumi:pulumi:Stack (llm-serving-prod-us-east-1):
    error: update failed

Resources:
    12 unchanged

Duration: 10m2s
"""
DEPLOYMENT_ERROR = ("kubernetes:apps/v1:Deployment (chat-large-2-4-0): error: 1 error occurred: * the Kubernetes API "
                    "server reported that \"llm-serving/chat-large-2-4-0\" failed to fully initialize or become live: "
                    "Timeout occurred polling for 'chat-large-2-4-0'")


@pytest.fixture
def project(tmp_path) -> Path:
    """A copy of the Pulumi project: its Pulumi.yaml, copies of the shipped stack files, the real policy pack."""
    root = tmp_path / "project"
    root.mkdir()
    shutil.copy(REPO_ROOT / "Pulumi.yaml", root / "Pulumi.yaml")
    copy_stacks(root / "stacks")
    (root / "policies").symlink_to(REPO_ROOT / "policies")
    return root


@pytest.fixture
def fake(tmp_path, monkeypatch) -> FakePulumi:
    pulumi = FakePulumi(tmp_path / "fake").install(monkeypatch)
    pulumi.script(stacks=[STACK], outputs={STACK: OUTPUTS}, secret_outputs=["kubeconfig"])
    return pulumi


def _runner(project: Path, lines: list[str] | None = None) -> AutomationRunner:
    return AutomationRunner(project, on_output=None if lines is None else lines.append,
                            policy_pack=project / "policies")


def _stack_cmd(*args: str) -> list[str]:
    return ["--non-interactive", *args, "--stack", STACK]


def test_prepare_selects_the_stack_and_refreshes_it_from_the_project_directory(project, fake, monkeypatch):
    monkeypatch.setenv("PULUMI_CONFIG_PASSPHRASE", "not-recorded")  # a passphrase secrets provider's, passed through
    lines: list[str] = []
    _runner(project, lines).prepare(STACK)
    config = str(project / "stacks" / f"Pulumi.{STACK}.yaml")
    assert fake.argv() == [
        ["version"],  # the SDK's minimum-version check, once per runner
        _stack_cmd("stack", "select"),
        _stack_cmd("refresh", "--skip-preview", "--yes", "--color", "never", "--config-file", config,
                   "--exec-kind", "auto.local"),
        _stack_cmd("stack", "history", "--json", "--show-secrets", "--page-size", "1", "--page", "1"),
    ]
    calls = fake.calls()
    assert {c["cwd"] for c in calls[1:]} == {str(project)}  # the directory that holds Pulumi.yaml
    assert all(c["env"]["PULUMI_AUTOMATION_API"] == "true" for c in calls[1:])
    assert calls[0]["env"]["PULUMI_SKIP_UPDATE_CHECK"] == "true"
    assert {c["env"]["PULUMI_CONFIG_PASSPHRASE"] for c in calls} == {"set"}
    # The CLI's lines reach on_output one by one, without their newlines (the SDK strips them).
    assert lines[0] == f"Refreshing ({STACK}):" and "Resources:" in lines
    assert [h["kind"] for h in fake.history(STACK)] == ["refresh"]


def test_up_runs_the_edited_file_with_the_policy_pack_and_returns_the_clis_outputs(project, fake):
    runner = _runner(project)
    runner.prepare(STACK)
    sf = StackFile.load(runner.config_path(STACK))
    sf.set_weight(MODEL, 50)
    sf.save()
    result = runner.up(STACK)

    config = str(project / "stacks" / f"Pulumi.{STACK}.yaml")
    up_calls = fake.argv()[4:]
    assert up_calls == [
        _stack_cmd("stack", "select"),
        _stack_cmd("up", "--yes", "--skip-preview", "--policy-pack", str(project / "policies"), "--color", "never",
                   "--config-file", config, "--exec-kind", "auto.local"),
        _stack_cmd("stack", "output", "--json"),
        _stack_cmd("stack", "output", "--json", "--show-secrets"),
        _stack_cmd("stack", "history", "--json", "--show-secrets", "--page-size", "1", "--page", "1"),
    ]
    assert "event-log" not in json.dumps(up_calls)  # no on_event: the SDK starts no event log
    assert result.ok and result.stack == STACK and result.message == "succeeded"
    # Outputs as `stack output --json --show-secrets` gave them: the secret one in plain text.
    assert result.outputs == OUTPUTS
    assert runner.outputs(STACK) == OUTPUTS
    # The update read the edited file: the CLI recorded its config as of the edit.
    update = fake.history(STACK)[-1]
    assert update["kind"] == "update" and update["result"] == "succeeded"
    models = update["config"]["llm-serving:models"]["objectValue"]
    assert next(m for m in models if m["id"] == MODEL)["weight"] == 50


def test_a_failed_update_is_reported_by_the_clis_diagnostics(project, fake):
    fake.script(stacks=[STACK], outputs={STACK: OUTPUTS}, fail={"up": {"code": 255, "stdout": FAILED_UP}})
    lines: list[str] = []
    result = _runner(project, lines).up(STACK)
    assert not result.ok and result.outputs == {}
    # The resource's error, not the stack's bare "update failed", and not the whole output.
    assert result.message == f"`pulumi up` failed: {DEPLOYMENT_ERROR}"
    assert "Diagnostics:" in lines  # the operator still saw everything the CLI printed
    assert fake.history(STACK)[-1]["result"] == "failed"


def test_a_mandatory_policy_violation_is_the_failed_updates_message(project, fake):
    policies = """\
Policies:
    \u274c llm-serving-policies@v0.0.1 (local: policies)
        - [mandatory]  red-black-io-fingerprint  (kubernetes:apps/v1:Deployment: chat-large-2-4-0)
          A red-black candidate serves the active version's I/O contract.
          chat-large 2.4.0 has ioFingerprint sha256:aa, the active 2.3.0 has sha256:bb
        - [advisory]  cost-gpu-hours  (pulumi:pulumi:Stack: llm-serving-prod-us-east-1)
          GPU hours rise by 12%

Resources:
    12 unchanged
"""
    fake.script(stacks=[STACK], fail={"up": {"stdout": policies,
                                             "stderr": "error: update failed: policy violations found"}})
    result = _runner(project).up(STACK)
    assert not result.ok
    assert result.message == (
        "`pulumi up` failed: - [mandatory] red-black-io-fingerprint (kubernetes:apps/v1:Deployment: chat-large-2-4-0) "
        "A red-black candidate serves the active version's I/O contract. chat-large 2.4.0 has ioFingerprint "
        "sha256:aa, the active 2.3.0 has sha256:bb; error: update failed: policy violations found")


def test_a_stack_the_backend_lacks_stops_prepare_naming_the_clis_error(project, fake):
    fake.script(stacks=["prod-us-west-2"])
    with pytest.raises(StackUnavailable, match=rf"stack {STACK}: `pulumi stack select` failed: error: no stack named "
                                               rf"'{STACK}' found \(its stack file was not edited\)"):
        _runner(project).prepare(STACK)
    # up reports the same as a failed update, outputs() as an error (`rollout status` shows it per stack)
    assert _runner(project).up(STACK).message == f"`pulumi stack select` failed: error: no stack named '{STACK}' found"
    with pytest.raises(StackUnavailable, match="no stack named"):
        _runner(project).outputs(STACK)


def test_a_refresh_without_a_backend_login_stops_prepare(project, fake):
    login = "error: PULUMI_ACCESS_TOKEN must be set for login during non-interactive CLI sessions"
    fake.script(stacks=[STACK], fail={"refresh": {"stderr": login}})
    with pytest.raises(StackUnavailable, match=rf"`pulumi refresh` failed: {login}"):
        _runner(project).prepare(STACK)


def test_a_missing_config_file_fails_the_update_with_the_clis_error(project, fake):
    runner = _runner(project)
    runner.config_path(STACK).unlink()
    result = runner.up(STACK)
    assert result.message == f"`pulumi up` failed: error: open {runner.config_path(STACK)}: no such file or directory"


def test_no_cli_on_path_is_runner_unavailable(project, tmp_path, monkeypatch):
    empty = tmp_path / "empty-bin"
    empty.mkdir()
    monkeypatch.setenv("PATH", str(empty))
    # What the SDK itself raises (subprocess, running `pulumi version`): the runner turns it into a clear error.
    with pytest.raises(FileNotFoundError):
        auto.PulumiCommand()
    with pytest.raises(RunnerUnavailable, match=r"no `pulumi` on PATH; install it, or use --runner mock"):
        _runner(project).prepare(STACK)


@pytest.mark.parametrize("answer, message", [
    ({"version": "v3.0.0"}, r"not one this SDK can drive: Minimum version requirement failed.*3\.1\.0.*3\.0\.0"),
    ({"version": "v4.1.0"}, r"not one this SDK can drive: Major version mismatch"),
    ({"fail": {"version": {"code": 1, "stderr": "panic"}}}, r"`pulumi version` failed \(exit status 1\)"),
])
def test_an_unusable_cli_is_runner_unavailable(project, fake, answer, message):
    fake.script(stacks=[STACK], **answer)
    with pytest.raises(RunnerUnavailable, match=message):
        _runner(project).prepare(STACK)


def test_the_runner_refuses_a_directory_that_is_not_a_project(tmp_path, project):
    with pytest.raises(RunnerUnavailable, match=r"is not a Pulumi project: it has no Pulumi.yaml"):
        AutomationRunner(tmp_path / "nowhere")
    with pytest.raises(RunnerUnavailable, match=r"policy pack .*stacks: no PulumiPolicy.yaml there"):
        AutomationRunner(project, policy_pack=project / "stacks")


def test_cli_failure_without_any_error_line_keeps_the_last_lines():
    assert cli_failure(["Updating (s):", "", "Duration: 3s"], []) == "Updating (s):; Duration: 3s"
    assert cli_failure([], ["", "killed"]) == "killed"
    assert cli_failure([], []) == "the CLI printed nothing"


# -- the rollout command with this runner ---------------------------------------------------------------------


def _rollout(project: Path, *args: str) -> list[str]:
    return [*args, MODEL, "--stacks", STACK, "--runner", "automation", "--no-gate", "--project", str(project),
            "--json"]


@pytest.mark.timeout(600)
def test_rollout_advance_with_the_automation_runner_end_to_end(project, fake, capsys):
    """`advance` edits the copy's stack file, refreshes, runs `up` on it; the fake's `up` answers with the real
    program's outputs under the mock runtime for the file it was given (one program run)."""
    fake.script(stacks=[STACK], program=True, secret_outputs=["kubeconfig"])
    assert main(_rollout(project, "advance")) == 0
    out = capsys.readouterr()
    report = json.loads(out.out)
    assert report["ok"] and report["stacks"][0]["status"] == "advanced"
    config = project / "stacks" / f"Pulumi.{STACK}.yaml"
    assert StackFile.load(config).model(MODEL).weight == 50
    verbs = [a[1] if a[1] != "stack" else " ".join(a[1:3]) for a in fake.argv()[1:]]
    assert verbs == ["stack select", "refresh", "stack history", "stack select", "up", "stack output",
                     "stack output", "stack history"]
    up = next(a for a in fake.argv()[1:] if a[1] == "up")
    assert up[up.index("--config-file") + 1] == str(config)
    assert up[up.index("--policy-pack") + 1] == str(project / "policies")
    assert "Updating (prod-us-east-1):" in out.err.splitlines()  # the CLI's lines, one per line

    # `status` reads what is deployed from the stack's outputs: the program's route weights for the edited file.
    assert main(_rollout(project, "status")) == 0
    row = json.loads(capsys.readouterr().out)[0]
    assert row["deployed"]["routeWeights"] == {"2.3.0": 50, "2.4.0": 50}


def test_rollout_with_a_failed_update_rolls_back_and_reports_the_clis_message(project, fake, capsys):
    fake.script(stacks=[STACK], outputs={STACK: OUTPUTS}, fail={"up": {"stdout": FAILED_UP}})
    assert main(_rollout(project, "advance")) == 1
    entry = json.loads(capsys.readouterr().out)["stacks"][0]
    # The rollback's update failed the same way: both messages are the CLI's diagnostics, for a person to act on.
    assert entry["status"] == "rollback failed"
    assert entry["detail"] == (f"update failed: `pulumi up` failed: {DEPLOYMENT_ERROR}; the rollback update failed "
                               f"too, act by hand: `pulumi up` failed: {DEPLOYMENT_ERROR}")
    assert [a[1] for a in fake.argv()[1:] if a[1] == "up"] == ["up", "up"]


def test_rollout_without_a_cli_changes_nothing(project, tmp_path, monkeypatch, capsys):
    empty = tmp_path / "empty-bin"
    empty.mkdir()
    monkeypatch.setenv("PATH", str(empty))
    config = project / "stacks" / f"Pulumi.{STACK}.yaml"
    before = config.read_text()
    assert main(_rollout(project, "advance")) == 2
    assert "no `pulumi` on PATH" in capsys.readouterr().err
    assert config.read_text() == before
