"""A Python-backend package in the caller's process (llm_serving_client/inprocess/, docs/clients.md, "In the
caller's process"): loaded from the published package with its checksums, identity, I/O fingerprint and declared
dependencies checked, its config.pbtxt handed to `initialize` as the server's repository hands it to Triton, and its
own model.py answering through the small triton_python_backend_utils equivalent. No server: the comparison with the
remote answer is in test_client_remote.py."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path, PurePosixPath

import numpy as np
import pytest
from google.protobuf import json_format

from llm_serving.manifest import Backend, ServingMode
from llm_serving.package import PackageSpec, build_package, open_package
from llm_serving.stack_outputs import parse_stack_outputs
from llm_serving_client import Client, InvalidRequest, LocalEndpoints
from llm_serving_client.inprocess.python_model import InProcessError, InProcessModel, model_config
from tests.serving.client_outputs import FEATURES, FEATURES_FINGERPRINT, FEATURES_SOURCE, RANKER, document


def features_package(out: Path, *, dependencies=("numpy>=1.24",), model_id: str = FEATURES) -> Path:
    return build_package(PackageSpec(None, model_id, "1.0.0", backend=Backend.PYTHON, serving_mode=ServingMode.OPENAI,
                                     python_model=FEATURES_SOURCE / "model.py",
                                     config_pbtxt=FEATURES_SOURCE / "config.pbtxt", python_dependencies=dependencies),
                         out / f"{model_id}-1.0.0")


@pytest.fixture(scope="module")
def package(tmp_path_factory) -> Path:
    return features_package(tmp_path_factory.mktemp("features"))


def client() -> Client:
    return Client(parse_stack_outputs(document()), local=LocalEndpoints("http://127.0.0.1:9/v1", "127.0.0.1:9"))


def test_the_model_runs_here_and_answers_as_its_code_says(package):
    lib = client()
    lib.load_in_process(FEATURES, "1.0.0", package)
    raw = np.arange(24, dtype=np.float32).reshape(3, 8)
    # Nothing listens on the remote address: this answer came from this process.
    out = lib.infer(FEATURES, {"raw": raw})
    np.testing.assert_array_equal(out["features"], np.log1p(raw).astype(np.float32))
    assert out["features"].dtype == np.float32
    lib.close()


def test_the_models_own_errors_and_the_io_checks_name_the_field(package):
    lib = client()
    lib.load_in_process(FEATURES, "1.0.0", package)
    raw = np.ones((2, 8), np.float32)
    raw[1, 3] = -1
    with pytest.raises(InvalidRequest, match=r"model 'ranker-features' version '1.0.0': input 'raw' row 1 column 3 "
                                             r"is -1.0: raw features are counts and amounts"):
        lib.infer(FEATURES, {"raw": raw})
    with pytest.raises(InvalidRequest, match="field 'raw': has shape \\[2, 7\\]; the model takes \\[-1, 8\\]"):
        lib.infer(FEATURES, {"raw": np.ones((2, 7), np.float32)})
    with pytest.raises(InvalidRequest, match="field 'raw': has 65 rows; the model takes at most 64 a request"):
        lib.infer(FEATURES, {"raw": np.ones((65, 8), np.float32)})
    lib.close()


def test_initialize_gets_the_config_the_servers_repository_gives_triton(package):
    from serving_image.triton.repository import python_model_config

    verified = open_package(package)
    served = python_model_config(verified.manifest, (verified.root / verified.manifest.python.config_pbtxt).read_text(),
                                 PurePosixPath(verified.root))
    assert json_format.MessageToDict(model_config(verified)) == json_format.MessageToDict(served)
    model = InProcessModel(package, model_id=FEATURES, version="1.0.0", io_fingerprint=FEATURES_FINGERPRINT)
    assert model.config_json["name"] == FEATURES and model.config_json["max_batch_size"] == 64
    assert json.dumps(model.config_json)  # what initialize parsed


def test_only_what_the_stack_marks_and_serves_loads(package):
    lib = client()
    with pytest.raises(InProcessError, match="model 'ranker': the stack does not mark it inProcess"):
        lib.load_in_process(RANKER, "1.0.0", package)
    with pytest.raises(InProcessError, match=r"version '2.0.0': the stack marks only \['1.0.0'\]"):
        lib.load_in_process(FEATURES, "2.0.0", package)
    with pytest.raises(InProcessError, match="the package's I/O fingerprint sha256:.* is not the one the stack "
                                             "serves \\(sha256:0000"):
        InProcessModel(package, model_id=FEATURES, version="1.0.0", io_fingerprint="sha256:" + "0" * 64)
    with pytest.raises(InProcessError, match="the package at .* is ranker-features 1.0.0"):
        InProcessModel(package, model_id="ranker-steps", version="1.0.0", io_fingerprint=FEATURES_FINGERPRINT)


def test_a_package_that_does_not_verify_is_refused(tmp_path):
    package = features_package(tmp_path)
    model_py = package / "python" / "model.py"
    model_py.write_text(model_py.read_text() + "\n# edited after publishing\n")
    with pytest.raises(InProcessError, match="does not verify: .*model.py"):
        InProcessModel(package, model_id=FEATURES, version="1.0.0", io_fingerprint=FEATURES_FINGERPRINT)


def test_a_dependency_this_process_lacks_or_has_at_another_version_is_named(tmp_path, monkeypatch):
    """A package whose declared dependencies this environment does not meet: the caller installs them to run it
    here, or calls it remotely. (The XGBoost ranker's xgboost and scipy are in .venv-serving, installed by the
    Makefile, so its in-process answer is compared with the server's in test_client_remote.py.) Packaging checks the
    same declarations against the image's stub, so the packages here declare what the stub has."""
    from llm_serving_client.inprocess import python_model as inprocess_model

    package = features_package(tmp_path, dependencies=("numpy>=1.24", "xgboost==3.0.5"))
    real = inprocess_model.this_environment()
    without = dataclasses.replace(real, distributions={n: v for n, v in real.distributions.items() if n != "xgboost"})
    monkeypatch.setattr(inprocess_model, "this_environment", lambda: without)
    with pytest.raises(InProcessError, match="model 'ranker-features' version '1.0.0': xgboost==3.0.5 needs xgboost, "
                                             "which this process's environment does not have"):
        InProcessModel(package, model_id=FEATURES, version="1.0.0", io_fingerprint=FEATURES_FINGERPRINT)
    monkeypatch.undo()
    numpy = real.distributions["numpy"]
    package = features_package(tmp_path / "other", dependencies=(f"numpy!={numpy}",))
    with pytest.raises(InProcessError, match=f"numpy!={numpy} needs numpy !={numpy}; this process's environment "
                                             f"has numpy {numpy}"):
        InProcessModel(package, model_id=FEATURES, version="1.0.0", io_fingerprint=FEATURES_FINGERPRINT)


def test_the_package_is_fetched_from_where_the_outputs_say(package, tmp_path, monkeypatch):
    """The outputs name the package in the region's bucket (moto's S3 server here): published there by the real
    store, fetched by the loader, then verified and run."""
    import boto3
    from moto.server import ThreadedMotoServer

    from llm_serving.store import S3Store

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    try:
        host, port = server.get_host_and_port()
        monkeypatch.setenv("AWS_ACCESS_KEY_ID", "test")
        monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "test")
        s3 = boto3.client("s3", endpoint_url=f"http://{host}:{port}", region_name="us-east-1")
        s3.create_bucket(Bucket="acme-llm-dev-us-east-1")
        published = S3Store("s3://acme-llm-dev-us-east-1/models", client=s3).publish(package)
        raw = document()
        raw["models"][FEATURES]["inProcess"]["versions"]["1.0.0"]["package"] = published.model_cache_uri
        lib = Client(parse_stack_outputs(raw), local=LocalEndpoints("http://127.0.0.1:9/v1", "127.0.0.1:9"))
        lib.load_in_process(FEATURES, "1.0.0", cache_dir=tmp_path / "cache", s3=s3)
        raw_rows = np.ones((2, 8), np.float32)
        np.testing.assert_array_equal(lib.infer(FEATURES, {"raw": raw_rows})["features"], np.log1p(raw_rows))
        assert (tmp_path / "cache" / FEATURES / "1.0.0" / "package.toml").is_file()
        lib.close()
        raw["models"][FEATURES]["inProcess"]["versions"]["1.0.0"]["package"] = \
            "s3://acme-llm-dev-us-east-1/models/model-cache/ranker-features/9.9.9/"
        lib = Client(parse_stack_outputs(raw), local=LocalEndpoints("http://127.0.0.1:9/v1", "127.0.0.1:9"))
        with pytest.raises(InProcessError, match="no package there"):
            lib.load_in_process(FEATURES, "1.0.0", cache_dir=tmp_path / "other", s3=s3)
    finally:
        server.stop()
