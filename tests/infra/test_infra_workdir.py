"""The program runs from its main directory, as the Pulumi CLI runs it (Pulumi.yaml `main: infra/`): in the mock runs
of the tests and `make plan` too, so that a path that only works from the repository root fails here."""

from __future__ import annotations

from pathlib import Path

import pulumi
import pytest

from infra.mockrun import REPO_ROOT, Project, shipped_run
from infra.mocks import PlatformMocks


def test_pulumi_yaml_main_is_the_program_directory():
    project = Project.load()
    assert project.main == REPO_ROOT / "infra" and (project.main / "__main__.py").is_file()


def test_image_paths_are_relative_to_the_main_directory():
    run = shipped_run("prod-us-east-1")
    (image,) = run.of_type("docker-build:index:Image")
    main = Project.load().main
    context, dockerfile = image.inputs["context"]["location"], image.inputs["dockerfile"]["location"]
    # Computed from the working directory the run had: only infra/ gives these. The context is the repository root,
    # which the Dockerfile's COPY instructions expect.
    assert (context, dockerfile) == ("..", "../serving_image/Dockerfile")
    assert (main / context).resolve() == REPO_ROOT


def test_image_paths_are_the_same_from_any_working_directory(monkeypatch, tmp_path):
    from infra.registry import CONTEXT, DOCKERFILE, from_workdir

    for cwd in (REPO_ROOT, REPO_ROOT / "infra", tmp_path):
        monkeypatch.chdir(cwd)
        assert (Path.cwd() / from_workdir(CONTEXT)).resolve() == REPO_ROOT
        assert (Path.cwd() / from_workdir(DOCKERFILE)).resolve() == REPO_ROOT / "serving_image" / "Dockerfile"


def _image_args(context: str) -> pulumi.runtime.MockResourceArgs:
    return pulumi.runtime.MockResourceArgs(
        typ="docker-build:index:Image", name="serving-image", inputs={
            "context": {"location": context}, "dockerfile": {"location": f"{context}/serving_image/Dockerfile"},
            "tags": ["123456789012.dkr.ecr.us-east-1.amazonaws.com/llm-serving:x"]},
        provider="", resource_id="", custom=True)


def test_a_repository_root_path_fails_from_the_main_directory(monkeypatch):
    monkeypatch.chdir(Project.load().main)
    mocks = PlatformMocks(region="us-east-1")
    with pytest.raises(FileNotFoundError, match="docker-build context .*nowhere does not exist"):
        mocks.new_resource(_image_args("nowhere"))  # a path that only the repository root would resolve
    _, state = mocks.new_resource(_image_args(".."))
    assert state["digest"].startswith("sha256:")
    assert Path.cwd() == REPO_ROOT / "infra"


def test_no_program_module_shadows_the_standard_library():
    # The main directory is first on sys.path when the CLI runs the program: infra/platform.py once hid the
    # standard library's `platform` (uuid, and so Pulumi's own imports, failed).
    import sys

    names = {p.stem for p in (REPO_ROOT / "infra").glob("*.py")} | {
        p.name for p in (REPO_ROOT / "infra").iterdir() if p.is_dir()}
    assert names & set(sys.stdlib_module_names) == set()
