"""A fake `pulumi` CLI for the AutomationRunner tests (a stand-in: the real CLI cannot be installed here).

Answers the commands Pulumi's Automation API (pulumi 3.272, `pulumi/automation/_cmd.py`, `_local_workspace.py`,
`_stack.py`) issues for a local program, in the shapes the SDK parses and the real CLI prints:

- `version`: `v3.272.0` (the SDK refuses < 3.1.0 and another major version);
- `stack select --stack S`: `error: no stack named 'S' found` for a stack the backend lacks (the SDK turns this text
  into StackNotFoundError);
- `refresh` and `up`: progress text on stdout, one history entry (kind, startTime/endTime in the CLI's
  `2006-01-02T15:04:05.000Z` format, config, result, resourceChanges), exit 255 with a `Diagnostics:` section on a
  failed update; `up` reads the stack config file (`--config-file`, else `<stackConfigDir>/Pulumi.<S>.yaml`) and
  answers `error: open <path>: no such file or directory` when it is missing;
- `stack history --json [--show-secrets] [--page-size N --page P]`: the entries, newest first;
- `stack output --json [--show-secrets]`: the outputs, secret ones as `[secret]` unless `--show-secrets`;
- any command run outside a project: `error: no Pulumi.yaml project file found (searching upwards from ...)`.

Every invocation is appended to `$FAKE_PULUMI_DIR/calls.jsonl` (argv, cwd, the PULUMI_* variables the SDK sets, the
passphrase as set/unset only) before it is answered. What to answer comes from `$FAKE_PULUMI_DIR/script.json`:

    {"version": "v3.272.0",
     "stacks": ["dev-us-east-1"],                        # the backend's stacks
     "outputs": {"dev-us-east-1": {...}},                # what a succeeded `up` leaves as outputs (literal), or
     "program": true,                                    # ... the real program's outputs under the mock runtime
     "secret_outputs": ["kubeconfig"],
     "fail": {"up": {"code": 255, "stdout": "...", "stderr": "..."}}}   # per command: `up`, `refresh`,
                                                         # `stack select`, `stack output`, `version`, ...

State (each stack's history and outputs) is kept in `$FAKE_PULUMI_DIR/state/<stack>.json`, as a backend would.
"""

from __future__ import annotations

import datetime as dt
import json
import os
import sys
from pathlib import Path

from llm_serving.repository import REPO_ROOT

ROOT = Path(os.environ["FAKE_PULUMI_DIR"])

ENV_RECORDED = ("PULUMI_HOME", "PULUMI_AUTOMATION_API", "PULUMI_DEBUG_COMMANDS", "PULUMI_SKIP_UPDATE_CHECK",
                "PULUMI_BACKEND_URL", "PULUMI_AUTOMATION_API_SKIP_VERSION_CHECK")
# Flags that take a value (everything else is a boolean flag or a positional argument).
VALUED = {"--stack", "-s", "--color", "--config-file", "--policy-pack", "--policy-pack-config", "--exec-kind",
          "--page-size", "--page", "--message", "-m", "--parallel", "-p", "--target", "--exclude", "--replace",
          "--event-log", "--client", "--cwd", "-C"}


class Exit(Exception):
    def __init__(self, code: int, stdout: str = "", stderr: str = ""):
        self.code, self.stdout, self.stderr = code, stdout, stderr


def parse(argv: list[str]) -> tuple[list[str], dict[str, list[str]]]:
    words, flags = [], {}
    i = 0
    while i < len(argv):
        arg = argv[i]
        if arg.startswith("-") and "=" in arg:
            key, _, value = arg.partition("=")
            flags.setdefault(key, []).append(value)
        elif arg in VALUED:
            flags.setdefault(arg, []).append(argv[i + 1])
            i += 1
        elif arg.startswith("-"):
            flags.setdefault(arg, []).append("true")
        else:
            words.append(arg)
        i += 1
    return words, flags


def now() -> str:
    return dt.datetime.now(dt.UTC).strftime("%Y-%m-%dT%H:%M:%S.000Z")


def find_project(cwd: Path) -> Path:
    for d in [cwd, *cwd.parents]:
        if (d / "Pulumi.yaml").is_file():
            return d
    raise Exit(255, stderr=f"error: no Pulumi.yaml project file found (searching upwards from {cwd}). If you have "
                           f"not created a project yet, use `pulumi new` to do so: no project file found")


def load_yaml(path: Path) -> dict:
    import yaml

    return yaml.safe_load(path.read_text()) or {}


class Backend:
    def __init__(self, script: dict):
        self.script = script
        (ROOT / "state").mkdir(exist_ok=True)

    def _path(self, stack: str) -> Path:
        return ROOT / "state" / f"{stack}.json"

    def require(self, stack: str) -> None:
        if stack not in self.script.get("stacks", []):
            raise Exit(255, stderr=f"error: no stack named '{stack}' found")

    def load(self, stack: str) -> dict:
        path = self._path(stack)
        return json.loads(path.read_text()) if path.is_file() else {"history": [], "outputs": {}}

    def save(self, stack: str, state: dict) -> None:
        self._path(stack).write_text(json.dumps(state))

    def record(self, stack: str, kind: str, result: str, config: dict, changes: dict) -> None:
        state = self.load(stack)
        state["history"].append({
            "version": len(state["history"]) + 1, "kind": kind, "startTime": now(), "message": "",
            "environment": {"exec.kind": "auto.local"}, "config": config, "result": result, "endTime": now(),
            "resourceChanges": changes})
        self.save(stack, state)


def config_of(project: Path, stack: str, flags: dict) -> tuple[Path, dict]:
    """The stack's config file as the CLI finds it, and its values as `stack history --json` shows them."""
    if "--config-file" in flags:
        path = Path(flags["--config-file"][-1])
    else:
        doc = load_yaml(project / "Pulumi.yaml")
        path = project / doc.get("stackConfigDir", ".") / f"Pulumi.{stack}.yaml"
    if not path.is_file():
        raise Exit(255, stderr=f"error: open {path}: no such file or directory")
    raw = load_yaml(path).get("config") or {}
    config = {}
    for key, value in raw.items():
        if isinstance(value, dict | list):
            config[key] = {"value": json.dumps(value), "objectValue": value, "secret": False}
        else:
            config[key] = {"value": str(value), "secret": False}
    return path, config


def outputs_for(stack: str, config_file: Path) -> dict:
    if not backend.script.get("program"):
        return backend.script.get("outputs", {}).get(stack, {})
    # The real program (infra/__main__.py) under Pulumi's mock runtime, on the file this `up` read.
    sys.path.insert(0, str(REPO_ROOT))
    from infra.mockrun import run_stack

    return run_stack(stack, config_file=config_file).outputs


def operation(kind: str, stack: str, project: Path, flags: dict) -> str:
    path, config = config_of(project, stack, flags)
    verb = {"update": "Updating", "refresh": "Refreshing"}[kind]
    root = f"pulumi:pulumi:Stack {load_yaml(project / 'Pulumi.yaml')['name']}-{stack}"
    header = f"{verb} ({stack}):\n\n    {root} running\n"
    failure = backend.script.get("fail", {}).get("up" if kind == "update" else kind)
    if failure:
        backend.record(stack, kind, "failed", config, {"same": 1})
        raise Exit(failure.get("code", 255), header + failure.get("stdout", ""), failure.get("stderr", ""))
    state = backend.load(stack)
    if kind == "update":
        state["outputs"] = outputs_for(stack, path)
        backend.save(stack, state)
    backend.record(stack, kind, "succeeded", config, {"same": 1})
    outputs = "".join(f"    {k}: {json.dumps(v)}\n" for k, v in sorted(state["outputs"].items()))
    return (f"{header}    {root} \n\n" + (f"Outputs:\n{outputs}\n" if kind == "update" else "")
            + "Resources:\n    1 unchanged\n\nDuration: 1s\n")


def answer(argv: list[str]) -> str:
    words, flags = parse(argv)
    fail = backend.script.get("fail", {})
    command = " ".join(words[:2]) if words[:1] == ["stack"] else (words[0] if words else "")
    if command in fail and command not in ("up", "refresh"):
        f = fail[command]
        raise Exit(f.get("code", 255), f.get("stdout", ""), f.get("stderr", ""))
    if command == "version":
        return backend.script.get("version", "v3.272.0") + "\n"
    project = find_project(Path.cwd())
    stack = flags.get("--stack", flags.get("-s", [""]))[-1]
    if not stack:
        raise Exit(255, stderr="error: no stack selected; please use `pulumi stack select` to choose one")
    backend.require(stack)
    if command == "stack select":
        return ""
    if command in ("up", "refresh"):
        if "--yes" not in flags or "--skip-preview" not in flags:
            raise Exit(255, stderr="error: --yes or --skip-preview must be passed in to proceed when running in "
                                   "non-interactive mode")
        return operation("update" if command == "up" else "refresh", stack, project, flags)
    if command == "stack history":
        history = list(reversed(backend.load(stack)["history"]))
        if "--page-size" in flags:
            size, page = int(flags["--page-size"][-1]), int(flags.get("--page", ["1"])[-1])
            history = history[(page - 1) * size: page * size]
        return json.dumps(history, indent=4) + "\n"
    if command == "stack output":
        outputs = backend.load(stack)["outputs"]
        if "--show-secrets" not in flags:
            outputs = {k: "[secret]" if k in backend.script.get("secret_outputs", []) else v
                       for k, v in outputs.items()}
        return json.dumps(outputs, indent=4) + "\n"
    raise Exit(2, stderr=f"fake pulumi: {argv} is not a command this fake answers")


if __name__ == "__main__":
    args = sys.argv[1:]
    env = {k: os.environ[k] for k in ENV_RECORDED if k in os.environ}
    env["PULUMI_CONFIG_PASSPHRASE"] = "set" if "PULUMI_CONFIG_PASSPHRASE" in os.environ else "unset"
    with (ROOT / "calls.jsonl").open("a") as log:
        log.write(json.dumps({"argv": args, "cwd": os.getcwd(), "env": env}) + "\n")
    backend = Backend(json.loads((ROOT / "script.json").read_text()))
    try:
        sys.stdout.write(answer([a for a in args if a != "--non-interactive"]))
    except Exit as done:
        sys.stdout.write(done.stdout)
        sys.stderr.write(done.stderr + ("\n" if done.stderr and not done.stderr.endswith("\n") else ""))
        sys.exit(done.code)
