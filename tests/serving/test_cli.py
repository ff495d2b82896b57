"""`llm-serving package` and `publish` as a user runs them (the installed console script, in a child process)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import boto3
import pytest
from moto.server import ThreadedMotoServer

from llm_serving.manifest import MANIFEST_NAME, parse_manifest
from llm_serving.package import open_package
from llm_serving_cli.main import _model_id_from_dir
from tests.serving.wheels import make_wheel, wheel_filename

CLI = Path(sys.executable).parent / "llm-serving"  # the console script installed beside this interpreter


def _cli(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([str(CLI), *args], capture_output=True, text=True, timeout=120,
                          env=dict(os.environ, **(env or {})))


@pytest.fixture()
def model_dir(tmp_path: Path) -> Path:
    root = tmp_path / "My_Model.v2"
    root.mkdir()
    (root / "config.json").write_text(json.dumps({"model_type": "llama", "max_position_embeddings": 4096}))
    (root / "model.safetensors").write_bytes(b"\x00" * 1024)
    return root


def test_package_then_publish_to_a_directory(model_dir: Path, tmp_path: Path):
    plugin = tmp_path / wheel_filename("p")
    plugin.write_bytes(make_wheel("p", files={"p.py": ""}))
    built = _cli("package", str(model_dir), "--id", "my-model", "--version", "2.0.0", "--engine-arg",
                 "max_model_len=1024", "--engine-arg", "dtype=float16", "--plugin", str(plugin),
                 "--serving-mode", "standalone", "--out", str(tmp_path / "pkg.tar.gz"))
    assert built.returncode == 0, built.stderr
    package = Path(built.stdout.strip())
    manifest = open_package(package, tmp_path / "check").manifest
    assert manifest.engine.args == {"max_model_len": 1024, "dtype": "float16"}
    assert manifest.serving_mode == "standalone" and [p.wheel for p in manifest.plugins] == [f"plugins/{plugin.name}"]
    published = _cli("publish", str(package), "--store", str(tmp_path / "store"), "--model-cache",
                     str(tmp_path / "cache"))
    assert published.returncode == 0, published.stderr
    record = json.loads(published.stdout.strip().splitlines()[-1])
    assert record["package_uri"].endswith("packages/my-model/2.0.0.tar.gz")
    cached = parse_manifest((Path(record["model_cache_uri"]) / MANIFEST_NAME).read_text())
    assert cached == manifest


def test_publish_to_s3_through_boto3(model_dir: Path, tmp_path: Path):
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    try:
        host, port = server.get_host_and_port()
        env = {"AWS_ENDPOINT_URL": f"http://{host}:{port}", "AWS_ACCESS_KEY_ID": "test",
               "AWS_SECRET_ACCESS_KEY": "test", "AWS_DEFAULT_REGION": "us-east-1"}
        boto3.client("s3", endpoint_url=env["AWS_ENDPOINT_URL"], region_name="us-east-1",
                     aws_access_key_id="test", aws_secret_access_key="test").create_bucket(Bucket="models")
        assert _cli("package", str(model_dir), "--id", "m", "--version", "1", "--out",
                    str(tmp_path / "p.tar.gz")).returncode == 0
        published = _cli("publish", str(tmp_path / "p.tar.gz"), "--store", "s3://models/llm", env=env)
        assert published.returncode == 0, published.stderr
        record = json.loads(published.stdout.strip().splitlines()[-1])
        assert record["package_uri"] == "s3://models/llm/packages/m/1.tar.gz"
    finally:
        server.stop()


def test_refusals_exit_2_naming_the_problem(model_dir: Path, tmp_path: Path):
    bad = _cli("package", str(model_dir), "--id", "Bad_Id", "--version", "1", "--out", str(tmp_path / "x"))
    assert bad.returncode == 2 and "model.id 'Bad_Id'" in bad.stderr
    (tmp_path / "corrupt").mkdir()
    corrupt = _cli("publish", str(tmp_path / "corrupt"), "--store", str(tmp_path / "store"))
    assert corrupt.returncode == 2 and "package.toml" in corrupt.stderr
    bad_store = _cli("publish", str(tmp_path / "corrupt"), "--store", "gs://bucket")
    assert bad_store.returncode == 2 and "unsupported store" in bad_store.stderr


def test_make_up_model_identity(model_dir: Path):
    # The version `make up` gives it is derived from the package's content: tests/serving/test_cli_local_versions.py.
    assert _model_id_from_dir(model_dir) == "my-model-v2"
