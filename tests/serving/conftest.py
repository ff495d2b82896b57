"""Fixtures of the serving suite that several modules share.

`triton_standalone`: one real `tritonserver` (the local 2.51 from nvidia-pytriton) started by the startup procedure
on a `standalone` demo-tiny package (the stand-in vllm backend and its engine process), with the example
Python-backend package (examples/ticket_triage) served beside it, as the BLS example needs, and the demo ranker's
packages (examples/ranker: the XGBoost ranker, the pipeline's two Python steps and the pipeline, an ensemble; built by
llm_serving_cli.demo_packages, as `make up MODE=standalone` builds them), and the ranker's second I/O contract (the
same booster with the extra output `rank`, what the rehearsal's versioned rollout publishes as 1.1.0) under the id
`ranker-rank`, since one server serves one version of a model id. One per session: the KServe tests
(test_kserve_startup.py), the example's tests (test_triton_example.py) and the model-kind tests
(test_triton_model_kinds.py) share it, so the suite starts one Triton and one engine for all of them.
"""

from __future__ import annotations

from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = REPO / "examples" / "ticket_triage"
# float32: see docs/local-environment.md (this VM SIGILLs in vLLM's bf16 AMX attention kernel).
TRITON_ENGINE_ARGS = {"max_model_len": 2048, "kv_cache_memory_bytes": 128 * 1024 * 1024, "dtype": "float32"}


def build_example_package(out: Path) -> Path:
    from llm_serving.manifest import Backend, ServingMode
    from llm_serving.package import PackageSpec, build_package

    return build_package(PackageSpec(None, "ticket-triage", "1.0.0", backend=Backend.PYTHON,
                                     python_model=EXAMPLE / "model", config_pbtxt=EXAMPLE / "config.pbtxt",
                                     serving_mode=ServingMode.STANDALONE), out)


@pytest.fixture(scope="session")
def ranker_packages(tmp_path_factory) -> list[Path]:
    """The ranker (trained now, deterministically), its pipeline's steps and the pipeline (the ensemble, last)."""
    from llm_serving_cli.demo_packages import build_ranker_packages

    return build_ranker_packages(tmp_path_factory.mktemp("ranker"), version="1.0.0")


RANKER_RANK_ID = "ranker-rank"


@pytest.fixture(scope="session")
def ranker_rank_package(ranker_packages, tmp_path_factory) -> Path:
    """The ranker with its second I/O contract (llm_serving_cli.demo_packages.build_ranker(rank=True)), the same
    booster as ranker_packages' ranker, as RANKER_RANK_ID 1.1.0."""
    from llm_serving.package import open_package
    from llm_serving_cli.demo_packages import RANKER_ID, build_ranker

    weights = next(open_package(p) for p in ranker_packages if open_package(p).manifest.model.id == RANKER_ID) \
        .weights_path
    return build_ranker(tmp_path_factory.mktemp("ranker-rank") / RANKER_RANK_ID, "1.1.0", weights=weights, rank=True,
                        model_id=RANKER_RANK_ID)


RANKER_MISFIT_ID = "ranker-misfit"


@pytest.fixture(scope="session")
def ranker_misfit_package(tmp_path_factory) -> Path:
    """The rehearsal's candidate that serves errors (llm_serving_cli/rehearsal/storage.py, defect "serves-errors"):
    the ranker whose model code reads a calibration file its package lacks, as RANKER_MISFIT_ID 1.0.1."""
    from llm_serving_cli.rehearsal import storage

    model = {"id": RANKER_MISFIT_ID, "kind": "python"}
    return storage.build_version(model, "1.0.1", tmp_path_factory.mktemp("ranker-misfit"), defect="serves-errors")


@pytest.fixture(scope="session")
def triton_standalone(demo_model_dir, tmp_path_factory, ranker_packages, ranker_rank_package, ranker_misfit_package):
    from llm_serving.manifest import ServingMode
    from llm_serving.package import PackageSpec, build_package
    from serving_image.local_server import start_standalone_server

    root = tmp_path_factory.mktemp("triton-standalone")
    llm = build_package(PackageSpec(demo_model_dir, "demo-tiny", "1.0.0", engine_args=TRITON_ENGINE_ARGS,
                                    serving_mode=ServingMode.STANDALONE), root / "demo-tiny")
    example = build_example_package(root / "ticket-triage")
    companions = (example, *ranker_packages, ranker_rank_package, ranker_misfit_package)
    server = start_standalone_server(llm, root / "work", companions=companions)
    try:
        yield server
    finally:
        server.kill()
