"""Fixtures of the serving suite that several modules share.

`triton_standalone`: one real `tritonserver` (the local 2.51 from nvidia-pytriton) started by the startup procedure
on a `standalone` demo-tiny package (the stand-in vllm backend and its engine process), with the example
Python-backend package (examples/ticket_triage) served beside it, as the BLS example needs, and the demo ranker's
packages (examples/ranker: the XGBoost ranker, the pipeline's two Python steps and the pipeline, an ensemble; built by
dev_packages.demo, as `make up MODE=standalone` builds them), and the ranker's second I/O contract (the
same booster with the extra output `rank`, what the rehearsal's versioned rollout publishes as 1.1.0) under the id
`ranker-rank`, since one server serves one version of a model id. One per session: the KServe tests
(test_kserve_startup.py), the example's tests (test_triton_example.py) and the model-kind tests
(test_triton_model_kinds.py) share it, so the suite starts one Triton and one engine for all of them.

`openai_server`: one server of the `openai` topology (the real entrypoint: the startup procedure, the OpenAI front-end
with Triton embedded in its process, KServe on 8000/8001, the metrics proxy) for every module that talks to it:
test_openai_api, test_openai_embedded, test_constraints_e2e_api, test_startup, test_batch_api (its Batch API keeps its
files in `server.batch_store`, a directory store). See its docstring for what it holds
and how tests that need other limits get them. The tests that stop a server (SIGTERM, SIGINT) are in
test_server_lifecycle.py, on servers of their own.
"""

from __future__ import annotations

import importlib
import os
import sys
import types
from pathlib import Path

import pytest

from llm_serving.repository import REPO_ROOT
from serving_image.triton_stub.backends.vllm.engine_in_stub import ENGINE_NICE_ENV, STUB_LOG_LEVEL_ENV

# The engines of every server this suite starts run at niceness 10, as the rehearsal's pods' engines do and for the
# same reason (docs/rehearsal.md, "A new pod's model load and Triton's stub handshake"): the two xdist workers' servers
# share two cores, and vLLM's busy-polling engine core and worker, at the stubs' priority, starved a Python backend
# stub until it missed Triton's one-second health check. Triton then called the stub unhealthy and aborted (boost
# `lock_exception`, exit -6), taking the shared openai_server with it: seen in a fresh clone's make test, the demo
# ranker's stub, while the other worker ran the seeded-preemption test. A production pod's cores are its own.
os.environ.setdefault(ENGINE_NICE_ENV, "10")
# Their stubs log each request's way into the engine (DEBUG; production's default is INFO, without that line): the
# cancellation tests wait for it, so that the request is in the held engine before its client leaves.
os.environ.setdefault(STUB_LOG_LEVEL_ENV, "DEBUG")
EXAMPLE = REPO_ROOT / "examples" / "ticket_triage"
# float32: see docs/local-environment.md (this VM SIGILLs in vLLM's bf16 AMX attention kernel).
TRITON_ENGINE_ARGS = {"max_model_len": 2048, "kv_cache_memory_bytes": 128 * 1024 * 1024, "dtype": "float32"}


@pytest.fixture
def stub_models(monkeypatch):
    """The stand-in vllm backend's and the scoring model's modules, imported with a stand-in for
    triton_python_backend_utils (which exists only inside Triton's stub; removed again afterwards). Its responses
    keep what they were built with: `error`, and `outputs` (tensor name -> the numpy array)."""
    fake = types.ModuleType("triton_python_backend_utils")

    class TritonError:
        INVALID_ARG, UNAVAILABLE, INTERNAL = "INVALID_ARG-code", "UNAVAILABLE-code", "INTERNAL-code"

        def __init__(self, message, code):
            self.message, self.code = message, code

    fake.TritonError = TritonError
    fake.Tensor = lambda name, array: (name, array)
    fake.InferenceResponse = lambda error=None, output_tensors=None: types.SimpleNamespace(
        error=error, outputs=dict(output_tensors or ()))
    fake.TRITONSERVER_RESPONSE_COMPLETE_FINAL = 1
    monkeypatch.setitem(sys.modules, "triton_python_backend_utils", fake)
    names = ("serving_image.triton_stub.backends.vllm.model", "serving_image.triton_stub.scoring_model.model")
    for name in names:
        monkeypatch.delitem(sys.modules, name, raising=False)
    loaded = [importlib.import_module(name) for name in names]
    yield loaded
    for name in names:
        sys.modules.pop(name, None)


def build_example_package(out: Path) -> Path:
    from llm_serving.manifest import Backend, ServingMode
    from llm_serving.package import PackageSpec, build_package

    return build_package(PackageSpec(None, "ticket-triage", "1.0.0", backend=Backend.PYTHON,
                                     python_model=EXAMPLE / "model", config_pbtxt=EXAMPLE / "config.pbtxt",
                                     serving_mode=ServingMode.STANDALONE, python_dependencies=("numpy>=1.24",)),
                         out)


@pytest.fixture(scope="session")
def ranker_packages(tmp_path_factory) -> list[Path]:
    """The ranker (trained now, deterministically), its pipeline's steps and the pipeline (the ensemble, last)."""
    from dev_packages.demo import build_ranker_packages

    return build_ranker_packages(tmp_path_factory.mktemp("ranker"), version="1.0.0")


RANKER_RANK_ID = "ranker-rank"


@pytest.fixture(scope="session")
def ranker_rank_package(ranker_packages, tmp_path_factory) -> Path:
    """The ranker with its second I/O contract (dev_packages.demo.build_ranker(rank=True)), the same
    booster as ranker_packages' ranker, as RANKER_RANK_ID 1.1.0."""
    from dev_packages.demo import RANKER_ID, build_ranker
    from llm_serving.package import open_package

    weights = next(open_package(p) for p in ranker_packages if open_package(p).manifest.model.id == RANKER_ID) \
        .weights_path
    return build_ranker(tmp_path_factory.mktemp("ranker-rank") / RANKER_RANK_ID, "1.1.0", weights=weights, rank=True,
                        model_id=RANKER_RANK_ID)


RANKER_MISFIT_ID = "ranker-misfit"


@pytest.fixture(scope="session")
def ranker_misfit_package(tmp_path_factory) -> Path:
    """The rehearsal's candidate that serves errors (rehearsal/storage.py, defect "serves-errors"):
    the ranker whose model code reads a calibration file its package lacks, as RANKER_MISFIT_ID 1.0.1."""
    from rehearsal import storage

    model = {"id": RANKER_MISFIT_ID, "kind": "python"}
    return storage.build_version(model, "1.0.1", tmp_path_factory.mktemp("ranker-misfit"), defect="serves-errors")


@pytest.fixture(scope="session")
def triton_standalone(demo_model_dir, tmp_path_factory, ranker_packages, ranker_rank_package, ranker_misfit_package):
    from bench.local_server import start_standalone_server
    from llm_serving.manifest import ServingMode
    from llm_serving.package import PackageSpec, build_package

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


# -- the shared server of the `openai` topology -------------------------------------------------------------------

OPENAI_KEYS = ("test-key-1", "test-key-2")
OPENAI_KEY = OPENAI_KEYS[1]  # what the shared server's clients send
OPENAI_AUTH = {"Authorization": f"Bearer {OPENAI_KEY}"}
OPENAI_MAX_CONCURRENT = 80
OPENAI_BODY_CAP = 256 * 1024

# A vLLM general plugin (installed from the package's plugin wheel by startup step 2) that leaves a trace per process
# vLLM calls it in: the front-end's, the Python backend stub's (vLLM runs there) and vLLM's engine processes.
PLUGIN_SOURCE = """
import os, pathlib

def register():
    marker = os.environ.get("LLM_SERVING_TEST_PLUGIN_DIR")
    if marker:
        pathlib.Path(marker, f"loaded-{os.getpid()}").write_text("ok")
"""


@pytest.fixture(scope="session")
def openai_server(demo_model_dir, tmp_path_factory):
    """One `openai`-mode server for the session, started as a pod starts it.

    It holds every model kind on one embedded Triton: the demo LLM with every task (generation, its `-embed` pooling
    model, its `-score` scoring model), and as companions the demo ranker (XGBoost, Python backend), its pipeline's
    steps and the pipeline (an ensemble), named as a Deployment names them (pod_contract.ENV_COMPANION_PACKAGES). Its
    package carries a plugin wheel (PLUGIN_SOURCE; traces in `server.plugin_dir`) and the engine step gate's
    (tests/serving/step_gate.py, under `server.step_gate_root`), its metrics directory held a stale
    file before the start (`server.multiproc_dir`, emptied by step 3). Engines eager (tests/serving/engine_args.py).

    Limits, the same for every test: API keys OPENAI_KEYS (clients send OPENAI_KEY: `openai_client`, OPENAI_AUTH),
    OPENAI_MAX_CONCURRENT requests in flight, OPENAI_BODY_CAP bytes a body. Tests that need other limits do not
    change this server: a limit that is a property of the request (its key, its body, how many run at once) is
    exercised by sending such requests, and the tests that abandon or cancel requests wait until the engine let
    them go (its running count back to 0, the request's 499 record) before they end; a setting that needs another
    server (a drain delay, a stop) gets a server of its own (test_server_lifecycle.py). Tests read counters and logs
    as differences from what they saw before their own requests (another module may have run first)."""
    from bench.local_server import publish_demo, start_server
    from dev_packages.demo import build_ranker_packages
    from llm_serving import pod_contract as pc
    from llm_serving.manifest import ServingMode
    from tests.serving.engine_args import EAGER_ENGINE_ARGS
    from tests.serving.step_gate import GATE_ENV, write_step_gate_wheel
    from tests.serving.wheels import make_wheel, wheel_filename

    root = tmp_path_factory.mktemp("openai-server")
    plugin = root / wheel_filename("demo-plugin")
    plugin.write_bytes(make_wheel("demo-plugin", files={"demo_plugin.py": PLUGIN_SOURCE},
                                  entry_points={"vllm.general_plugins": {"demo_plugin": "demo_plugin:register"}}))
    package = publish_demo(demo_model_dir, root, tasks=("generate", "embed", "score"),
                           plugins=(plugin, write_step_gate_wheel(root)), engine_args=EAGER_ENGINE_ARGS)
    companions = build_ranker_packages(root / "ranker", version="1.0.0", serving_mode=ServingMode.OPENAI)
    (root / "plugin-trace").mkdir()
    (root / "step-gate").mkdir()
    (root / "prom").mkdir()
    (root / "prom" / "counter_999999.db").write_bytes(b"stale")  # must be emptied by step 3
    server = start_server(package, root / "server", extra_env={
        "LLM_SERVING_API_KEYS": ",".join(OPENAI_KEYS),
        "LLM_SERVING_MAX_BODY_BYTES": str(OPENAI_BODY_CAP),
        "LLM_SERVING_MAX_CONCURRENT_REQUESTS": str(OPENAI_MAX_CONCURRENT),
        "PROMETHEUS_MULTIPROC_DIR": str(root / "prom"),
        "LLM_SERVING_TEST_PLUGIN_DIR": str(root / "plugin-trace"),
        GATE_ENV: str(root / "step-gate"),  # engines step only when a test grants it, while it holds their gate
        "LLM_SERVING_BATCH_STORE": str(root / "batch-store"),  # the Batch API (test_batch_api.py)
        pc.ENV_COMPANION_PACKAGES: pc.COMPANION_SEPARATOR.join(str(p) for p in companions)})
    server.plugin_dir = root / "plugin-trace"
    server.step_gate_root = root / "step-gate"
    server.multiproc_dir = root / "prom"
    server.companions = companions  # the ranker's packages it serves (llm_serving_client's in-process tests)
    server.batch_store = root / "batch-store"
    try:
        yield server
        assert_stops_cleanly_on_sigterm(server)
    finally:
        server.kill()  # whatever is left of its group, however it ended (a server that died leaves its engines)


def assert_stops_cleanly_on_sigterm(server) -> None:
    """Stop a server as Kubernetes does (SIGTERM to the entrypoint alone) and require a clean stop: exit 0, every
    process it started gone (the stubs and vLLM's engine processes of every model), no traceback. The shared
    `openai_server` ends this way, so a clean stop is proved with several engines, companions and a plugin loaded;
    test_server_lifecycle.py proves the drain's order on a server of its own."""
    import signal

    import psutil

    assert server.proc.poll() is None, f"the server had exited {server.proc.returncode}:\n{server.log()[-3000:]}"
    children = psutil.Process(server.proc.pid).children(recursive=True)
    server.proc.send_signal(signal.SIGTERM)
    import subprocess

    try:
        code = server.proc.wait(timeout=180)
    except subprocess.TimeoutExpired:
        server.kill()
        raise
    log = server.log()
    assert code == 0, f"the server exited {code} on SIGTERM:\n{log[-3000:]}"
    _, alive = psutil.wait_procs(children, timeout=60)
    for process in alive:
        process.kill()
    assert alive == [], f"left running after SIGTERM: {[p.pid for p in alive]}"
    assert "Traceback" not in log, log[-3000:]


@pytest.fixture(scope="session")
def openai_client(openai_server):
    """The official `openai` client on the shared server, with its key; no retries (a failure shows as it is)."""
    import openai

    return openai.OpenAI(base_url=f"{openai_server.url}/v1", api_key=OPENAI_KEY, max_retries=0, timeout=120)
