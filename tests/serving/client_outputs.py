"""A stack-outputs document (schema version 2) for the client library's tests: the models the shared `openai_server`
serves (tests/serving/conftest.py), as a stack would render them, and two experiments. The endpoints are a stack's
(https, TLS); the remote tests point the client at the local server with `LocalEndpoints`."""

from __future__ import annotations

import copy

from llm_serving.repository import REPO_ROOT
from llm_serving.tensor_contract import io_fingerprint, pbtxt_io

LLM = "demo-tiny"
RANKER = "ranker"
PIPELINE = "ranker-pipeline"
FEATURES = "ranker-features"  # the pipeline's first step, a numpy-only Python model: marked inProcess here
FEATURES_SOURCE = REPO_ROOT / "examples" / "ranker" / "pipeline" / "features"
FEATURES_FINGERPRINT = io_fingerprint(*pbtxt_io((FEATURES_SOURCE / "config.pbtxt").read_text()))
DOMAIN = "llm.dev.internal.acme.example"


def _endpoints(host: str) -> dict[str, str]:
    return {"openai": f"https://{host}.{DOMAIN}/v1", "grpc": f"{host}.grpc.{DOMAIN}:443",
            "kserveHttp": f"https://{host}.{DOMAIN}"}


def _red_black(kind: str, model: str) -> dict:
    return {"kind": kind, "strategy": "red-black", "region": "us-east-1", "versions": ["1.0.0"],
            "activeVersion": "1.0.0", "routeWeights": {"1.0.0": 100}, "replicas": {"1.0.0": 1},
            "endpoints": _endpoints(model), "versionEndpoints": {}, "inProcess": None}


DOCUMENT = {
    "schemaVersion": 2,
    "stack": "dev-us-east-1",
    "environment": "dev",
    "region": "us-east-1",
    "models": {
        LLM: _red_black("vllm", LLM),
        RANKER: {"kind": "python", "strategy": "versioned", "region": "us-east-1", "versions": ["1.0.0"],
                 "activeVersion": "1.0.0", "routeWeights": {"1.0.0": 100}, "replicas": {"1.0.0": 1},
                 "endpoints": _endpoints("ranker-1-0-0"), "versionEndpoints": {"1.0.0": _endpoints("ranker-1-0-0")},
                 "inProcess": None},
        PIPELINE: _red_black("ensemble", PIPELINE),
        FEATURES: {**_red_black("python", FEATURES), "inProcess": {"versions": {"1.0.0": {
            "package": "s3://acme-llm-dev-us-east-1/models/model-cache/ranker-features/1.0.0/",
            "ioFingerprint": FEATURES_FINGERPRINT}}}},
    },
    "experiments": {
        "chat-temperature": {"unit": "user", "arms": [
            {"name": "control", "model": LLM, "version": None, "parameters": {}, "percent": 50},
            {"name": "cool", "model": LLM, "version": None, "parameters": {"temperature": 0.0}, "percent": 50}]},
        "ranking": {"unit": "request", "arms": [
            {"name": "booster", "model": RANKER, "version": "1.0.0", "parameters": {}, "percent": 50},
            {"name": "pipeline", "model": PIPELINE, "version": None, "parameters": {}, "percent": 50}]},
    },
}


def document() -> dict:
    return copy.deepcopy(DOCUMENT)
