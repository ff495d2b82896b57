"""Triton model repositories generated from model packages, compared with golden files (tests/serving/golden/).

Triton itself cannot run here; what can be checked is that the generated files are exactly the reviewed ones, that
they parse as Triton's own `ModelConfig` protobuf, that their I/O gives the package's fingerprint, and that the
structured-output engine argument follows the chosen release. Regenerate the golden files after a deliberate
change with `LLM_SERVING_UPDATE_GOLDEN=1 pytest tests/serving/test_triton_repository.py` and review the diff.
"""

from __future__ import annotations

import json
import os
from pathlib import Path, PurePosixPath

import pytest
from google.protobuf import text_format
from tritonclient.grpc import model_config_pb2 as mc

from llm_serving.package import PackageSpec, build_package, open_package
from llm_serving.tensor_contract import VLLM_IO_FINGERPRINT, io_fingerprint, pbtxt_io
from serving_image.triton.pins import load_pins
from serving_image.triton.repository import RepositoryError, generate_repository, structured_engine_args

GOLDEN = Path(__file__).parent / "golden"
ROOT = PurePosixPath("/models/cache/demo-tiny/1.0.0")
ENGINE_ARGS = {"max_model_len": 4096, "gpu_memory_utilization": 0.9, "enable_prefix_caching": True}
# A package of several tasks leaves each engine's share to the pod (or states one that fits them all).
SHARED_ENGINE_ARGS = {k: v for k, v in ENGINE_ARGS.items() if k != "gpu_memory_utilization"}

PYTHON_CONFIG = '''
name: "whatever-the-author-called-it"
backend: "python"
max_batch_size: 8
input [
  { name: "features" data_type: TYPE_FP32 dims: [ 16 ] },
  { name: "request_text" data_type: TYPE_STRING dims: [ 1 ] optional: true }
]
output [ { name: "score" data_type: TYPE_FP32 dims: [ 1 ] } ]
dynamic_batching { max_queue_delay_microseconds: 500 }
instance_group [ { count: 2 kind: KIND_GPU } ]
'''
PYTHON_MODEL = '''import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        return [pb_utils.InferenceResponse(output_tensors=[]) for _ in requests]
'''


def _model_dir(tmp_path: Path) -> Path:
    model = tmp_path / "hf-model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"]}))
    (model / "tokenizer.json").write_text("{}")
    return model


def _check_golden(actual: Path, name: str) -> None:
    golden = GOLDEN / name
    if os.environ.get("LLM_SERVING_UPDATE_GOLDEN") == "1":
        golden.parent.mkdir(parents=True, exist_ok=True)
        golden.write_text(actual.read_text())
    assert golden.is_file(), f"{golden} is missing: generate it with LLM_SERVING_UPDATE_GOLDEN=1 and review it"
    assert actual.read_text() == golden.read_text(), f"{name} differs from its golden file"


@pytest.fixture
def vllm_package(tmp_path):
    built = build_package(PackageSpec(_model_dir(tmp_path), "demo-tiny", "1.0.0", engine_args=ENGINE_ARGS),
                          tmp_path / "pkg")
    return open_package(built)


@pytest.mark.parametrize("release", ["26.08", "25.09"])
def test_vllm_repository_matches_golden(vllm_package, tmp_path, release):
    pins = load_pins()
    model_dir = generate_repository(vllm_package.manifest, vllm_package.root, tmp_path / "repo",
                                    pins.release(release), package_root=ROOT)
    assert sorted(p.relative_to(model_dir).as_posix() for p in model_dir.rglob("*") if p.is_file()) == \
        ["1/model.json", "config.pbtxt"]
    _check_golden(model_dir / "config.pbtxt", f"vllm-{release}/demo-tiny/config.pbtxt")
    _check_golden(model_dir / "1" / "model.json", f"vllm-{release}/demo-tiny/1/model.json")

    config = mc.ModelConfig()
    text_format.Parse((model_dir / "config.pbtxt").read_text(), config)
    assert config.backend == "vllm" and config.model_transaction_policy.decoupled and config.max_batch_size == 0
    text = (model_dir / "config.pbtxt").read_text()
    assert io_fingerprint(*pbtxt_io(text)) == VLLM_IO_FINGERPRINT == vllm_package.manifest.model.io_fingerprint
    engine = json.loads((model_dir / "1" / "model.json").read_text())
    assert engine["model"] == f"{ROOT}/weights" and engine["max_model_len"] == 4096
    key = pins.release(release).structured_outputs_engine_arg
    assert key in engine
    other = {"structured_outputs_config", "guided_decoding_backend"} - {key}
    assert not other & set(engine), "only the release's own name for the structured-output backend"


def test_python_repository_matches_golden(tmp_path):
    (tmp_path / "model.py").write_text(PYTHON_MODEL)
    (tmp_path / "config.pbtxt").write_text(PYTHON_CONFIG)
    built = build_package(PackageSpec(_model_dir(tmp_path), "ranker", "2.1.0", backend="python",
                                      python_model=tmp_path / "model.py", config_pbtxt=tmp_path / "config.pbtxt"),
                          tmp_path / "pkg")
    package = open_package(built)
    model_dir = generate_repository(package.manifest, package.root, tmp_path / "repo", load_pins().pinned,
                                    package_root=PurePosixPath("/models/cache/ranker/2.1.0"))
    _check_golden(model_dir / "config.pbtxt", "python/ranker/config.pbtxt")
    assert (model_dir / "1" / "model.py").read_text() == PYTHON_MODEL
    config = mc.ModelConfig()
    text_format.Parse((model_dir / "config.pbtxt").read_text(), config)
    assert config.name == "ranker" and config.backend == "python" and config.max_batch_size == 8
    assert config.parameters["weights_dir"].string_value == "/models/cache/ranker/2.1.0/weights"
    # the regenerated I/O is the package's: same fingerprint
    assert io_fingerprint(*pbtxt_io((model_dir / "config.pbtxt").read_text())) == \
        package.manifest.model.io_fingerprint


def test_python_config_must_be_python_backend(tmp_path):
    (tmp_path / "model.py").write_text(PYTHON_MODEL)
    (tmp_path / "config.pbtxt").write_text(PYTHON_CONFIG.replace('backend: "python"', 'backend: "onnxruntime"'))
    built = build_package(PackageSpec(_model_dir(tmp_path), "ranker", "2.1.0", backend="python",
                                      python_model=tmp_path / "model.py", config_pbtxt=tmp_path / "config.pbtxt"),
                          tmp_path / "pkg")
    package = open_package(built)
    with pytest.raises(RepositoryError, match="onnxruntime"):
        generate_repository(package.manifest, package.root, tmp_path / "repo", load_pins().pinned)


def test_structured_engine_args_follow_the_release():
    pins = load_pins()
    new, old = pins.release("26.08"), pins.release("25.09")
    assert structured_engine_args({}, new) == {"structured_outputs_config": {"backend": "xgrammar",
                                                                             "disable_any_whitespace": True}}
    assert structured_engine_args({}, old) == {"guided_decoding_backend": "xgrammar",
                                               "guided_decoding_disable_any_whitespace": True}
    # a package written for either naming is translated to the release's
    assert structured_engine_args({"guided_decoding_backend": "guidance"}, new)["structured_outputs_config"][
        "backend"] == "guidance"
    assert structured_engine_args({"structured_outputs_config": {"backend": "outlines"}}, old) == \
        {"guided_decoding_backend": "outlines"}
    with pytest.raises(RepositoryError, match="reasoning_parser"):
        structured_engine_args({"structured_outputs_config": {"backend": "xgrammar", "reasoning_parser": "x"}}, old)


def test_embed_and_score_tasks_become_models_of_their_own(tmp_path):
    """A package serving generate, embed and score becomes three Triton models (serving_image/triton/models.py):
    the LLM, its pooling model (the same backend and contract, model.json with runner pooling, no structured
    outputs) and the platform's scoring model (python backend, explicit I/O, not decoupled, its model.py and
    engine_in_stub.py beside the LLM's model.json); an embedding-only package's id names its pooling model."""
    from serving_image.triton.models import SCORING_INPUTS, SCORING_OUTPUTS, package_models

    built = build_package(PackageSpec(_model_dir(tmp_path), "demo-tiny", "1.0.0", engine_args=SHARED_ENGINE_ARGS,
                                      tasks=("generate", "embed", "score")), tmp_path / "pkg")
    package = open_package(built)
    repo = tmp_path / "repo"
    generate_repository(package.manifest, package.root, repo, load_pins().pinned, package_root=ROOT)
    assert package_models(package.manifest).names == ("demo-tiny", "demo-tiny-embed", "demo-tiny-score")
    assert sorted(p.name for p in repo.iterdir()) == ["demo-tiny", "demo-tiny-embed", "demo-tiny-score"]
    llm = json.loads((repo / "demo-tiny" / "1" / "model.json").read_text())
    pooling = json.loads((repo / "demo-tiny-embed" / "1" / "model.json").read_text())
    assert "runner" not in llm and "structured_outputs_config" in llm
    assert pooling == {**{k: v for k, v in llm.items() if k != "structured_outputs_config"}, "runner": "pooling",
                       "convert": "embed"}
    assert pbtxt_io((repo / "demo-tiny-embed" / "config.pbtxt").read_text()) == \
        pbtxt_io((repo / "demo-tiny" / "config.pbtxt").read_text())
    assert 'name: "demo-tiny-embed"' in (repo / "demo-tiny-embed" / "config.pbtxt").read_text()
    score_dir = repo / "demo-tiny-score"
    assert sorted(p.relative_to(score_dir).as_posix() for p in score_dir.rglob("*") if p.is_file()) == \
        ["1/engine_in_stub.py", "1/model.json", "1/model.py", "config.pbtxt"]
    assert json.loads((score_dir / "1" / "model.json").read_text()) == llm
    config = mc.ModelConfig()
    text_format.Parse((score_dir / "config.pbtxt").read_text(), config)
    assert (config.name, config.backend, config.max_batch_size) == ("demo-tiny-score", "python", 0)
    assert not config.model_transaction_policy.decoupled
    assert pbtxt_io((score_dir / "config.pbtxt").read_text()) == (SCORING_INPUTS, SCORING_OUTPUTS)

    (tmp_path / "e").mkdir()
    embed_only = open_package(build_package(PackageSpec(_model_dir(tmp_path / "e"), "embed-base", "1.0.0",
                                                        engine_args=ENGINE_ARGS, tasks=("embed",)),
                                            tmp_path / "pkg-e"))
    generate_repository(embed_only.manifest, embed_only.root, repo, load_pins().pinned, package_root=ROOT)
    assert package_models(embed_only.manifest).names == ("embed-base",)
    assert json.loads((repo / "embed-base" / "1" / "model.json").read_text())["runner"] == "pooling"


def test_each_engine_gets_its_share_of_the_gpu_memory(tmp_path, monkeypatch):
    """Three tasks start three engines on the same GPUs: each model.json gets its share (what the Deployment renders
    in LLM_SERVING_ENGINE_MEMORY, or equal shares of 0.9 without it), never vLLM's default 0.9 each; a pod whose
    budget counts other tasks than the package's is refused naming both, and a package stating a share too large
    for its engines is refused at packaging naming its tasks."""
    from llm_serving import pod_contract as pc
    from llm_serving.manifest import ManifestError
    from serving_image.triton.runtime import _write_repository

    package = open_package(build_package(PackageSpec(_model_dir(tmp_path), "demo-tiny", "1.0.0",
                                                     engine_args=SHARED_ENGINE_ARGS,
                                                     tasks=("generate", "embed", "score")), tmp_path / "pkg"))

    def shares(repo: Path) -> dict[str, float]:
        return {name: json.loads((repo / name / "1" / "model.json").read_text())["gpu_memory_utilization"]
                for name in ("demo-tiny", "demo-tiny-embed", "demo-tiny-score")}

    monkeypatch.delenv(pc.ENV_ENGINE_MEMORY, raising=False)
    _write_repository([package], tmp_path / "own", None)
    assert shares(tmp_path / "own") == dict.fromkeys(("demo-tiny", "demo-tiny-embed", "demo-tiny-score"), 0.3)
    monkeypatch.setenv(pc.ENV_ENGINE_MEMORY, "generate=0.5,embed=0.2,score=0.2")
    _write_repository([package], tmp_path / "pod", None)
    assert shares(tmp_path / "pod") == {"demo-tiny": 0.5, "demo-tiny-embed": 0.2, "demo-tiny-score": 0.2}
    monkeypatch.setenv(pc.ENV_ENGINE_MEMORY, "generate=0.9")
    with pytest.raises(RuntimeError, match=r"budgets the GPU memory of engines for tasks generate, but the "
                                           r"package's engine.tasks are generate, embed, score"):
        _write_repository([package], tmp_path / "other", None)
    monkeypatch.setenv(pc.ENV_ENGINE_MEMORY, "generate=0.5,embed=0.5,score=0.2")
    with pytest.raises(pc.PodContractError, match=r"the engines of tasks generate, embed, score would take 1.2 of "
                                                  r"each GPU's memory together, more than the 0.9 one engine may"):
        _write_repository([package], tmp_path / "over", None)

    (tmp_path / "x").mkdir()
    with pytest.raises((ManifestError, ValueError), match=r"gpu_memory_utilization 0.9: tasks generate, embed start 2 "
                                                          r"engines on the same GPUs, each taking it: 1.8"):
        build_package(PackageSpec(_model_dir(tmp_path / "x"), "demo-tiny", "1.0.0", engine_args=ENGINE_ARGS,
                                  tasks=("generate", "embed")), tmp_path / "pkg-x")


def test_score_task_needs_generate(tmp_path):
    from llm_serving.manifest import ManifestError

    with pytest.raises((ManifestError, ValueError), match="'score' needs 'generate'"):
        build_package(PackageSpec(_model_dir(tmp_path), "demo-tiny", "1.0.0", engine_args=ENGINE_ARGS,
                                  tasks=("embed", "score")), tmp_path / "pkg")
