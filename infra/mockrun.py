"""Run a stack's program (infra/__main__.py) under Pulumi's mock runtime and record every resource it registers.

The contract other parts code against (policies, the rollout tool, `make plan`, the tests):

    run_stack(stack, config_overrides=None, config_file=None) -> StackRun
    shipped_stacks() -> list[str]

Pulumi's runtime keeps global state (settings, the root stack, the RPC manager), so each run happens in a fresh
subprocess, `python -m infra.mockrun --stack X --json`, whose JSON `run_stack` parses. The recording sits in the
mock monitor (the object that receives every RegisterResource request): unlike `Mocks.new_resource`, the request
carries the parent, the explicit and implicit dependencies, the custom timeouts and the provider reference.

A config validation error surfaces from `run_stack` as `infra.config.ConfigError` with the program's message; any
other failure of the program as `StackRunError`.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import json
import os
import runpy
import subprocess
import sys
import traceback
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import yaml

from llm_serving.repository import REPO_ROOT

STACKS_DIR = REPO_ROOT / "stacks"
ORGANIZATION = "organization"  # what StackReference names carry under the mock runtime
EXIT_CONFIG_ERROR = 3
EXIT_PROGRAM_ERROR = 4


@dataclass(frozen=True)
class MockedResource:
    type: str  # Pulumi type token, e.g. "aws:s3/bucket:Bucket", "kubernetes:apps/v1:Deployment"
    name: str
    urn: str
    inputs: dict  # camelCase keys, as the mock runtime receives them
    parent: str | None  # parent URN (None for the stack's direct children)
    dependencies: list[str]  # URNs of explicit and implicit dependencies
    custom_timeouts: dict | None  # {"create": "30m", ...} when set
    provider: str | None
    custom: bool = True  # False for ComponentResources
    property_dependencies: dict[str, list[str]] = field(default_factory=dict)


@dataclass(frozen=True)
class StackRun:
    stack: str
    project: str
    config: dict
    resources: list[MockedResource]
    outputs: dict

    def of_type(self, type_token: str) -> list[MockedResource]:
        return [r for r in self.resources if r.type == type_token]

    def by_urn(self) -> dict[str, MockedResource]:
        return {r.urn: r for r in self.resources}

    def find(self, type_token: str, name: str) -> MockedResource:
        found = [r for r in self.resources if r.type == type_token and r.name == name]
        if len(found) != 1:
            names = sorted(r.name for r in self.of_type(type_token))
            raise KeyError(f"{len(found)} resources of type {type_token} named {name!r}; names: {names}")
        return found[0]


class StackRunError(RuntimeError):
    """The stack's program failed under the mock runtime (not a config error)."""


@dataclass(frozen=True)
class Project:
    """A Pulumi project on disk: its Pulumi.yaml's name, program directory and stack config directory."""

    root: Path
    name: str
    main: Path
    stacks_dir: Path

    @classmethod
    def load(cls, root: Path = REPO_ROOT) -> Project:
        doc = yaml.safe_load((root / "Pulumi.yaml").read_text())
        return cls(root=root, name=doc["name"], main=root / doc.get("main", "."),
                   stacks_dir=root / doc.get("stackConfigDir", "."))


def shipped_stacks(project_root: Path = REPO_ROOT) -> list[str]:
    stacks_dir = Project.load(project_root).stacks_dir
    return sorted(p.name[len("Pulumi.") : -len(".yaml")] for p in stacks_dir.glob("Pulumi.*.yaml"))


def project_name(project_root: Path = REPO_ROOT) -> str:
    return Project.load(project_root).name


def stack_config_path(stack: str, project_root: Path = REPO_ROOT) -> Path:
    return Project.load(project_root).stacks_dir / f"Pulumi.{stack}.yaml"


def load_config(stack: str, config_file: Path | None = None, overrides: dict | None = None,
                project_root: Path = REPO_ROOT) -> dict[str, Any]:
    """The stack's config map with full keys (`llm-serving:models`, `aws:region`), values decoded from YAML."""
    path = Path(config_file) if config_file else stack_config_path(stack, project_root)
    if not path.is_file():
        raise FileNotFoundError(f"no stack config for {stack!r}: {path} does not exist "
                                f"(shipped: {shipped_stacks(project_root)})")
    doc = yaml.safe_load(path.read_text()) or {}
    config = dict(doc.get("config") or {})
    project = project_name(project_root)
    for key, value in (overrides or {}).items():
        config[key if ":" in key else f"{project}:{key}"] = value
    return config


# --------------------------------------------------------------------------------------------------------------
# In the subprocess


def _execute(stack: str, config: dict[str, Any], stack_outputs: dict | None = None,
             project_root: Path = REPO_ROOT) -> dict[str, Any]:
    import pulumi
    from pulumi.runtime import mocks as pulumi_mocks
    from pulumi.runtime import rpc

    from infra.mocks import PlatformMocks, to_config_value

    records: list[dict[str, Any]] = []

    class RecordingMonitor(pulumi_mocks.MockMonitor):
        def RegisterResource(self, request):  # noqa: N802 (gRPC method name)
            response = super().RegisterResource(request)
            if request.type == "pulumi:pulumi:Stack":
                return response
            timeouts = request.customTimeouts
            custom_timeouts = {
                k: v for k, v in (("create", timeouts.create), ("update", timeouts.update),
                                  ("delete", timeouts.delete)) if v
            }
            parent = request.parent or None
            if parent and parent.split("::")[2] == "pulumi:pulumi:Stack":
                parent = None
            records.append({
                "type": request.type,
                "name": request.name,
                "urn": response.urn,
                "inputs": _ints(rpc.deserialize_properties(request.object)),
                "parent": parent,
                "dependencies": list(request.dependencies),
                "custom_timeouts": custom_timeouts or None,
                "provider": request.provider or None,
                "custom": bool(request.custom),
                "property_dependencies": {k: list(v.urns) for k, v in request.propertyDependencies.items()},
            })
            return response

        def ReadResource(self, request):  # noqa: N802 (gRPC method name); StackReference and `get` reads
            response = super().ReadResource(request)
            parent = request.parent or None
            if parent and parent.split("::")[2] == "pulumi:pulumi:Stack":
                parent = None
            records.append({
                "type": request.type, "name": request.name, "urn": response.urn,
                "inputs": _ints(rpc.deserialize_properties(request.properties)), "parent": parent,
                "dependencies": list(request.dependencies), "custom_timeouts": None,
                "provider": request.provider or None, "custom": True, "property_dependencies": {},
            })
            return response

    region = str(config.get("aws:region", "us-east-1"))
    project = Project.load(project_root)
    mocks = PlatformMocks(region=region, stack_outputs=stack_outputs)
    pulumi.runtime.set_all_config({k: to_config_value(v) for k, v in config.items()})
    pulumi.runtime.set_mocks(mocks, project=project.name, stack=stack, preview=False, monitor=RecordingMonitor(mocks),
                             organization=ORGANIZATION)

    loop = asyncio.get_event_loop()
    # As the Pulumi CLI runs a program whose `main` is a directory: from that directory, which is also put first on
    # sys.path (runpy does both for a directory). Paths the program hands to providers (the image's build context)
    # are therefore relative to it, and one that only works from the repository root fails here as it would there.
    workdir = project.main if project.main.is_dir() else project.main.parent
    os.chdir(workdir)
    runpy.run_path(str(project.main), run_name="__main__")
    loop.run_until_complete(pulumi.runtime.stack.wait_for_rpcs())

    root = pulumi.runtime.get_root_resource()
    outputs = loop.run_until_complete(pulumi.Output.from_input(dict(root.outputs)).future()) or {}
    loop.run_until_complete(pulumi.runtime.stack.wait_for_rpcs())
    return {"stack": stack, "project": project.name, "config": config, "resources": records, "outputs": outputs}


def _ints(value: Any) -> Any:
    """Protobuf's Struct carries every number as a double; the program sent integers (replicas, ports), and schema
    checks (Kubernetes' OpenAPI `integer`) need them back as integers."""
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, dict):
        return {k: _ints(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_ints(v) for v in value]
    return value


def _json_default(value: Any) -> Any:
    # Resource references and other SDK objects inside inputs: their string form is what a reader needs.
    return str(value)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--stack", required=True)
    parser.add_argument("--json", action="store_true", help="print the StackRun as JSON on stdout")
    parser.add_argument("--config-file", type=Path,
                        help="stack config YAML to use instead of stacks/Pulumi.<stack>.yaml")
    parser.add_argument("--project", type=Path, default=REPO_ROOT,
                        help="directory of the Pulumi project (its Pulumi.yaml); default: the platform")
    parser.add_argument("--overrides", default="{}", help="JSON object of config keys to override")
    parser.add_argument("--stack-outputs", default="{}", help="JSON: mocked outputs of referenced stacks")
    args = parser.parse_args(argv)

    from infra.config import ConfigError

    try:
        project_root = args.project.resolve()
        config = load_config(args.stack, args.config_file, json.loads(args.overrides), project_root)
        result = _execute(args.stack, config, json.loads(args.stack_outputs), project_root)
    except ConfigError as exc:
        print(json.dumps({"error": {"kind": "config", "message": str(exc)}}))
        return EXIT_CONFIG_ERROR
    except Exception as exc:  # the program's own failure, reported whole
        cause, seen = exc, set()
        # Pulumi re-raises failures of outputs with the original as __cause__ (sometimes itself): find a ConfigError.
        while not isinstance(cause, ConfigError) and cause.__cause__ is not None and id(cause) not in seen:
            seen.add(id(cause))
            cause = cause.__cause__
        kind = "config" if isinstance(cause, ConfigError) else "program"
        message = str(cause) if kind == "config" else f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"
        print(json.dumps({"error": {"kind": kind, "message": message}}))
        return EXIT_CONFIG_ERROR if kind == "config" else EXIT_PROGRAM_ERROR
    if args.json:
        print(json.dumps(result, default=_json_default, sort_keys=True))
    else:
        print(f"{args.stack}: {len(result['resources'])} resources, outputs: {sorted(result['outputs'])}")
    return 0


# --------------------------------------------------------------------------------------------------------------
# In the caller


def run_stack(
    stack: str,
    config_overrides: dict | None = None,
    config_file: str | os.PathLike | None = None,
    stack_outputs: dict | None = None,
    timeout: float = 300,
    project: str | os.PathLike | None = None,
) -> StackRun:
    """Run `infra/__main__.py` for `stack` under the mock runtime in a fresh interpreter and return what it did.

    `config_overrides` replaces top-level config keys (`models` or `llm-serving:models`); `config_file` runs with
    another stack file (the rollout tool edits copies); `stack_outputs` maps a StackReference name to the outputs
    it resolves to; `project` runs another Pulumi project directory (the consumer example) the same way."""
    from infra.config import ConfigError

    stack_outputs = {**home_stack_outputs(stack, config_overrides, config_file, project), **(stack_outputs or {})}
    cmd = [sys.executable, "-m", "infra.mockrun", "--stack", stack, "--json",
           "--overrides", json.dumps(config_overrides or {}), "--stack-outputs", json.dumps(stack_outputs or {})]
    if config_file is not None:
        cmd += ["--config-file", str(Path(config_file).resolve())]
    if project is not None:
        cmd += ["--project", str(Path(project).resolve())]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")]))}
    main = Project.load(Path(project).resolve() if project is not None else REPO_ROOT).main
    proc = subprocess.run(cmd, cwd=main if main.is_dir() else main.parent, env=env, capture_output=True, text=True,
                          timeout=timeout)
    last_line = proc.stdout.strip().splitlines()[-1] if proc.stdout.strip() else ""
    try:
        doc = json.loads(last_line)
    except json.JSONDecodeError:
        raise StackRunError(
            f"stack {stack}: the mock run exited {proc.returncode} without a result\n{proc.stderr[-4000:]}"
        ) from None
    if "error" in doc:
        if doc["error"]["kind"] == "config":
            raise ConfigError(doc["error"]["message"])
        raise StackRunError(f"stack {stack}: {doc['error']['message']}")
    return StackRun(
        stack=doc["stack"],
        project=doc["project"],
        config=doc["config"],
        resources=[MockedResource(**r) for r in doc["resources"]],
        outputs=doc["outputs"],
    )


def home_stack_outputs(stack: str, overrides: dict | None = None, config_file: str | os.PathLike | None = None,
                       project: str | os.PathLike | None = None) -> dict[str, dict]:
    """A non-home region's program reads its home region's outputs (the serving image it runs) through a
    StackReference: the home stack's own mock run answers it, when that stack is a shipped one of this project."""
    if project is not None and Path(project).resolve() != REPO_ROOT:
        return {}
    try:
        config = load_config(stack, Path(config_file) if config_file else None, overrides)
    except FileNotFoundError:
        return {}
    env, home, region = (config.get("llm-serving:environment"), config.get("llm-serving:homeRegion"),
                         config.get("aws:region"))
    home_stack = f"{env}-{home}"
    if not home or home == region or home_stack == stack or home_stack not in shipped_stacks():
        return {}
    return {f"{ORGANIZATION}/{project_name()}/{home_stack}": dict(shipped_run(home_stack).outputs)}


@functools.cache
def shipped_run(stack: str) -> StackRun:
    """`run_stack(stack)` of a shipped stack with its own config, once per process (tests share it; treat the
    result as read-only)."""
    return run_stack(stack)


def stackrun_to_dict(run: StackRun) -> dict[str, Any]:
    return asdict(run)


if __name__ == "__main__":
    sys.exit(main())
