"""The versions `make up` gives its packages (dev_packages/versions.py): derived from the bytes, so the
serving mode and anything else in the package changes them, and the same content gets the same version. No engine
starts here; `make check-up-modes` (bench/scripts/make_up_modes.sh) serves the three `make up` runs for real."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from dev_packages.demo import PIPELINE_ID, build_ranker_packages
from dev_packages.make_up import DEMO_ENGINE_ARGS, publish_for_up
from dev_packages.versions import CONTENT_VERSION, build_local_package
from llm_serving.manifest import ServingMode
from llm_serving.package import PackageError, PackageSpec, build_package, open_package
from llm_serving.up_layout import served_file, served_package

OPENAI, STANDALONE = ServingMode.OPENAI, ServingMode.STANDALONE


@pytest.fixture()
def model_dir(tmp_path: Path) -> Path:
    # Packaging reads the weights as bytes only: a config.json and a small file stand for a Hugging Face model.
    root = tmp_path / "model"
    root.mkdir()
    (root / "config.json").write_text(json.dumps({"model_type": "llama", "max_position_embeddings": 4096}))
    (root / "model.safetensors").write_bytes(b"\x00" * 1024)
    return root


def _llm(model_dir: Path, out: Path, mode: ServingMode = OPENAI, **engine_args):
    spec = PackageSpec(model_dir, "m", CONTENT_VERSION, engine_args=engine_args or {"max_model_len": 1024},
                       serving_mode=mode)
    return build_local_package(spec, out)


def test_llm_version_follows_the_bytes_mode_included(model_dir: Path, tmp_path: Path):
    first = _llm(model_dir, tmp_path / "a")
    again = _llm(model_dir, tmp_path / "b")
    assert again.version == first.version and again.path.read_bytes() == first.path.read_bytes()
    assert first.version.startswith("local-") and first.path.name == f"m-{first.version}.tar.gz"
    assert _llm(model_dir, tmp_path / "c", STANDALONE).version != first.version
    assert _llm(model_dir, tmp_path / "d", max_model_len=2048).version != first.version
    (model_dir / "model.safetensors").write_bytes(b"\x01" * 1024)
    assert _llm(model_dir, tmp_path / "e").version != first.version


def test_a_local_package_is_what_build_package_writes_for_its_version(model_dir: Path, tmp_path: Path):
    """The version is stamped into the draft's manifest rather than built twice: the result must be the package
    build_package makes with that version, byte for byte, packed or not, and it opens as that version."""
    spec = PackageSpec(model_dir, "m", CONTENT_VERSION, engine_args={"max_model_len": 1024}, serving_mode=STANDALONE)
    built = build_local_package(spec, tmp_path / "local")
    reference = build_package(dataclasses.replace(spec, version=built.version), tmp_path / "ref.tar.gz")
    assert built.path.read_bytes() == reference.read_bytes()
    unpacked = build_local_package(spec, tmp_path / "dir", packed=False)
    assert unpacked.version == built.version and unpacked.path.is_dir()
    manifest = open_package(unpacked.path).manifest
    assert (manifest.model.version, manifest.serving_mode) == (built.version, STANDALONE)


def test_a_fixed_version_is_refused_naming_it(model_dir: Path, tmp_path: Path):
    with pytest.raises(PackageError, match=r"m: version '1\.0\.0' given.*'local-content'"):
        build_local_package(PackageSpec(model_dir, "m", "1.0.0"), tmp_path)


def _versions(packages: list[Path]) -> dict[str, str]:
    manifests = [open_package(p).manifest for p in packages]
    return {m.model.id: m.model.version for m in manifests}


def test_ranker_family_versions_follow_the_bytes_mode_included(tmp_path: Path):
    """The ranker (trained for real by examples/ranker/train.py), the pipeline's steps and the pipeline: each its
    own content version, the pipeline naming its steps' versions."""
    openai = build_ranker_packages(tmp_path / "a", serving_mode=OPENAI)
    again = build_ranker_packages(tmp_path / "b", serving_mode=OPENAI)
    standalone = build_ranker_packages(tmp_path / "c", serving_mode=STANDALONE)
    versions = _versions(openai)
    assert _versions(again) == versions and all(v.startswith("local-") for v in versions.values())
    other = _versions(standalone)
    assert set(other) == set(versions) and all(other[i] != versions[i] for i in versions), (versions, other)
    pipeline = open_package(openai[-1]).manifest
    assert pipeline.model.id == PIPELINE_ID
    assert {s.id: s.version for s in pipeline.ensemble.steps} == {i: v for i, v in versions.items() if i != PIPELINE_ID}


def test_up_publishes_openai_standalone_openai_into_one_store(demo_model_dir: Path, tmp_path: Path):
    """What `make up`, `make up MODE=standalone`, `make up` do before the server starts (publish_for_up): every
    package publishes in both modes (no immutability refusal), and the third run finds its packages published with
    the same bytes."""
    def up(mode: ServingMode):
        published = publish_for_up(tmp_path / "cache", demo_model_dir, "demo-tiny", dict(DEMO_ENGINE_ARGS), mode,
                                   with_companions=True)
        return _versions([published.package, *published.companions])

    openai, standalone = up(OPENAI), up(STANDALONE)
    assert len(openai) == 5 and set(standalone) == set(openai)
    # What the last run serves is recorded for the client beside it (examples/consumer: --in-process MODEL).
    served = json.loads(served_file(tmp_path / "cache").read_text())
    assert {model: entry["version"] for model, entry in served.items()} == standalone
    assert all(Path(entry["package"]).is_dir() for entry in served.values())
    assert served_package("ranker", {"LLM_SERVING_CACHE": str(tmp_path / "cache")}) == (
        standalone["ranker"], Path(served["ranker"]["package"]))
    with pytest.raises(ValueError, match="does not serve 'nope'; it serves demo-tiny, ranker"):
        served_package("nope", {"LLM_SERVING_CACHE": str(tmp_path / "cache")})
    with pytest.raises(ValueError, match="served.json: no such file; `make up` writes it"):
        served_package("ranker", {"LLM_SERVING_CACHE": str(tmp_path / "elsewhere")})
    assert all(standalone[i] != openai[i] for i in openai)
    store = tmp_path / "cache" / "store" / "packages"
    before = {p: p.read_bytes() for p in store.rglob("*.tar.gz")}
    assert up(OPENAI) == openai
    assert {p: p.read_bytes() for p in store.rglob("*.tar.gz")} == before  # nothing new, nothing rewritten
    assert len(before) == 10
