"""The serving image's build context: the repository root, and a content hash that covers every file the
Dockerfile copies (infra/image_context.py), so that a change to llm_serving/ or native/ changes the image's tag."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from infra.image_context import ImageContextError, context_files, context_hash, copy_sources
from infra.mockrun import REPO_ROOT

DOCKERFILE = REPO_ROOT / "serving_image" / "Dockerfile"


def test_the_hash_covers_every_source_the_dockerfile_copies():
    sources = copy_sources(DOCKERFILE)
    expected = {"pyproject.toml", "README.md", "native", "llm_serving", "serving_image", "infra", "policies"}
    assert expected <= set(sources)
    files = {p.relative_to(REPO_ROOT).as_posix() for p in context_files(REPO_ROOT, DOCKERFILE)}
    for source in sources:
        assert any(f == source or f.startswith(source + "/") for f in files), source
    assert "llm_serving/pod_contract.py" in files and "native/CMakeLists.txt" in files
    assert "serving_image/Dockerfile" in files
    # what the ignore file drops is not part of the build, nor of the hash
    assert not any(f.startswith(("tests/", "stacks/", "infra/crd_validate/node_modules/")) for f in files)
    assert not any("__pycache__" in f for f in files)


def _tree(tmp_path: Path) -> Path:
    root = tmp_path / "repo"
    (root / "serving_image").mkdir(parents=True)
    for sub in ("llm_serving", "native", "tests"):
        (root / sub).mkdir()
        (root / sub / "a.py").write_text("x = 1\n")
    (root / "pyproject.toml").write_text("[project]\n")
    (root / "serving_image" / "Dockerfile").write_text(
        "FROM base AS build\nCOPY pyproject.toml ./\nCOPY llm_serving/ \\\n     llm_serving/\nCOPY native/ native/\n"
        "COPY serving_image/ serving_image/\nFROM base\nCOPY --from=build /wheels/ /tmp/wheels/\n")
    (root / "serving_image" / "Dockerfile.dockerignore").write_text("tests\n**/__pycache__\n")
    return root


def test_a_change_to_llm_serving_or_native_changes_the_hash(tmp_path):
    """On the old code the hash covered serving_image/ only."""
    root = _tree(tmp_path)
    dockerfile = root / "serving_image" / "Dockerfile"
    before = context_hash(root, dockerfile)
    for changed in ("llm_serving/a.py", "native/a.py", "pyproject.toml", "serving_image/Dockerfile"):
        path = root / changed
        original = path.read_text()
        path.write_text(original + "# changed\n")
        assert context_hash(root, dockerfile) != before, changed
        path.write_text(original)
    assert context_hash(root, dockerfile) == before
    # what the build does not copy does not matter
    (root / "tests" / "a.py").write_text("changed\n")
    (root / "llm_serving" / "__pycache__").mkdir()
    (root / "llm_serving" / "__pycache__" / "a.cpython-311.pyc").write_bytes(b"\0")
    assert context_hash(root, dockerfile) == before


def test_a_missing_copy_source_is_named(tmp_path):
    root = _tree(tmp_path)
    shutil.rmtree(root / "native")
    with pytest.raises(ImageContextError, match="copies 'native', which is not in the build context"):
        context_hash(root, root / "serving_image" / "Dockerfile")
