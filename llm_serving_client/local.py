"""A stack-outputs document for a local server (`make up`, the tests' servers), asked from the server itself: every
model of its Triton repository (KServe gRPC's repository index and each model's configuration) with its kind, the
LLMs the OpenAI port lists, one local version each, and the routes a stack would render. Production services read
the document their deployment renders (discovery.load_outputs); this stands in for it where no stack exists, so the
same client code runs against `make up`.

`experiments` and `in_process` add what a stack would declare: an experiment's arms, the models marked in-process
with the packages' fingerprints.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import openai
import tritonclient.grpc as grpcclient

LOCAL_VERSION = "local"
TASK_SUFFIXES = ("-embed", "-score")
DEMO_EXPERIMENT = "demo-temperature"  # what describe_local_server declares when asked for a demo experiment


def _kind(config: Mapping[str, Any]) -> str | None:
    if config.get("platform") == "ensemble":
        return "ensemble"
    return {"python": "python", "vllm": "vllm"}.get(config.get("backend", ""))


def _route(name: str, kind: str, version: str = LOCAL_VERSION) -> dict[str, Any]:
    host = f"{name}.local.invalid"  # never dialled: LocalEndpoints sends every route to the local server
    return {"kind": kind, "strategy": "red-black", "region": "local", "versions": [version],
            "activeVersion": version, "routeWeights": {version: 100}, "replicas": {version: 1},
            "endpoints": {"openai": f"https://{host}/v1", "grpc": f"{host}:443", "kserveHttp": f"https://{host}"},
            "versionEndpoints": {}, "inProcess": None}


def describe_local_server(openai_url: str, grpc_target: str, *, api_key: str | None = None,
                          in_process: Mapping[str, tuple[str, str]] | None = None,
                          demo_experiment_on: str | None = None) -> dict:
    """The document of the server at (openai_url, grpc_target), each model at LOCAL_VERSION (Triton's own version
    numbers are not the packages'). `in_process`: model -> (its package's version, its I/O fingerprint), marked
    inProcess at that version; `demo_experiment_on`: an LLM to declare DEMO_EXPERIMENT on (arms `control` and
    `cool`, temperature 0, at 50% each)."""
    grpc = grpcclient.InferenceServerClient(grpc_target)
    try:
        index = grpc.get_model_repository_index(as_json=True).get("models", [])
        models: dict[str, dict] = {}
        for entry in index:
            name = entry["name"]
            kind = _kind(grpc.get_model_config(name, as_json=True)["config"])
            if kind is not None:
                models[name] = _route(name, kind)
    finally:
        grpc.close()
    client = openai.OpenAI(base_url=openai_url, api_key=api_key or "none", max_retries=0)
    try:
        openai_models = {m.id for m in client.models.list()}
    finally:
        client.close()
    # An LLM's task models (its pooling and scoring models, `<llm>-embed` and `<llm>-score`: the names
    # serving_image/triton/models.py gives them) answer through the LLM's OpenAI endpoints (/v1/embeddings,
    # /v1/score), and a vllm-backend model the OpenAI port does not list is not callable by its own name: left out.
    tasks = {f"{llm}{suffix}" for llm in openai_models for suffix in TASK_SUFFIXES}
    models = {n: m for n, m in models.items() if n not in tasks and (m["kind"] != "vllm" or n in openai_models)}
    for name, (version, fingerprint) in (in_process or {}).items():
        if name not in models:
            raise ValueError(f"model {name!r} is not served by the local server (served: {sorted(models)})")
        models[name] = {**_route(name, models[name]["kind"], version), "inProcess": {"versions": {version: {
            "package": f"s3://local-model-cache/model-cache/{name}/{version}/", "ioFingerprint": fingerprint}}}}
    experiments = {}
    if demo_experiment_on is not None:
        if models.get(demo_experiment_on, {}).get("kind") != "vllm":
            raise ValueError(f"model {demo_experiment_on!r} is not an LLM of the local server")
        experiments[DEMO_EXPERIMENT] = {"unit": "user", "arms": [
            {"name": "control", "model": demo_experiment_on, "version": None, "parameters": {}, "percent": 50},
            {"name": "cool", "model": demo_experiment_on, "version": None, "parameters": {"temperature": 0.0},
             "percent": 50}]}
    return {"schemaVersion": 2, "stack": "local", "environment": "dev", "region": "local", "models": models,
            "experiments": experiments}
