"""Stack config edits in place (ruamel.yaml round trip) and the `llm-serving rollout` command's argument handling."""

from __future__ import annotations

import difflib
import json
import subprocess
import sys
from pathlib import Path

import pytest

from infra.rollout.cli import main
from infra.rollout.stackfile import StackFile, StackFileError, version_entry
from llm_serving.tensor_contract import VLLM_IO_FINGERPRINT
from tests.infra.rollout_support import REPO_ROOT, copy_stacks

FP = VLLM_IO_FINGERPRINT  # the LLM versions in stacks/ (llm_serving/tensor_contract.py computes it)
V240 = version_entry("2.4.0", "s3://acme-llm-prod-us-east-1/models/model-cache/chat-large/2.4.0/", FP, 132)


@pytest.fixture
def stacks(tmp_path) -> Path:
    return copy_stacks(tmp_path / "stacks")


def test_unchanged_file_round_trips_byte_for_byte(stacks):
    for path in sorted(stacks.glob("Pulumi.*.yaml")):
        original = path.read_text()
        StackFile.load(path).save()
        assert path.read_text() == original, path.name


def test_start_keeps_comments_and_order_and_touches_only_the_model(stacks):
    path = stacks / "Pulumi.prod-us-west-2.yaml"
    original = path.read_text().splitlines()
    sf = StackFile.load(path)
    sf.start("chat-large", V240, 10)
    sf.save()
    edited = path.read_text().splitlines()
    assert edited[:2] == original[:2]  # the header comment
    diff = list(difflib.ndiff(original, edited))
    added = [line[2:] for line in diff if line.startswith("+ ")]
    assert added == ["        - version: 2.4.0",
                     "          package: s3://acme-llm-prod-us-east-1/models/model-cache/chat-large/2.4.0/",
                     f"          ioFingerprint: {FP}", "          weightsGib: 132", "      candidate: 2.4.0",
                     "      weight: 10"]
    assert [line for line in diff if line.startswith("- ")] == []
    assert edited.index("      candidate: 2.4.0") == edited.index("      active: 2.3.0") + 1
    model = StackFile.load(path).model("chat-large")
    assert (model.active, model.candidate, model.weight) == ("2.3.0", "2.4.0", 10)


def test_finalize_and_rollback(stacks):
    path = stacks / "Pulumi.prod-us-east-1.yaml"
    sf = StackFile.load(path)
    with pytest.raises(StackFileError, match="finalized only with its candidate at weight 100"):
        sf.finalize("chat-large")
    sf.set_weight("chat-large", 100)
    assert sf.finalize("chat-large") == "2.3.0"
    sf.save()
    model = StackFile.load(path).model("chat-large")
    assert (model.active, model.candidate, [v.version for v in model.versions]) == ("2.4.0", None, ["2.4.0"])
    assert "# Production, home region" in path.read_text()

    path = stacks / "Pulumi.prod-us-east-1.yaml"
    copy_stacks(stacks)  # back to the shipped file
    sf = StackFile.load(path)
    assert sf.rollback("chat-large") == "2.4.0"
    sf.save()
    model = StackFile.load(path).model("chat-large")
    assert (model.active, model.candidate, model.weight, [v.version for v in model.versions]) == (
        "2.3.0", None, None, ["2.3.0"])


def test_bad_edits_are_refused_with_the_reason(stacks):
    sf = StackFile.load(stacks / "Pulumi.prod-us-east-1.yaml")
    with pytest.raises(StackFileError, match="already rolling out '2.4.0'"):
        sf.start("chat-large", V240, 10)
    with pytest.raises(StackFileError, match="no model 'nope'"):
        sf.model("nope")
    with pytest.raises(StackFileError, match="has no candidate"):
        sf.set_weight("embed-base", 10)
    sf.set_weight("chat-large", 101)
    with pytest.raises(StackFileError, match=r"invalid:\nllm-serving:models\[0\]\.weight: .*100"):
        sf.save()
    west = StackFile.load(stacks / "Pulumi.prod-us-west-2.yaml")
    with pytest.raises(StackFileError, match="the newest version '4.0.0' is never removed"):
        west.remove_versions("ranker", {"4.0.0"}, newest="4.0.0")
    with pytest.raises(StackFileError, match="is versioned; a candidate is red-black only"):
        west.start("ranker", V240, 10)
    with pytest.raises(StackFileError, match="no such stack config file"):
        StackFile.load(stacks / "Pulumi.nope.yaml")


def test_cli_refuses_bad_arguments_before_changing_anything(stacks, tmp_path, capsys):
    before = {p.name: p.read_text() for p in stacks.glob("*.yaml")}
    common = ["--runner", "mock", "--config-dir", str(stacks), "--state-dir", str(tmp_path / "state")]
    assert main(["start", "chat-large", "--stacks", "prod-us-west-2", *common]) == 2
    assert "start needs --version" in capsys.readouterr().err
    assert main(["start", "chat-large", "--stacks", "prod-us-west-2", "--version", "9.9.9", *common]) == 2
    assert "--version 9.9.9: no stack in" in capsys.readouterr().err
    assert main(["advance", "nope", "--stacks", "prod-us-west-2", *common]) == 2
    assert "no model 'nope'" in capsys.readouterr().err
    assert main(["abort", "ranker", "--stacks", "prod-us-west-2", *common]) == 2
    assert "is versioned: there is nothing to abort" in capsys.readouterr().err
    assert main(["advance", "chat-large", "--stacks", "prod-us-east-1,prod-us-east-1", *common]) == 2
    assert "named twice" in capsys.readouterr().err
    assert main(["advance", "chat-large", "--stacks", "prod-us-east-1", "--prometheus", "prod-eu-west-1=http://x",
                 *common]) == 2
    assert "prod-eu-west-1 is not in --stacks" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["advance", "chat-large", "--stacks", "prod-us-east-1", "--steps", "10,50", *common])
    assert "the last weight must be 100" in capsys.readouterr().err
    assert {p.name: p.read_text() for p in stacks.glob("*.yaml")} == before
    assert not (tmp_path / "state").exists() or not list((tmp_path / "state").iterdir())


def test_llm_serving_rollout_status_through_the_main_cli(stacks, tmp_path):
    """The lead's `llm-serving` dispatches `rollout` to infra.rollout.cli (in .venv-infra, where this runs)."""
    cmd = [sys.executable, "-c", "from llm_serving_cli.main import main; main()", "rollout", "status", "chat-large",
           "--stacks", "prod-us-east-1,prod-us-west-2", "--runner", "mock", "--config-dir", str(stacks),
           "--state-dir", str(tmp_path / "state"), "--json"]
    proc = subprocess.run(cmd, cwd=REPO_ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    rows = json.loads(proc.stdout)
    assert [r["stack"] for r in rows] == ["prod-us-east-1", "prod-us-west-2"]
    assert rows[0]["config"] == "2.3.0 75% | 2.4.0 25%" and rows[0]["next"] == "weight 50"
    assert rows[0]["planned"] == {"2.3.0": {"replicas": 3, "weight": 75}, "2.4.0": {"replicas": 1, "weight": 25}}
    assert rows[1]["next"] == "start" and rows[1]["deployed"] is None  # nothing recorded for the mock runner yet
    help_proc = subprocess.run([*cmd[:3], "rollout", "--help"], cwd=REPO_ROOT, capture_output=True, text=True,
                               timeout=60)
    assert help_proc.returncode == 0 and "--stacks" in help_proc.stdout


def test_automation_runner_without_the_pulumi_cli_fails_before_editing(tmp_path, capsys):
    """The default runner is the Automation API, which drives the Pulumi CLI; on this machine there is none
    (docs/local-environment.md, "Pulumi offline"), and the command says so before touching any file."""
    project = tmp_path / "project"
    copy_stacks(project / "stacks")
    (project / "Pulumi.yaml").write_text((REPO_ROOT / "Pulumi.yaml").read_text())
    (project / "policies").symlink_to(REPO_ROOT / "policies")  # the pack every automation update runs
    before = {p.name: p.read_text() for p in (project / "stacks").glob("*.yaml")}
    assert main(["advance", "chat-large", "--stacks", "prod-us-east-1", "--project", str(project), "--no-gate"]) == 2
    assert "there is no `pulumi` on PATH" in " ".join(capsys.readouterr().err.split())
    assert {p.name: p.read_text() for p in (project / "stacks").glob("*.yaml")} == before
