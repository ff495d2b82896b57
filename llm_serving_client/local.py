"""A stack-outputs document for a local server (`make up`, the tests' servers), asked from the server itself: every
model of its Triton repository (KServe gRPC's repository index and each model's configuration) with its kind, the
LLMs the OpenAI port lists, one local version each (the LLM at the version its server names, the one its batch worker
caches answers under), the routes a stack would render, and the batch block when the server runs the Batch API.
Production services read the document their deployment renders (discovery.load_outputs); this stands in for it where
no stack exists, so the same client code runs against `make up`.

`experiments` and `in_process` add what a stack would declare: an experiment's arms, the models marked in-process
with the packages' fingerprints.

Like the routes' hostnames, the batch block's endpoint and cache bucket are placeholders (a document's batch block
names an https endpoint and an S3 bucket; `make up` has a port and a directory): the local server's OpenAI URL is the
endpoint (LocalEndpoints), and `local_result_cache` reads the answers from the store the server and its worker keep
them in, `make up`'s by default (llm_serving/up_layout.py).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import httpx
import openai
import tritonclient.grpc as grpcclient

from llm_serving.batch_cache import ResultCache
from llm_serving.object_store import ObjectStoreError, open_object_store
from llm_serving.stack_outputs import StackOutputs, StackOutputsError
from llm_serving.up_layout import up_batch_store

LOCAL_VERSION = "local"
TASK_SUFFIXES = ("-embed", "-score")
DEMO_EXPERIMENT = "demo-temperature"  # what describe_local_server declares when asked for a demo experiment
# Never dialled nor read (module docstring): the endpoint is LocalEndpoints.openai, the cache local_result_cache's.
LOCAL_BATCH = {"endpoint": "https://batch.local.invalid/v1",
               "cache": {"bucket": "local-batch-store", "prefix": "", "region": "local"}}


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


def _served_llm(openai_url: str) -> tuple[str, str]:
    """(model, version) the OpenAI front-end serves, from its readiness answer (what the batch worker keys the
    result cache by: serving_image/batch/worker.py `_served_version`)."""
    if not openai_url.rstrip("/").endswith("/v1"):
        raise ValueError(f"{openai_url}: a local server's OpenAI base URL ends in /v1 (e.g. http://localhost:9000/v1)")
    ready = f"{openai_url.rstrip('/').removesuffix('/v1')}/health/ready"
    try:
        answer = httpx.get(ready, timeout=10)
    except httpx.HTTPError as exc:
        raise ValueError(f"{ready}: the local server does not answer ({exc})") from None
    if answer.status_code != 200:
        raise ValueError(f"{ready}: the local server is not ready (HTTP {answer.status_code}: {answer.text[:200]})")
    body = answer.json()
    return body["model"], body["version"]


def _runs_batch_api(client: openai.OpenAI) -> bool:
    try:
        client.batches.list(limit=1)
    except openai.NotFoundError:  # the server was started without a batch store (LLM_SERVING_BATCH_STORE)
        return False
    return True


def describe_local_server(openai_url: str, grpc_target: str, *, api_key: str | None = None,
                          in_process: Mapping[str, tuple[str, str]] | None = None,
                          demo_experiment_on: str | None = None) -> dict:
    """The document of the server at (openai_url, grpc_target): the LLM at the version its OpenAI front-end names,
    every other model at LOCAL_VERSION (Triton's own version numbers are not the packages'), and the batch block
    (LOCAL_BATCH) when the server runs the Batch API. `in_process`: model -> (its package's version, its I/O
    fingerprint), marked inProcess at that version; `demo_experiment_on`: an LLM to declare DEMO_EXPERIMENT on (arms
    `control` and `cool`, temperature 0, at 50% each)."""
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
        batch = _runs_batch_api(client)
    finally:
        client.close()
    served, served_version = _served_llm(openai_url)
    if served in models:
        models[served] = _route(served, models[served]["kind"], served_version)
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
    document = {"schemaVersion": 2, "stack": "local", "environment": "dev", "region": "local", "models": models,
                "experiments": experiments}
    if batch:
        document["batch"] = LOCAL_BATCH
    return document


def local_result_cache(outputs: StackOutputs, store: str | None = None) -> ResultCache:
    """The result cache of the local server `outputs` describes (describe_local_server), read from its batch store:
    `store` (a directory or s3:// URI, the server's LLM_SERVING_BATCH_STORE), default `make up`'s."""
    if outputs.batch is None:
        raise StackOutputsError(f"stack {outputs.stack}: the local server runs no Batch API (it runs one with "
                                f"LLM_SERVING_BATCH_STORE set, as make up does): there is no result cache to read")
    store = store or up_batch_store()
    try:
        return ResultCache(open_object_store(store))
    except ObjectStoreError as exc:
        raise StackOutputsError(f"the local server's batch store {store!r}: {exc}") from None
