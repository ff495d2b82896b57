"""The ranker loads with exactly what the serving image installs for its Python backend stub (it once served
locally and failed in production, where the image had no xgboost for the stub).

The base image cannot be pulled here, so the proof is made on the local Triton: the Dockerfile's stub install list
(the probe's `--write-stub-requirements`, from compat.toml [triton.stub] install, the keys the Dockerfile reads) is
installed with the Dockerfile's pip command shape (STUB_PIP_FLAGS, `--target`, `-r`) into a fresh directory, together
with a stand-in for what the base image brings itself ([triton.stub] base: numpy, with vLLM), and that directory alone
is the Python backend's package directory of a Triton home assembled from the local install. The ranker package
(its [python] dependencies declared) is then served by the startup procedure and answers as its booster does.

What differs from the image, and is said here rather than hidden: the local stub runs Python 3.11, the image's 3.12, so
pip installs the same distribution versions' cp311 wheels (xgboost's wheel is the same for both: py3-none); the pip
cache is used (the Dockerfile passes --no-cache-dir; the resolved files are the same); Triton is the local 2.51. The
base's numpy is stood in for by the local stub's numpy 1.26.4 ([local.triton] stub_numpy), not the image's pin: the
2.51 stub's tensors come back empty with numpy 2 (measured with [triton.stub]'s numpy 2.2.6 here: the ranker loads,
and its `score` output of shape [5, 1] arrives with no data), while the 26.08 image's stub runs with its own numpy,
which the build's probe checks against the pin.
"""

from __future__ import annotations

import importlib.metadata
import os
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest
import tritonclient.http as httpclient

from bench.local_server import start_standalone_server
from dev_packages.demo import N_FEATURES, RANKER_ID, booster_predictions, build_ranker, train_ranker
from llm_serving.package import open_package
from llm_serving.python_deps import STUB_PIP_FLAGS, load_stub, load_stub_pins
from serving_image.triton import probe
from serving_image.triton.local_install import HOME_ENV, locate

pytestmark = pytest.mark.slow

# The Python backend's own files (NVIDIA's), copied into the fresh directory; everything else there is the install.
BACKEND_FILES = ("libtriton_python.so", "triton_python_backend_stub", "triton_python_backend_utils.py")


def _install_like_the_dockerfile(target: Path, requirements: Path, python: Path) -> None:
    # The Dockerfile's command, for the local stub's interpreter: python -m pip install FLAGS --target T -r FILE.
    command = [str(python), "-m", "pip", "install", "--quiet", *STUB_PIP_FLAGS, "--target", str(target),
               "-r", str(requirements)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=900,
                          env={k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PIP_TARGET")})
    assert done.returncode == 0, f"{' '.join(command)} failed:\n{done.stderr[-3000:]}"


def _triton_home(local, backend: Path, home: Path) -> Path:
    """A Triton home (serving_image/triton/local_install.py's layout) that is the local install in every part but
    the Python backend's directory, which is `backend`."""
    site_rel = local.server_root.parent.parent.relative_to(local.home)  # lib/python3.11/site-packages
    site = home / site_rel
    (site / "pytriton" / "tritonserver" / "backends").mkdir(parents=True)
    for entry in local.server_root.parent.parent.iterdir():
        if entry.name != "pytriton":
            (site / entry.name).symlink_to(entry)
    for entry in local.server_root.iterdir():
        if entry.name != "backends":
            (site / "pytriton" / "tritonserver" / entry.name).symlink_to(entry)
    (site / "pytriton" / "tritonserver" / "backends" / "python").symlink_to(backend, target_is_directory=True)
    (home / "bin").mkdir()
    (home / "bin" / "python").symlink_to(local.home / "bin" / "python")
    return home


def test_ranker_loads_with_only_the_image_stub_install(tmp_path):
    local = locate()
    stub = load_stub_pins()
    backend = tmp_path / "backend-python"
    backend.mkdir()
    for name in BACKEND_FILES:
        shutil.copy2(local.python_backend / name, backend / name)
    requirements = tmp_path / "stub-requirements.txt"
    assert probe.main(["--runtime", "local", "--write-stub-requirements", str(requirements)]) == 0
    assert requirements.read_text().split() == ["scipy==1.13.1", "xgboost==3.0.5"]
    _install_like_the_dockerfile(backend, requirements, local.home / "bin" / "python")
    # What the base image brings itself (numpy, with vLLM), stood in for by the local stub's numpy (module docstring).
    local_numpy = load_stub("local").distributions["numpy"]
    assert set(stub.base) == {"numpy"}
    base = tmp_path / "base-requirements.txt"
    base.write_text(f"numpy=={local_numpy}\n")
    _install_like_the_dockerfile(backend, base, local.home / "bin" / "python")
    installed = {d.metadata["Name"].lower(): d.version for d in importlib.metadata.distributions(path=[str(backend)])}
    assert installed == {**stub.install, "numpy": local_numpy}, "the directory holds exactly the stub's pins"
    # The probe's own check of the stub, here against the local stub's interpreter's view of this directory.
    done = subprocess.run([str(local.home / "bin" / "python"), "-c",
                           f"import sys; sys.path.append({str(backend)!r}); import numpy, scipy, xgboost; "
                           "print(numpy.__version__, scipy.__version__, xgboost.__version__, numpy.__file__)"],
                          capture_output=True, text=True, timeout=300, env={"PYTHONNOUSERSITE": "1"})
    assert done.returncode == 0, done.stderr
    versions = done.stdout.split()
    assert versions[:3] == [local_numpy, stub.install["scipy"], stub.install["xgboost"]]
    assert versions[3].startswith(str(backend))  # this directory's, not the local install's

    home = _triton_home(local, backend, tmp_path / "triton-home")
    assert locate(home).python_backend.resolve() == backend.resolve()
    weights = tmp_path / "weights"
    booster = train_ranker(weights)  # trained by the local install's stub interpreter, as make up does
    package = build_ranker(tmp_path / "ranker", "1.0.0", weights=weights)
    assert open_package(package).manifest.python.dependencies  # declared, and met by the image's pins
    server = start_standalone_server(package, tmp_path / "work", extra_env={HOME_ENV: str(home)})
    try:
        features = np.log1p(np.random.default_rng(30).exponential(3.0, size=(5, N_FEATURES))).astype(np.float32)
        client = httpclient.InferenceServerClient(f"127.0.0.1:{server.ports['kserve_http']}")
        inputs = [httpclient.InferInput("features", list(features.shape), "FP32")]
        inputs[0].set_data_from_numpy(features)
        scores = client.infer(RANKER_ID, inputs).as_numpy("score").reshape(-1)
        np.testing.assert_allclose(scores, booster_predictions(booster, features), rtol=1e-6, atol=1e-6)
        assert len(set(scores.tolist())) > 1
        log = server.log_path.read_text()
        assert "dependencies met by the local Triton's Python backend stub" in log
    finally:
        assert server.stop() == 0
