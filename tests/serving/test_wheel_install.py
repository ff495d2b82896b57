"""The wheel, installed as a user installs it (not editable, its base dependencies only, outside the checkout),
answers `llm-serving --help` and `llm-serving rehearse --help`: no command imports what the wheel does not hold
(bench/, tests/) or what only an extra brings. The native modules are left out of this build
(LLM_SERVING_BUILD_NATIVE=OFF): neither help needs them."""

from __future__ import annotations

import os
import subprocess
import sys
import venv
from pathlib import Path

import pytest

from llm_serving.repository import REPO_ROOT


def _run(argv: list[str | Path], **kwargs) -> subprocess.CompletedProcess:
    proc = subprocess.run([str(a) for a in argv], capture_output=True, text=True, timeout=600, **kwargs)
    assert proc.returncode == 0, f"{' '.join(map(str, argv))} exited {proc.returncode}:\n{proc.stdout[-2000:]}\n" \
                                 f"{proc.stderr[-4000:]}"
    return proc


@pytest.mark.slow
def test_help_of_every_command_from_a_plain_install_of_the_wheel(tmp_path):
    wheels, env_dir = tmp_path / "wheels", tmp_path / "venv"
    # The build in a directory of its own: the checkout's build/ stays the editable install's.
    _run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-w", wheels,
          "-C", f"build-dir={tmp_path / 'build'}", REPO_ROOT],
         env={**os.environ, "LLM_SERVING_BUILD_NATIVE": "OFF"}, cwd=tmp_path)
    (wheel,) = wheels.glob("llm_serving-*.whl")
    venv.create(env_dir, with_pip=True)
    _run([env_dir / "bin" / "python", "-m", "pip", "install", "-q", wheel], cwd=tmp_path)
    cli = env_dir / "bin" / "llm-serving"
    assert "rehearse" in _run([cli, "--help"], cwd=tmp_path).stdout
    assert "--scenario" in _run([cli, "rehearse", "--help"], cwd=tmp_path).stdout
    refused = subprocess.run([cli, "rehearse", "--stack", "dev-us-east-1"], capture_output=True, text=True,
                             cwd=tmp_path, timeout=120)
    # The rehearsal itself needs .venv-serving's packages: a plain install says so instead of a traceback.
    assert refused.returncode != 0 and "make rehearse" in refused.stderr and "Traceback" not in refused.stderr, \
        refused.stderr
