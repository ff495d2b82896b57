"""Installs the fake `pulumi` (cli.py, a stand-in for the CLI that cannot be installed here) for one test.

`FakePulumi(tmp_path).install(monkeypatch)` writes `bin/pulumi` (a shell wrapper that runs cli.py with this test's
interpreter), puts that directory first on PATH, as an installed CLI would be, and points the fake at its state
directory. `script(...)` says what the fake answers; `calls()` returns every invocation as it was made.
"""

from __future__ import annotations

import json
import os
import shlex
import sys
from pathlib import Path

CLI = Path(__file__).with_name("cli.py")


class FakePulumi:
    def __init__(self, root: Path):
        self.root = Path(root)
        self.bin = self.root / "bin"

    def install(self, monkeypatch) -> FakePulumi:
        self.bin.mkdir(parents=True, exist_ok=True)
        exe = self.bin / "pulumi"
        exe.write_text(f"#!/bin/sh\nexec {shlex.quote(sys.executable)} {shlex.quote(str(CLI))} \"$@\"\n")
        exe.chmod(0o755)
        monkeypatch.setenv("PATH", f"{self.bin}:{os.environ['PATH']}")
        monkeypatch.setenv("FAKE_PULUMI_DIR", str(self.root))
        monkeypatch.delenv("PULUMI_AUTOMATION_API_SKIP_VERSION_CHECK", raising=False)
        self.script()
        return self

    def script(self, **answers) -> None:
        (self.root / "script.json").write_text(json.dumps(answers))

    def calls(self) -> list[dict]:
        path = self.root / "calls.jsonl"
        return [json.loads(line) for line in path.read_text().splitlines()] if path.is_file() else []

    def argv(self) -> list[list[str]]:
        return [c["argv"] for c in self.calls()]

    def history(self, stack: str) -> list[dict]:
        path = self.root / "state" / f"{stack}.json"
        return json.loads(path.read_text())["history"] if path.is_file() else []
