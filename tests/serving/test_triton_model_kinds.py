"""Every model kind through one interface (docs/architecture.md §3.4 "Model kinds", docs/kserve.md): the
LLM (vllm backend, decoupled, streamed), the XGBoost ranker (Python backend, numeric I/O, dynamic batching, unary
ModelInfer over gRPC and HTTP) and the ranker pipeline (a Triton ensemble of two Python steps around the ranker),
each a package, all served by one real tritonserver (the session's, tests/serving/conftest.py) and called by one
tritonclient program.

The package checks for ensembles (their steps named by (id, version), resolved among the packages served beside
them) are tested here too, without a server.
"""

from __future__ import annotations

import queue

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from dev_packages.demo import (
    BOOSTER_FILE,
    FEATURES_ID,
    N_FEATURES,
    PIPELINE_ID,
    RANKER_EXAMPLE,
    RANKER_ID,
    RELEVANCE_ID,
    booster_predictions,
)
from llm_serving.kserve_stream import until_final
from llm_serving.manifest import Backend, ServingMode
from llm_serving.package import PackageError, PackageSpec, build_package, open_package
from llm_serving.tensor_contract import TensorSpec, io_fingerprint
from serving_image.triton.repository import RepositoryError, resolve_ensembles
from tests.serving.conftest import RANKER_MISFIT_ID, RANKER_RANK_ID

pytestmark = pytest.mark.slow

LLM = "demo-tiny"
PIPELINE_CONFIG = RANKER_EXAMPLE / "pipeline" / "config.pbtxt"


def _grpc(server) -> grpcclient.InferenceServerClient:
    return grpcclient.InferenceServerClient(f"127.0.0.1:{server.ports['kserve_grpc']}")


def _http(server) -> httpclient.InferenceServerClient:
    return httpclient.InferenceServerClient(f"127.0.0.1:{server.ports['kserve_http']}")


def _raw_batch(rows: int = 6) -> np.ndarray:
    """Raw candidate features (counts and amounts, >= 0) for a batch, fixed."""
    return np.random.default_rng(15).exponential(scale=3.0, size=(rows, N_FEATURES)).astype(np.float32)


def _features(raw: np.ndarray) -> np.ndarray:
    return np.log1p(raw).astype(np.float32)  # what ranker-features computes (examples/ranker/train.py)


def _package(packages, model_id):
    return open_package(next(p for p in packages if open_package(p).manifest.model.id == model_id))


# -- one program, one endpoint, every kind -----------------------------------------------------------------------


def test_one_client_sees_every_kind_ready(triton_standalone):
    client = _grpc(triton_standalone)
    index = {m["name"]: m for m in client.get_model_repository_index(as_json=True)["models"]}
    for model in (LLM, RANKER_ID, PIPELINE_ID, FEATURES_ID, RELEVANCE_ID, RANKER_RANK_ID):
        assert index[model]["state"] == "READY", index
        assert client.is_model_ready(model)
    assert client.get_model_config(PIPELINE_ID, as_json=True)["config"]["platform"] == "ensemble"
    assert client.get_model_config(RANKER_ID, as_json=True)["config"]["backend"] == "python"
    assert client.get_model_config(LLM, as_json=True)["config"]["backend"] == "vllm"


def test_ranker_scores_a_batch_over_grpc_as_the_booster_does(triton_standalone, ranker_packages):
    features = _features(_raw_batch())
    inputs = [grpcclient.InferInput("features", list(features.shape), "FP32")]
    inputs[0].set_data_from_numpy(features)
    result = _grpc(triton_standalone).infer(RANKER_ID, inputs, outputs=[grpcclient.InferRequestedOutput("score")])
    scores = result.as_numpy("score")
    assert scores.dtype == np.float32 and scores.shape == (len(features), 1)
    booster = _package(ranker_packages, RANKER_ID).weights_path / BOOSTER_FILE
    np.testing.assert_allclose(scores.reshape(-1), booster_predictions(booster, features), rtol=1e-6, atol=1e-6)
    assert len(set(scores.reshape(-1).tolist())) > 1  # a real model, not a constant


def test_ranker_answers_http_clients_and_batches_requests_together(triton_standalone, ranker_packages):
    features = _features(_raw_batch(8))
    client = _http(triton_standalone)
    single = []
    for row in features:  # one row per request; the same rows as one batch must score the same
        inputs = [httpclient.InferInput("features", [1, N_FEATURES], "FP32")]
        inputs[0].set_data_from_numpy(row.reshape(1, -1))
        single.append(client.infer(RANKER_ID, inputs).as_numpy("score").reshape(-1)[0])
    inputs = [httpclient.InferInput("features", list(features.shape), "FP32")]
    inputs[0].set_data_from_numpy(features, binary_data=False)  # JSON tensors too
    batch = client.infer(RANKER_ID, inputs).as_numpy("score").reshape(-1)
    np.testing.assert_allclose(batch, single, rtol=1e-6, atol=1e-6)
    booster = _package(ranker_packages, RANKER_ID).weights_path / BOOSTER_FILE
    np.testing.assert_allclose(batch, booster_predictions(booster, features), rtol=1e-6, atol=1e-6)
    config = client.get_model_config(RANKER_ID)
    assert config["max_batch_size"] > 0 and "dynamic_batching" in config


def test_ranker_refuses_bad_inputs_naming_them(triton_standalone):
    client = _grpc(triton_standalone)
    wrong_width = [grpcclient.InferInput("features", [2, N_FEATURES + 1], "FP32")]
    wrong_width[0].set_data_from_numpy(np.zeros((2, N_FEATURES + 1), dtype=np.float32))
    with pytest.raises(InferenceServerException, match="features"):
        client.infer(RANKER_ID, wrong_width)
    infinite = np.zeros((3, N_FEATURES), dtype=np.float32)
    infinite[2, 5] = np.inf
    inputs = [grpcclient.InferInput("features", list(infinite.shape), "FP32")]
    inputs[0].set_data_from_numpy(infinite)
    with pytest.raises(InferenceServerException, match="input 'features' row 2 column 5 is infinite"):
        client.infer(RANKER_ID, inputs)
    wrong_type = [grpcclient.InferInput("features", [1, N_FEATURES], "FP64")]
    wrong_type[0].set_data_from_numpy(np.zeros((1, N_FEATURES), dtype=np.float64))
    with pytest.raises(InferenceServerException, match="(?i)data-type|datatype|FP64"):
        client.infer(RANKER_ID, wrong_type)


@pytest.mark.parametrize("model_id", [RANKER_ID, PIPELINE_ID, FEATURES_ID, RELEVANCE_ID])
def test_io_fingerprint_fixed_at_packaging_is_what_the_server_reports(triton_standalone, ranker_packages, model_id):
    """The fingerprint in the manifest (computed from config.pbtxt at packaging) equals the one computed from the
    configuration Triton reports for the loaded model (/v2/models/<m>/config)."""
    config = _http(triton_standalone).get_model_config(model_id)

    def specs(entries):
        return tuple(TensorSpec(e["name"], "BYTES" if e["data_type"] == "TYPE_STRING" else
                                e["data_type"].removeprefix("TYPE_"), tuple(e["dims"]), bool(e.get("optional")))
                     for e in entries)

    served = io_fingerprint(specs(config["input"]), specs(config["output"]))
    assert _package(ranker_packages, model_id).manifest.model.io_fingerprint == served


def test_the_second_contracts_fingerprint_is_what_the_server_reports(triton_standalone, ranker_rank_package):
    config = _http(triton_standalone).get_model_config(RANKER_RANK_ID)
    specs = [tuple(TensorSpec(e["name"], e["data_type"].removeprefix("TYPE_"), tuple(e["dims"]),
                              bool(e.get("optional"))) for e in config[key]) for key in ("input", "output")]
    assert open_package(ranker_rank_package).manifest.model.io_fingerprint == io_fingerprint(*specs)


def test_the_rankers_second_io_contract_answers_old_format_requests_and_adds_rank(triton_standalone, ranker_packages,
                                                                                ranker_rank_package):
    """The ranker's 1.1.0 (served here as ranker-rank beside the plain ranker, the same booster): the same inputs, so
    a request of the old format is answered, with the same scores; its extra output `rank` is there only on it."""
    features = _features(_raw_batch(7))
    inputs = [grpcclient.InferInput("features", list(features.shape), "FP32")]
    inputs[0].set_data_from_numpy(features)
    client = _grpc(triton_standalone)
    old = client.infer(RANKER_ID, inputs)
    new = client.infer(RANKER_RANK_ID, inputs)
    scores = old.as_numpy("score").reshape(-1)
    np.testing.assert_array_equal(new.as_numpy("score").reshape(-1), scores)
    rank = new.as_numpy("rank")
    assert rank.dtype == np.int32 and rank.shape == (len(features), 1)
    assert rank.reshape(-1).tolist() == [sorted(scores.tolist(), reverse=True).index(s) + 1 for s in scores.tolist()]
    assert old.as_numpy("rank") is None  # the plain ranker has no such output ...
    with pytest.raises(InferenceServerException, match="rank"):  # ... and refuses to be asked for it
        client.infer(RANKER_ID, inputs, outputs=[grpcclient.InferRequestedOutput("rank")])
    # an old-format client that asks for `score` only gets just that from the new version
    only = client.infer(RANKER_RANK_ID, inputs, outputs=[grpcclient.InferRequestedOutput("score")])
    assert only.as_numpy("rank") is None and only.as_numpy("score") is not None
    # HTTP, JSON tensors: ranks are per request, not per server batch
    http_inputs = [httpclient.InferInput("features", [2, N_FEATURES], "FP32")]
    http_inputs[0].set_data_from_numpy(features[:2], binary_data=False)
    assert sorted(_http(triton_standalone).infer(RANKER_RANK_ID, http_inputs).as_numpy("rank").reshape(-1)) == [1, 2]
    plain, ranked = _package(ranker_packages, RANKER_ID).manifest, open_package(ranker_rank_package).manifest
    assert plain.model.io_fingerprint != ranked.model.io_fingerprint
    config = _http(triton_standalone).get_model_config(RANKER_RANK_ID)
    assert [o["name"] for o in config["output"]] == ["score", "rank"]


def test_a_package_whose_model_code_fails_every_request_is_ready_and_answers_500(
        triton_standalone):
    """The rehearsal's candidate that serves errors: Triton loads it and reports it ready (its probes pass), and
    every request fails inside the model with the server's error, HTTP 500, which the Gateway retries on another pod
    (llm_serving/pod_contract.py GATEWAY_RETRY_STATUS_CODES); over gRPC the same failure is INTERNAL."""
    from llm_serving import pod_contract as pc

    client = _http(triton_standalone)
    assert client.is_model_ready(RANKER_MISFIT_ID)
    features = _features(_raw_batch(3))
    inputs = [httpclient.InferInput("features", list(features.shape), "FP32")]
    inputs[0].set_data_from_numpy(features)
    with pytest.raises(InferenceServerException) as err:
        client.infer(RANKER_MISFIT_ID, inputs)
    assert "calibration.json" in err.value.message(), err.value.message()
    assert int(err.value.status()) == 500 and 500 in pc.GATEWAY_RETRY_STATUS_CODES
    grpc_inputs = [grpcclient.InferInput("features", list(features.shape), "FP32")]
    grpc_inputs[0].set_data_from_numpy(features)
    with pytest.raises(InferenceServerException) as err:
        _grpc(triton_standalone).infer(RANKER_MISFIT_ID, grpc_inputs)
    assert err.value.status() == "StatusCode.INTERNAL" and "calibration.json" in err.value.message()


def test_ensemble_answers_as_one_model(triton_standalone, ranker_packages):
    raw = _raw_batch(5)
    inputs = [grpcclient.InferInput("raw", list(raw.shape), "FP32")]
    inputs[0].set_data_from_numpy(raw)
    result = _grpc(triton_standalone).infer(PIPELINE_ID, inputs)
    score = result.as_numpy("score").reshape(-1)
    booster = _package(ranker_packages, RANKER_ID).weights_path / BOOSTER_FILE
    np.testing.assert_allclose(score, booster_predictions(booster, _features(raw)), rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(result.as_numpy("relevance").reshape(-1), 1 / (1 + np.exp(-score.astype(np.float64))),
                               rtol=1e-6)
    assert result.as_numpy("relevant").reshape(-1).tolist() == (score > 0).tolist()
    # HTTP clients call it the same way
    http_inputs = [httpclient.InferInput("raw", list(raw.shape), "FP32")]
    http_inputs[0].set_data_from_numpy(raw)
    np.testing.assert_array_equal(_http(triton_standalone).infer(PIPELINE_ID, http_inputs).as_numpy("score")
                                  .reshape(-1), score)


def test_ensemble_step_errors_reach_the_caller_naming_the_input(triton_standalone):
    raw = _raw_batch(3)
    raw[1, 4] = -2.0
    inputs = [grpcclient.InferInput("raw", list(raw.shape), "FP32")]
    inputs[0].set_data_from_numpy(raw)
    with pytest.raises(InferenceServerException, match=r"input 'raw' row 1 column 4 is -2\.0"):
        _grpc(triton_standalone).infer(PIPELINE_ID, inputs)


def test_llm_streams_beside_them(triton_standalone):
    client = _grpc(triton_standalone)
    inputs = [grpcclient.InferInput("text_input", [1], "BYTES"), grpcclient.InferInput("stream", [1], "BOOL"),
              grpcclient.InferInput("sampling_parameters", [1], "BYTES")]
    inputs[0].set_data_from_numpy(np.array([b"Say hello"], dtype=np.object_))
    inputs[1].set_data_from_numpy(np.array([True]))
    inputs[2].set_data_from_numpy(np.array([b'{"max_tokens": 6, "temperature": 0}'], dtype=np.object_))
    responses: queue.Queue = queue.Queue()
    client.start_stream(callback=lambda result, error: responses.put((result, error)))
    try:
        client.async_stream_infer(LLM, inputs, request_id="kinds-1")
        pieces = []
        for result, error in until_final(responses, timeout=120):
            assert error is None, error
            pieces.append(result.as_numpy("text_output")[0])
    finally:
        client.stop_stream()
    assert len(pieces) > 1  # streamed: several responses, the final flag on the last


# -- ensembles are packages (no server) --------------------------------------------------------------------------


def _ensemble_spec(steps, config=PIPELINE_CONFIG) -> PackageSpec:
    return PackageSpec(None, PIPELINE_ID, "1.0.0", backend=Backend.ENSEMBLE, serving_mode=ServingMode.STANDALONE,
                       ensemble_config=config, ensemble_steps=tuple(steps))


STEPS = ((FEATURES_ID, "1.0.0"), (RANKER_ID, "1.0.0"), (RELEVANCE_ID, "1.0.0"))


def test_ensemble_package_names_its_steps_by_id_and_version(tmp_path):
    manifest = open_package(build_package(_ensemble_spec(STEPS), tmp_path / "p")).manifest
    assert manifest.model.backend is Backend.ENSEMBLE
    assert [(s.id, s.version) for s in manifest.ensemble.steps] == list(STEPS)
    assert manifest.weights_dir is None


def test_ensemble_package_refuses_steps_that_differ_from_its_config(tmp_path):
    with pytest.raises(PackageError, match=r"calls ranker, ranker-features, ranker-relevance but .* name ranker, "
                                           r"ranker-features: each step model needs its \(id, version\)"):
        build_package(_ensemble_spec(STEPS[:2]), tmp_path / "p")
    with pytest.raises(PackageError, match="ensemble.steps names a model twice"):
        build_package(_ensemble_spec(STEPS + (STEPS[0],)), tmp_path / "p")
    with pytest.raises(PackageError, match="--ensemble-config"):
        build_package(_ensemble_spec(()), tmp_path / "p")
    not_ensemble = tmp_path / "config.pbtxt"
    not_ensemble.write_text(PIPELINE_CONFIG.read_text().replace('platform: "ensemble"', 'backend: "python"'))
    with pytest.raises(PackageError, match='platform: "ensemble"'):
        build_package(_ensemble_spec(STEPS, not_ensemble), tmp_path / "p")


def test_startup_refuses_an_ensemble_whose_step_is_not_served(tmp_path, ranker_packages):
    manifests = [open_package(p).manifest for p in ranker_packages]
    assert resolve_ensembles(manifests) == {PIPELINE_ID: [f"{FEATURES_ID} 1.0.0", f"{RANKER_ID} 1.0.0",
                                                          f"{RELEVANCE_ID} 1.0.0"]}
    without_ranker = [m for m in manifests if m.model.id != RANKER_ID]
    with pytest.raises(RepositoryError, match=f"ensemble {PIPELINE_ID} 1.0.0: step model {RANKER_ID} 1.0.0 is not "
                                              "served on this server"):
        resolve_ensembles(without_ranker)
    other = build_package(_ensemble_spec([(i, "2.0.0" if i == RANKER_ID else v) for i, v in STEPS]), tmp_path / "e")
    with pytest.raises(RepositoryError, match=f"step model {RANKER_ID} is served at version 1.0.0, the ensemble "
                                              "names version 2.0.0"):
        resolve_ensembles([m for m in manifests if m.model.id != PIPELINE_ID] + [open_package(other).manifest])


def test_startup_fails_at_step_4_naming_the_missing_step(tmp_path, ranker_packages):
    from bench.local_server import start_standalone_server

    pipeline = open_package(ranker_packages[-1])
    assert pipeline.manifest.model.id == PIPELINE_ID
    with pytest.raises(AssertionError, match="exited with 14") as failed:
        start_standalone_server(pipeline.root, tmp_path / "work", companions=(ranker_packages[0],))
    assert f"step model {FEATURES_ID} 1.0.0 is not served on this server" in str(failed.value)


def test_ensemble_repository_entry_is_the_packages_config_under_its_id(tmp_path, ranker_packages):
    from google.protobuf import text_format
    from tritonclient.grpc import model_config_pb2 as mc

    from serving_image.triton.pins import load_pins
    from serving_image.triton.repository import generate_repository

    package = open_package(ranker_packages[-1])
    model_dir = generate_repository(package.manifest, package.root, tmp_path / "repo", load_pins().pinned)
    config = text_format.Parse((model_dir / "config.pbtxt").read_text(), mc.ModelConfig())
    assert (config.name, config.platform, config.backend) == (PIPELINE_ID, "ensemble", "")
    assert [s.model_name for s in config.ensemble_scheduling.step] == [FEATURES_ID, RANKER_ID, RELEVANCE_ID]
    assert dict(config.ensemble_scheduling.step[2].output_map) == {"relevance": "relevance", "relevant": "relevant"}
    assert (model_dir / "1").is_dir() and not any((model_dir / "1").iterdir())


def test_cli_packages_an_ensemble_and_refuses_a_step_without_version(tmp_path):
    import subprocess
    import sys
    from pathlib import Path

    cli = Path(sys.executable).parent / "llm-serving"
    common = ["package", "--backend", "ensemble", "--ensemble-config", str(PIPELINE_CONFIG), "--id", PIPELINE_ID,
              "--version", "1.0.0", "--serving-mode", "standalone"]
    steps = [arg for model_id, version in STEPS for arg in ("--step", f"{model_id}={version}")]
    done = subprocess.run([str(cli), *common, *steps, "--out", str(tmp_path / "p")], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    assert open_package(tmp_path / "p").manifest.ensemble.steps[1].id == RANKER_ID
    bad = subprocess.run([str(cli), *common, "--step", "ranker", "--out", str(tmp_path / "q")], capture_output=True,
                         text=True, timeout=120)
    assert bad.returncode == 2 and "--step 'ranker': expected MODEL_ID=VERSION" in bad.stderr


def test_manifest_refuses_ensemble_tables_in_the_wrong_place(tmp_path):
    from llm_serving.manifest import ManifestError, parse_manifest

    text = (build_package(_ensemble_spec(STEPS), tmp_path / "p") / "package.toml").read_text()
    assert parse_manifest(text).ensemble is not None
    with pytest.raises(ManifestError, match=r"an ensemble package needs an \[ensemble\] table"):
        parse_manifest(text.split("[ensemble]")[0] + "[files]" + text.split("[files]")[1])
    with pytest.raises(ManifestError, match=r"\[ensemble\] is only for ensemble packages"):
        parse_manifest(text.replace('backend = "ensemble"', 'backend = "python"').replace(
            "[ensemble]", "[python]\n\n[ensemble]"))
    with pytest.raises(ManifestError, match=r"ensemble.steps.0.version: required key is missing"):
        parse_manifest(text.replace(f'{{ id = "{FEATURES_ID}", version = "1.0.0" }}', f'{{ id = "{FEATURES_ID}" }}'))
