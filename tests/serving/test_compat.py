"""llm_serving/compat.py, the one reader of serving_image/compat.toml (docs/architecture.md §3.9): every section of
the shipped file is read and typed, and a missing, ill-typed or unknown key is refused naming the file and the key.
Fast: no engine, no server."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

import pytest

from llm_serving.compat import COMPAT_PATH, CompatError, load_compat

TEXT = COMPAT_PATH.read_text()


def _write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "compat.toml"
    path.write_text(text)
    return path


def test_every_section_of_the_shipped_file_is_read():
    """The typed values are the file's, section by section (compared with a plain TOML read of the same file)."""
    raw = tomllib.loads(TEXT)
    compat = load_compat()
    assert compat.source == COMPAT_PATH and compat.schema == raw["schema"] == 1
    triton = raw["triton"]
    for key in ("release", "image", "python", "vllm_version", "vllm_build", "vllm_backend_branch",
                "structured_outputs_key", "structured_outputs_engine_arg"):
        assert getattr(compat.triton, key) == triton[key], key
    assert compat.triton.backend_imports == tuple(triton["backend_imports"]["modules"])
    assert compat.triton.image_tag == triton["image"].rsplit(":", 1)[1]
    stub = compat.triton.stub
    assert (stub.python, stub.backend_directory) == (triton["stub"]["python"], triton["stub"]["backend_directory"])
    assert (dict(stub.base), dict(stub.install)) == (triton["stub"]["base"], triton["stub"]["install"])
    local = raw["local"]
    assert (compat.local.distribution, compat.local.vllm_version) == (local["distribution"], local["vllm_version"])
    assert compat.local.differences == tuple(local["differences"])
    lt = compat.local.triton
    for key, value in local["triton"].items():
        assert getattr(lt, key) == (tuple(value) if isinstance(value, list) else value), key
    assert lt.stub_distributions() == {k.removeprefix("stub_"): v for k, v in local["triton"].items()
                                       if k.startswith("stub_")}
    assert [h.release for h in compat.history] == [h["release"] for h in raw["history"]]
    for entry, expected in zip(compat.history, raw["history"], strict=True):
        assert {k: getattr(entry, k) for k in expected} == {**expected,
                                                            "backend_imports": tuple(expected["backend_imports"])}
    assert compat.pinned.release == compat.triton.release
    assert compat.pinned.backend_imports == compat.triton.backend_imports
    assert compat.releases()[1:] == compat.history


def test_parsed_once_per_content(tmp_path):
    assert load_compat() is load_compat(COMPAT_PATH)
    path = _write(tmp_path, TEXT)
    first = load_compat(path)
    assert load_compat(path) is first
    path.write_text(TEXT.replace('\nvllm_version = "0.32.0"\n', '\nvllm_version = "0.33.0"\n'))
    assert load_compat(path).local.vllm_version == "0.33.0"  # a changed file is read again


@pytest.mark.parametrize(("old", "new", "message"), [
    ('\nrelease = "26.08"\n', "\n", "triton.release is missing"),
    ("\nschema = 1\n", "\n", "schema is missing"),
    ('\nbackend_directory = "/opt/tritonserver/backends/python"\n', "\n", "triton.stub.backend_directory is missing"),
    ('\nstub_scipy = "1.13.1"\n', "\n", "local.triton.stub_scipy is missing"),
    ('\nstructured_outputs_key = "guided_decoding"\n', "\n", r"history\[0\].structured_outputs_key is missing"),
    ("\n[triton.backend_imports]\n", "\n[triton.other_imports]\n", r"\[triton.backend_imports\] is missing"),
    ('\nvllm_version = "0.27.1"\n', "\nvllm_version = 0.27\n", "triton.vllm_version must be a non-empty string"),
    ("\nschema = 1\n", '\nschema = "1"\n', "schema must be an integer"),
    ("\nschema = 1\n", "\nschema = 2\n", "schema 2 is not read here"),
    ('\nrelease = "26.08"\n', '\nrelease = "26.8"\n', "triton.release must be a Triton release"),
    ('\nserver_version = "2.51.0"\n', '\nserver_version = "2.51.0"\nstub_torch = "2.5"\n',
     "local.triton.stub_torch: unknown key"),
    ('\nvllm_version = "0.27.1"\n', '\nvllm_version = "0.27.1"\nimage_tag = "26.08-vllm-python-py3"\n',
     "triton.image_tag: unknown key"),
    ('install = { xgboost = "3.0.5", scipy = "1.13.1" }', 'install = { xgboost = 3 }',
     'triton.stub.install must be a table of distribution = "version"'),
    ('install = { xgboost = "3.0.5", scipy = "1.13.1" }', 'install = { NumPy = "2.2.6" }',
     "triton.stub: numpy is in both base and install"),
    ('image = "nvcr.io/nvidia/tritonserver:26.08-', 'image = "nvcr.io/nvidia/tritonserver:26.07-',
     "triton.image '.*' is not release '26.08'"),
    ("[triton]\n", "[triton\n", "not valid TOML"),
])
def test_a_bad_key_is_named_with_the_file(tmp_path, old, new, message):
    assert old in TEXT
    path = _write(tmp_path, TEXT.replace(old, new, 1))
    with pytest.raises(CompatError, match=f"^{re.escape(str(path))}: {message}"):
        load_compat(path)


def test_a_missing_file_is_named(tmp_path):
    with pytest.raises(CompatError, match=f"^{re.escape(str(tmp_path / 'absent.toml'))}: cannot read"):
        load_compat(tmp_path / "absent.toml")
