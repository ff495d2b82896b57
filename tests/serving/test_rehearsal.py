"""The rehearsal's pieces (rehearsal/, `make rehearse`), each small and fast: nothing here needs
root, a namespace or a vLLM engine. The whole rehearsal runs in `make rehearse` (docs/rehearsal.md)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import boto3
import pytest

from llm_serving import dockerfile
from llm_serving import pod_contract as pc
from llm_serving.ports import free_port
from llm_serving.repository import REPO_ROOT
from rehearsal import (
    container,
    gateway_retry,
    gateway_routes,
    haproxy_config,
    haproxy_process,
    kubelet,
    observe,
    podspec,
    render,
    storage,
    substitutions,
    traffic,
)
from rehearsal.kubelet import PodRunner, ProbeState, backoff_s
from rehearsal.podspec import PodPlan, Probe
from rehearsal.services import Endpoint, ServiceProxy
from rehearsal.tls import CertificateAuthority

IMAGE = dockerfile.read(REPO_ROOT / "serving_image" / "Dockerfile")


@pytest.fixture(scope="module")
def dev() -> render.Rendered:
    """The dev stack as Pulumi would create it (the program under the mock runtime, in .venv-infra)."""
    return render.render("dev-us-east-1")


def _model(dep: dict) -> str:
    return dep["inputs"]["metadata"]["labels"]["app.kubernetes.io/name"]


def _plans(rendered: render.Rendered, tmp_path: Path, model: str | None = None) -> list[PodPlan]:
    """The pods' plans of every model Deployment, or of `model`'s."""
    def scratch(pod: str, volume: str) -> Path:
        return tmp_path / pod / volume

    plans = []
    for dep in rendered.model_deployments():
        if model is None or _model(dep) == model:
            plans += podspec.pod_plans(dep, IMAGE, {"model-cache": str(tmp_path / "fsx")}, scratch,
                                       secret_sources={pc.API_KEYS_SECRET: str(tmp_path / "api-keys")})
    return plans


def _chat_plan(rendered: render.Rendered, tmp_path: Path) -> PodPlan:
    """The first pod of the dev stack's LLM (chat-small, two replicas)."""
    return _plans(rendered, tmp_path, "chat-small")[0]


def _node_groups(rendered: render.Rendered) -> list[dict]:
    """The node groups as the rehearsal reports placement against them (run.py)."""
    groups = [{"name": g["name"], **g["inputs"]} for g in rendered.of_type(render.NODE_GROUP)]
    for g in groups:
        g["taints"] = [{**t, "effect": "NoSchedule"} for t in g.get("taints") or []]
    return groups


# -- from the rendered Deployment to the pod's process ---------------------------------------------------------


def test_the_dev_stack_holds_what_the_rollout_scenarios_roll(dev, tmp_path):
    """A red-black LLM at two replicas, a versioned CPU model (the demo ranker) at one and a red-black CPU model (the
    same ranker as `scorer`, for the candidate that serves errors) at one, each pod a plan."""
    models = {m["id"]: m for m in dev.models}
    assert (models["chat-small"]["strategy"], models["chat-small"]["replicas"]) == ("red-black", 2)
    scorer = models["scorer"]
    assert (scorer["kind"], scorer["strategy"], scorer["replicas"], scorer["active"]) == ("python", "red-black", 1,
                                                                                          "1.0.0")
    ranker = models["ranker"]
    assert (ranker["kind"], ranker["strategy"], ranker["replicas"], "gpu" in ranker) == ("python", "versioned", 1,
                                                                                          False)
    assert [v["version"] for v in ranker["versions"]] == ["1.0.0"]
    assert sorted(p.name for p in _plans(dev, tmp_path)) == [
        "chat-small-1-0-0-0", "chat-small-1-0-0-1", "ranker-1-0-0-0", "scorer-1-0-0-0"]
    (plan,) = _plans(dev, tmp_path, "ranker")
    line = podspec.placement_report(plan, _node_groups(dev))
    assert "would land on eks-cpu-cpu (c7i.xlarge)" in line and "GPU" not in line


def test_the_pod_runs_the_images_entrypoint_with_exactly_the_rendered_env(dev, tmp_path):
    plan = _chat_plan(dev, tmp_path)
    (dep,) = [d for d in dev.model_deployments() if _model(d) == "chat-small"]
    container = dep["inputs"]["spec"]["template"]["spec"]["containers"][0]
    rendered = {e["name"]: e["value"] for e in container["env"]}
    assert plan.argv == list(IMAGE.entrypoint) and plan.argv[0] == pc.NVIDIA_ENTRYPOINT
    assert plan.rendered_env == rendered
    for name, value in rendered.items():  # the rendered env, unchanged, over everything else
        assert plan.env[name] == value
    # a substitution replaces an image value, never a rendered one
    assert not set(substitutions.IMAGE_ENV_OVERRIDES) & set(rendered)
    assert plan.env[pc.ENV_RUNTIME] == "local" and IMAGE.env[pc.ENV_RUNTIME] == "triton"
    for name, value in IMAGE.env.items():
        if name not in rendered and name not in substitutions.IMAGE_ENV_OVERRIDES:
            assert plan.env[name] == value
    assert (plan.uid, plan.gid, plan.groups) == (pc.RUN_AS_UID, pc.RUN_AS_UID, [pc.RUN_AS_UID])
    assert plan.read_only_root and plan.no_new_privs
    assert plan.workdir == IMAGE.workdir


def test_the_pods_volumes_are_bound_at_their_mount_paths(dev, tmp_path):
    plan = _chat_plan(dev, tmp_path)
    mounts = {m.target: m for m in plan.mounts}
    cache = mounts[pc.MODEL_CACHE_MOUNT]
    assert (cache.kind, cache.source, cache.read_only) == ("bind", str(tmp_path / "fsx"), True)
    assert mounts[pc.SHM_MOUNT].kind == "tmpfs" and mounts[pc.SHM_MOUNT].size == "16g"
    for target in (pc.SCRATCH_MOUNT, pc.RUN_MOUNT, pc.CACHE_MOUNT):
        assert mounts[target].kind == "bind" and not mounts[target].read_only
        assert mounts[target].source == str(tmp_path / plan.name / mounts[target].volume)
    assert pc.NVIDIA_ENTRYPOINT not in mounts  # the image holds it
    # the package the env names lies below the model cache's mount: the pod reads it in place from "FSx"
    assert plan.env[pc.ENV_PACKAGE].startswith(pc.MODEL_CACHE_MOUNT + "/")


def test_probes_and_termination_are_the_rendered_ones(dev, tmp_path):
    plan = _chat_plan(dev, tmp_path)
    startup = plan.probes["startup"]
    assert (startup.path, startup.port, startup.period_s, startup.failure_threshold) == (
        pc.READY_PATH, pc.PORTS[pc.KSERVE_HTTP_PORT_NAME], 10, 30)  # loadTimeSeconds 300 / period 10
    assert plan.probes["liveness"].path == pc.LIVE_PATH
    assert podspec.startup_budget_s(startup) == 300
    assert (plan.prestop_sleep_s, plan.grace_period_s) == (15, 120)


def test_placement_is_reported_against_the_node_group(dev, tmp_path):
    plan = _chat_plan(dev, tmp_path)
    line = podspec.placement_report(plan, _node_groups(dev))
    assert "would land on eks-gpu-l4 (g6.2xlarge, g6.4xlarge);" in line
    assert "1 GPU(s) requested, none can be granted on this machine" in line
    assert "no node group" in podspec.placement_report(plan, [{"name": "system", "labels": {}}])


def _deployment(**container) -> dict:
    return {"inputs": {"metadata": {"name": "m", "namespace": "ns"}, "spec": {"replicas": 2, "template": {
        "metadata": {"labels": {"a": "b"}},
        "spec": {"securityContext": {"runAsUser": 5}, "containers": [{"name": "c", **container}],
                 "volumes": [{"name": "hostpath", "hostPath": {"path": "/"}}]}}}}}


@pytest.mark.parametrize(("container", "message"), [
    ({"env": [{"name": "X", "valueFrom": {"secretKeyRef": {}}}]}, "env 'X' comes from ['valueFrom']"),
    ({"volumeMounts": [{"name": "nope", "mountPath": "/x"}]}, "volumeMount 'nope' names no volume"),
    ({"volumeMounts": [{"name": "hostpath", "mountPath": "/x"}]}, "volume 'hostpath' is of a kind"),
    ({"readinessProbe": {"exec": {"command": ["true"]}}}, "only httpGet probes are rehearsed"),
    ({"readinessProbe": {"httpGet": {"path": "/", "port": "web"}}}, "port 'web' is neither a number nor one of"),
])
def test_what_the_rehearsal_cannot_run_is_named(container, message, tmp_path):
    with pytest.raises(podspec.PodSpecError, match=message.replace("[", r"\[").replace("]", r"\]")):
        podspec.pod_plans(_deployment(**container), IMAGE, {}, lambda p, v: tmp_path)


def test_one_plan_per_replica(tmp_path):
    plans = podspec.pod_plans(_deployment(), IMAGE, {}, lambda p, v: tmp_path)
    assert [p.name for p in plans] == ["m-0", "m-1"] and plans[0].uid == 5


def test_substitutions_are_listed_in_one_module():
    listed = substitutions.substitutions()
    text = "\n".join(f"{s.what} {s.here}" for s in listed)
    for needle in ("stand-in bases", "compat.toml [stand_in]", pc.ENV_RUNTIME, "GPU", "FSx", "moto", "--cpus"):
        assert needle in text or needle in "\n".join(s.why for s in listed)


def test_a_pods_container_is_run_as_its_plan_says(dev, tmp_path):
    """The seam plan -> `podman run`: the image, the entrypoint and args, the pod's namespace, user and groups, the
    read-only root without podman's own tmpfs, no-new-privileges, every volume at its mountPath, the env, and the
    limits capped at this machine's."""
    plan = _chat_plan(dev, tmp_path)
    argv = container.run_argv(plan, "localhost/llm-serving:stand-in-x", "rehearsal-pod-0", "rh1-p0")
    image_at = argv.index("localhost/llm-serving:stand-in-x")
    assert argv[image_at + 1:] == plan.argv[1:]
    options = argv[:image_at]

    def value(flag: str) -> list[str]:
        return [options[i + 1] for i, word in enumerate(options) if word == flag]

    assert value("--entrypoint") == [json.dumps(plan.argv[:1])]
    assert value("--network") == ["ns:/run/netns/rh1-p0"]
    assert value("--user") == [f"{pc.RUN_AS_UID}:{pc.RUN_AS_UID}"] and value("--group-add") == [str(pc.RUN_AS_UID)]
    assert "--read-only" in options and "--read-only-tmpfs=false" in options
    assert value("--security-opt") == ["no-new-privileges"]
    mounts = value("--mount")
    assert f"type=bind,source={tmp_path / 'fsx'},destination={pc.MODEL_CACHE_MOUNT},ro=true" in mounts
    assert value("--shm-size") == ["16g"]  # the memory-backed emptyDir at /dev/shm: podman's own, sized
    assert len(mounts) == len(plan.mounts) - 1
    assert sorted(value("--env")) == sorted(f"{k}={v}" for k, v in plan.env.items())
    assert argv[:5] == ["podman", "--runtime", "runc", "--cgroup-manager", "cgroupfs"]
    # the rendered limits, each capped at this machine's
    plan.resources = {"limits": {"cpu": "500m", "memory": "64Ti"}}
    assert container.limits_argv(plan) == ["--cpus", "0.5", "--memory", str(container.MACHINE_MEMORY_BYTES)]
    plan.resources = {"limits": {"cpu": "64", "memory": "1Gi"}}
    assert container.limits_argv(plan) == ["--cpus", f"{container.MACHINE_CPUS:g}", "--memory", str(2**30)]


def test_kubernetes_quantities_are_read_and_a_bad_one_is_named():
    assert container.quantity("1500m", "x") == 1.5 and container.quantity("2Gi", "x") == 2 * 2**30
    assert container.quantity(4, "x") == 4
    with pytest.raises(container.ContainerSpecError, match="pod limits.cpu: '1.5 cores' is not a Kubernetes"):
        container.quantity("1.5 cores", "pod limits.cpu")


# -- kubelet ---------------------------------------------------------------------------------------------------


def test_back_off_doubles_from_ten_seconds_up_to_five_minutes():
    assert [backoff_s(n) for n in range(8)] == [0, 10, 20, 40, 80, 160, 300, 300]


def test_probe_thresholds():
    probe = Probe("readiness", "/", 1, 1, failure_threshold=3, timeout_s=1, success_threshold=2)
    state = ProbeState(probe)
    assert [state.record(ok) for ok in (True, True, True, False, False, False, False, True, True)] == [
        None, "pass", None, None, None, "fail", None, None, "pass"]
    live = ProbeState(Probe("liveness", "/", 1, 1, failure_threshold=2, timeout_s=1), passing=True)
    assert [live.record(ok) for ok in (False, True, False, False)] == [None, None, None, "fail"]


_SERVER = textwrap.dedent('''
    import http.server, os, signal, sys, time
    delay, mode = float(sys.argv[2]), sys.argv[3]
    gate = sys.argv[4] if len(sys.argv) > 4 else None  # Ready only once this file exists (the test opens it)
    started = time.monotonic()
    if mode == "crash":
        sys.exit(3)
    if mode == "ignore-term":
        signal.signal(signal.SIGTERM, lambda *a: print("SIGTERM ignored", flush=True))
    else:
        signal.signal(signal.SIGTERM, lambda *a: (print("SIGTERM: bye", flush=True), sys.exit(0)))
    class H(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            ok = os.path.exists(gate) if gate else time.monotonic() - started > delay
            if not ok:
                print("answered 503", flush=True)
            self.send_response(200 if ok else 503)
            self.end_headers()
        def log_message(self, *a):
            pass
    http.server.HTTPServer(("127.0.0.1", int(sys.argv[1])), H).serve_forever()
''')


def _plan(port: int, mode: str, delay: float = 0.5, grace: float = 2, prestop: float = 0.3,
          gate: Path | None = None) -> PodPlan:
    probe = dict(port=port, period_s=0.1, timeout_s=2)
    return PodPlan(
        name=f"pod-{mode}", deployment="d", namespace="ns", labels={"app": "x"},
        argv=[sys.executable, "-c", _SERVER, str(port), str(delay), mode, *([str(gate)] if gate else [])],
        env={}, rendered_env={}, mounts=[],
        uid=0, gid=0, groups=[], read_only_root=False, no_new_privs=False, workdir="/", ports={"http": port},
        probes={"startup": Probe("startup", "/", failure_threshold=600, **probe),  # 60 s: a loaded machine
                "readiness": Probe("readiness", "/", failure_threshold=2, **probe),
                "liveness": Probe("liveness", "/", failure_threshold=50, **probe)},
        grace_period_s=grace, prestop_sleep_s=prestop)


class _Process(subprocess.Popen):
    """A plain process as the kubelet's container (the rehearsal's is a podman container: container.py)."""

    def kill_all(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.pid, signal.SIGKILL)
        self.wait(timeout=10)


def _launch(plan: PodPlan, log: Path) -> _Process:
    with open(log, "w") as out:
        return _Process(plan.argv, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)


async def _until(predicate, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.05)


async def test_a_pod_is_ready_only_by_its_probes_and_terminates_with_sigterm(tmp_path):
    gate = tmp_path / "ready"
    runner = PodRunner(_plan(free_port(), "ok", gate=gate), "127.0.0.1", _launch, tmp_path)
    task = asyncio.create_task(runner.run())
    log = tmp_path / f"{runner.plan.name}.0.log"  # the first container's log
    await _until(lambda: log.is_file() and "answered 503" in log.read_text())  # the probes reach the server
    assert not runner.status.ready and runner.status.phase in ("Starting", "Running")  # answering 503: not Ready
    opened = time.monotonic()
    gate.touch()
    await _until(lambda: runner.status.ready)
    assert runner.status.ready_after_s >= opened - runner.status.created and runner.status.restarts == 0
    await runner.stop()
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)  # its probe loops end with it
    events = " | ".join(runner.status.events)
    assert "preStop: sleep" in events and "SIGTERM" in events and "SIGKILL" not in events
    assert runner.process.returncode == 0 and runner.status.phase == "Terminated"


async def test_cancelling_a_pod_runner_ends_its_probe_loops(tmp_path):
    """A runner cancelled while its container serves (what the rehearsal's interrupt and a test's end do) leaves no
    probe loop behind: one that outlived it probed the dead port forever and hung the event loop's teardown."""
    runner = PodRunner(_plan(free_port(), "ok", delay=0), "127.0.0.1", _launch, tmp_path)
    task = asyncio.create_task(runner.run())
    try:
        await _until(lambda: runner.status.ready)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        for _ in range(100):  # the cancelled probe tasks finish within a few loop iterations
            left = asyncio.all_tasks() - {asyncio.current_task()}
            if not left:
                break
            await asyncio.sleep(0)
        assert not left, left
    finally:
        runner.kill_now()


async def test_a_crashing_container_is_restarted_with_back_off_and_reported(tmp_path):
    waits = []
    runner = PodRunner(_plan(free_port(), "crash"), "127.0.0.1", _launch, tmp_path,
                       backoff=lambda n: waits.append(n) or (0.05 * n))
    task = asyncio.create_task(runner.run())
    await _until(lambda: runner.status.restarts >= 3)
    await runner.stop(fast=True)
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)  # its probe loops end with it
    assert waits[:4] == [0, 1, 2, 3] and not runner.status.ready
    assert runner.status.last_cause == "exited with status 3"


async def test_a_container_that_ignores_sigterm_is_killed_after_the_grace_period(tmp_path):
    runner = PodRunner(_plan(free_port(), "ignore-term", delay=0, grace=1.0, prestop=0.2), "127.0.0.1", _launch,
                       tmp_path)
    task = asyncio.create_task(runner.run())
    await _until(lambda: runner.status.ready)
    started = time.monotonic()
    await runner.stop()
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)  # its probe loops end with it
    assert time.monotonic() - started >= 1.0  # the grace period counts the preStop hook
    assert "SIGKILL after the 1s grace period" in " | ".join(runner.status.events)
    assert runner.process.returncode == -9


async def test_a_probe_against_nothing_fails_with_the_cause():
    ok, detail = await kubelet.http_probe("127.0.0.1", Probe("readiness", "/", free_port(), 1, 1, 0.5))
    assert not ok and detail.startswith("connect 127.0.0.1:")


# -- Services --------------------------------------------------------------------------------------------------


async def test_a_service_forwards_to_ready_endpoints_only(tmp_path):
    port = free_port()
    server = await asyncio.start_server(lambda r, w: (w.write(b"pong"), w.close()), "127.0.0.1", port)
    ready: list[Endpoint] = []
    proxy = ServiceProxy("svc", "127.0.0.1", [{"name": "http", "port": free_port(), "targetPort": "http"}],
                         lambda: ready)
    await proxy.start()
    listen = proxy.ports[0]["port"]
    reader, writer = await asyncio.open_connection("127.0.0.1", listen)
    assert await reader.read() == b"" and proxy.refused == 1  # no Ready pod: no endpoint
    writer.close()
    ready.append(Endpoint("p", "127.0.0.1", {"http": port}))
    reader, writer = await asyncio.open_connection("127.0.0.1", listen)
    assert await reader.read() == b"pong" and proxy.connections == 1
    writer.close()
    await proxy.close()
    server.close()


# -- observability ---------------------------------------------------------------------------------------------


def test_the_podmonitor_becomes_the_operators_scrape_job(dev, tmp_path):
    (pm,) = dev.of_type(render.POD_MONITOR)
    (job,) = observe.scrape_config(pm["inputs"], tmp_path / "targets.json")
    keeps = [r for r in job["relabel_configs"] if r["action"] == "keep"]
    assert {"source_labels": ["__meta_kubernetes_pod_container_port_name"], "action": "keep",
            "regex": pc.METRICS_PORT_NAME} in keeps
    assert any(r["source_labels"][0] == "__meta_kubernetes_pod_label_app_kubernetes_io_component" for r in keeps)
    rendered = pm["inputs"]["spec"]["podMetricsEndpoints"][0]["relabelings"]
    assert job["relabel_configs"][-len(rendered):] == [observe.relabeling(r) for r in rendered]
    assert job["metrics_path"] == pc.METRICS_PATH
    prom = observe.Prometheus(tmp_path / "prom", 9090)
    config = prom.write_config([job], observe.rule_file([r["inputs"] for r in
                                                         dev.of_type(render.PROMETHEUS_RULE)]))
    promtool = shutil.which("promtool")
    assert promtool, "promtool (Debian's prometheus package) is installed by make serving-env"
    result = subprocess.run([promtool, "check", "config", str(config)], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


def test_pod_targets_carry_kubernetes_discovery_labels():
    (metrics, openai) = observe.pod_targets("p-0", "ns", "10.0.0.2", {"app.kubernetes.io/name": "m"},
                                            {"metrics": 8002, "openai": 9000}, ready=True)
    assert metrics["targets"] == ["10.0.0.2:8002"]
    assert metrics["labels"]["__meta_kubernetes_pod_label_app_kubernetes_io_name"] == "m"
    assert metrics["labels"]["__meta_kubernetes_pod_container_port_name"] == "metrics"
    with pytest.raises(ValueError, match="relabeling key 'bogus'"):
        observe.relabeling({"bogus": 1})


# -- the store and FSx -----------------------------------------------------------------------------------------


def test_fsx_presents_the_associations_objects_at_its_path(tmp_path):
    from moto.server import ThreadedMotoServer

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    try:
        host, port = server.get_host_and_port()
        store = storage.S3Server(f"http://{host}:{port}", server)
        s3 = store.client()
        s3.create_bucket(Bucket="models-b")
        for key in ("models/model-cache/m/1/package.toml", "models/model-cache/m/1/weights/w.bin",
                    "models/packages/m/1.tar.gz", "other/x"):
            s3.put_object(Bucket="models-b", Key=key, Body=key.encode())
        count = storage.fsx_import(store, "s3://models-b/models/", "/models", tmp_path / "fsx")
        assert count == 3
        assert (tmp_path / "fsx" / "models" / "model-cache" / "m" / "1" / "weights" / "w.bin").read_text() == \
            "models/model-cache/m/1/weights/w.bin"
        assert not (tmp_path / "fsx" / "other").exists()
        assert oct((tmp_path / "fsx" / "models").stat().st_mode & 0o777) == "0o755"
        with pytest.raises(storage.StorageError, match="is not an s3:// URI"):
            storage.fsx_import(store, "/models", "/models", tmp_path / "x")
        assert isinstance(boto3.__version__, str)
    finally:
        server.stop()


def _fake_llm(tmp_path: Path) -> Path:
    """A directory the packager takes for a Hugging Face model (the vLLM package's I/O does not depend on it)."""
    model = tmp_path / "hf"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"model_type": "llama"}))
    (model / "model.safetensors").write_bytes(b"\0" * 64)
    return model


def _entry(model_id: str, version: str, fingerprint: str) -> dict:
    return {"version": version, "ioFingerprint": fingerprint,
            "package": pc.package_uri("b", "models/", model_id, version)}


def test_the_package_builder_is_chosen_by_the_models_kind_and_version(dev, tmp_path):
    """An LLM from the demo LLM; a Python-backend model from the demo ranker, its 1.1.0 with the second I/O contract
    (one more output, the same inputs); the dev stack's packages are built with the stack's fingerprints, and a
    version the stack does not list yet is built the same way (what a rollout publishes before it starts)."""
    from llm_serving.package import open_package
    from llm_serving.tensor_contract import VLLM_IO_FINGERPRINT, pbtxt_io

    models = {m["id"]: m for m in dev.models}
    chat, ranker = models["chat-small"], models["ranker"]
    assert storage.package_source(chat, "1.1.0") == "the demo LLM (a vLLM package)"
    assert storage.package_source(ranker, "1.0.0") == "the demo ranker (features -> score)"
    assert "second I/O contract" in storage.package_source(ranker, "1.1.0")
    with pytest.raises(storage.StorageError, match="ranker-pipeline 2.0.0: the rehearsal packages .* is kind ensemble"):
        storage.package_source({"id": "ranker-pipeline", "kind": "ensemble"}, "2.0.0")

    out, demo = tmp_path / "packages", _fake_llm(tmp_path)
    built = storage.package_versions(dev.models, demo, out)  # the stack's fingerprints match
    assert sorted(built) == sorted(v["package"] for m in dev.models for v in m["versions"])
    manifests = {uri: open_package(path, tmp_path / "verify").manifest for uri, path in built.items()}
    by_id = {m.model.id: m for m in manifests.values()}
    assert (by_id["chat-small"].model.backend, by_id["chat-small"].model.io_fingerprint) == ("vllm",
                                                                                             VLLM_IO_FINGERPRINT)
    assert (by_id["ranker"].model.backend, by_id["ranker"].model.version) == ("python", "1.0.0")

    newer = open_package(storage.build_version(ranker, "1.1.0", out), tmp_path / "verify").manifest
    assert (newer.model.id, newer.model.version) == ("ranker", "1.1.0")
    assert newer.model.io_fingerprint != by_id["ranker"].model.io_fingerprint
    unpacked = tmp_path / "verify" / "ranker-1.1.0"
    inputs, outputs = pbtxt_io((unpacked / newer.python.config_pbtxt).read_text())
    old_inputs, old_outputs = pbtxt_io((tmp_path / "verify" / "ranker-1.0.0" / "python" / "config.pbtxt").read_text())
    assert inputs == old_inputs  # an old-format request is one of the new version's too
    assert [t.name for t in outputs] == [t.name for t in old_outputs] + ["rank"]
    # the same booster: one training per package directory
    assert (unpacked / "weights" / "ranker.json").read_bytes() == \
        (tmp_path / "verify" / "ranker-1.0.0" / "weights" / "ranker.json").read_bytes()
    llm = open_package(storage.build_version(chat, "1.1.0", out, demo_model=demo),
                       tmp_path / "verify").manifest
    assert (llm.model.id, llm.model.version, llm.model.io_fingerprint) == ("chat-small", "1.1.0", VLLM_IO_FINGERPRINT)
    with pytest.raises(storage.StorageError, match="chat-small 1.1.0: an LLM .* from the demo LLM; none given"):
        storage.build_version(chat, "1.1.0", out)


def test_the_stacks_fingerprint_must_be_the_packages(tmp_path):
    """A stack whose ioFingerprint is not the one of the package the rehearsal builds for that (model, version) is
    refused, naming the model, the version, both fingerprints and what was built."""
    zeros = "sha256:" + "0" * 64
    models = [{"id": "m", "kind": "vllm", "versions": [_entry("m", "1", zeros)]}]
    with pytest.raises(storage.StorageError, match=r"m 1: the stack declares ioFingerprint sha256:0+, but the package "
                                                   r"the rehearsal builds for m 1 from the demo LLM \(a vLLM package\) "
                                                   r"has sha256:[0-9a-f]{64}"):
        storage.package_versions(models, _fake_llm(tmp_path), tmp_path / "out")
    # the ranker's 1.1.0 declared with 1.0.0's fingerprint (the plain ranker's): its I/O has `rank` too
    plain = "sha256:774af0a9332f6e734a8577fb021fdb3399a95fcfa46caa044fb6e94474c7af50"
    models = [{"id": "ranker", "kind": "python", "versions": [_entry("ranker", "1.0.0", plain),
                                                              _entry("ranker", "1.1.0", plain)]}]
    with pytest.raises(storage.StorageError, match=r"ranker 1.1.0: the stack declares ioFingerprint sha256:774af0a9.*"
                                                   r"from the demo ranker with its second I/O contract"):
        storage.package_versions(models, None, tmp_path / "ranker")
    models = [{"id": "ranker", "kind": "python", "versions": [_entry("other", "1.0.0", plain)]}]
    with pytest.raises(storage.StorageError, match="ranker 1.0.0: the package URI .* names another model"):
        storage.package_versions(models, None, tmp_path / "ranker")


def test_made_up_inputs_follow_the_models_declared_tensors():
    declared = {"inputs": [{"name": "features", "datatype": "FP32", "shape": [-1, 8]}],
                "outputs": [{"name": "score", "datatype": "FP32", "shape": [-1, 1]}]}
    (features,) = traffic.example_inputs(declared, rows=3).values()
    assert features.shape == (3, 8) and str(features.dtype) == "float32"
    assert (traffic.example_inputs(declared)["features"] == features).all()  # fixed
    with pytest.raises(ValueError, match="input 'text' is BYTES"):
        traffic.example_inputs({"inputs": [{"name": "text", "datatype": "BYTES", "shape": [1]}]})


def test_the_failing_candidates_carry_their_defect_and_only_for_their_kind(dev, tmp_path):
    """The rollback scenarios' candidates (storage.DEFECTS): the LLM that crashes on start asks for a context far
    beyond its model's; the Python-backend model that serves errors keeps its I/O contract (its fingerprint, so the
    rollout accepts it) and the same booster, its model code reading a calibration file the package does not ship
    (that it loads and fails every request is tested in the real Triton: test_triton_model_kinds.py); a defect is
    built only into the kind it applies to."""
    from llm_serving.package import open_package

    models = {m["id"]: m for m in dev.models}
    chat, ranker = models["chat-small"], models["ranker"]
    out, demo = tmp_path / "packages", _fake_llm(tmp_path)
    crash = open_package(storage.build_version(chat, "1.2.0", out, demo_model=demo, defect="crash-on-start"),
                         tmp_path / "verify").manifest
    assert crash.engine.args["max_model_len"] == 1 << 20 and crash.model.version == "1.2.0"

    good = open_package(storage.build_version(ranker, "1.0.0", out), tmp_path / "verify").manifest
    bad = open_package(storage.build_version(ranker, "1.0.1", out, defect="serves-errors"),
                       tmp_path / "verify").manifest
    assert bad.model.io_fingerprint == good.model.io_fingerprint  # the same I/O: the rollout takes it

    def unpacked(version: str, path: str) -> bytes:
        return (tmp_path / "verify" / f"ranker-{version}" / path).read_bytes()

    assert unpacked("1.0.1", "weights/ranker.json") == unpacked("1.0.0", "weights/ranker.json")
    code = unpacked("1.0.1", bad.python.model_py).decode()
    assert code.startswith(unpacked("1.0.0", good.python.model_py).decode()) and "calibration.json" in code
    assert not (tmp_path / "verify" / "ranker-1.0.1" / "weights" / "calibration.json").exists()
    with pytest.raises(storage.StorageError, match="ranker 1.0.2: no defect 'crash-on-start' for kind python"):
        storage.build_version(ranker, "1.0.2", out, defect="crash-on-start")
    with pytest.raises(storage.StorageError, match="chat-small 1.3.0: no defect 'serves-errors' for kind vllm"):
        storage.build_version(chat, "1.3.0", out, demo_model=demo, defect="serves-errors")


def test_the_gateways_retry_policy_as_the_program_renders_it_is_what_haproxy_realises(dev, tmp_path):
    """The seam program -> gateway: the dev stack's rendered Gateway, routes and BackendTrafficPolicy become one
    HAProxy configuration (checked by haproxy -c) in which every route rule's backend retries a refused or reset
    attempt and the pod contract's statuses on another server."""
    gateway = gateway_routes.gateway_from_rendered(dev.resources)
    retry = gateway_retry.retry_from_rendered(dev.resources, gateway)
    assert retry is not None and retry.retries == pc.GATEWAY_RETRIES
    assert retry.retry_on == ("conn-failure", "empty-response", *map(str, pc.GATEWAY_RETRY_STATUS_CODES))
    settings = haproxy_config.Settings(binds={443: ("127.0.0.1", 8443)}, admin_socket=tmp_path / "admin.sock",
                              certificate=tmp_path / "unused.pem")
    routes = gateway_routes.routes_from_rendered(dev.resources)
    config = haproxy_config.render_config(gateway, routes, {}, settings, retry)
    backends = config.text.count("\nbackend ") - 1
    assert backends >= 6 and config.text.count("    option redispatch 1") == backends  # 3 models, HTTP and gRPC
    certificate = CertificateAuthority.create(tmp_path / "ca").issue(["*.test"], tmp_path / "tls")
    text = config.text.replace(str(tmp_path / "unused.pem"), str(certificate.pem_path))
    haproxy_process.HAProxy(tmp_path).check(text)


# -- the model cache: cold, the stack's warmer, warm (model_cache.py) ------------------------------------------


class _PlainView:
    """A link to the FSx directory in place of the FUSE stand-in (no root or libfuse in `make test`); the lazy
    loads themselves are tested in test_lazy_cache.py."""

    loaded_bytes = 0

    def __init__(self, source: Path, mountpoint: Path):
        mountpoint.parent.mkdir(parents=True, exist_ok=True)
        mountpoint.symlink_to(source, target_is_directory=True)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return None


def test_the_rendered_cache_warmer_makes_every_published_version_resident(dev, demo_model_dir, tmp_path):
    """The seam publish -> the stack's CronJob -> the markers the rollout reads: `llm-serving publish` with the
    stack's warm request, FSx's import, then the rendered warmer container's command and env (python3 as the serving
    venv's, the model cache and S3 substituted) writes a resident marker for every version the stack names."""
    from rehearsal import model_cache

    container = model_cache.warmer_container(dev)
    command = model_cache.warmer_command(container, "http://s3.local")
    assert command[:3] == ["python3", "-m", "serving_image.cache_warmer"]
    assert command[-2:] == ["--endpoint-url", "http://s3.local"]

    def warmer_here(container, view, endpoint):
        # The rendered command with this interpreter as the image's python3, the view as the model cache's root
        # (the rehearsal runs it in a container of the built image: model_cache.warmer_in_image).
        argv = [sys.executable, *model_cache.warmer_command(container, endpoint)[1:], "--models-root",
                str(view / pc.FSX_MODELS_PATH.lstrip("/"))]
        return subprocess.run(argv, env={**os.environ, **model_cache.warmer_env(container)}, capture_output=True,
                              text=True, timeout=model_cache.WARMER_TIMEOUT_S)
    store = storage.start_s3_server()
    try:
        s3 = store.client()
        bucket = dev.bucket()
        s3.create_bucket(Bucket=bucket)
        packages = storage.package_versions(dev.models, demo_model_dir, tmp_path / "packages", dev.model_prefix)
        for package in packages.values():
            storage.publish(package, f"s3://{bucket}/{dev.model_prefix.rstrip('/')}", store, dev.home_region,
                            dev.region)
        (dra,) = dev.of_type(render.DRA)
        storage.fsx_import(store, dra["inputs"]["dataRepositoryPath"], dra["inputs"]["fileSystemPath"],
                           tmp_path / "fsx")
        result = model_cache.rehearse_model_cache(dev, tmp_path / "fsx", store, warmer_here,
                                                  tmp_path / "work", "chat-small", "1.0.0", view=_PlainView)
        assert sorted(result.markers) == ["chat-small 1.0.0", "ranker 1.0.0", "scorer 1.0.0"]
        keys = {o["Key"] for o in s3.list_objects_v2(Bucket=bucket, Prefix="cache-state/resident/")["Contents"]}
        assert len(keys) == 3 and all(k.startswith(f"cache-state/resident/{dev.region}/") for k in keys)
        # a second run finds every version resident before the warmer: refused, naming the version
        with pytest.raises(model_cache.ModelCacheError, match="has a resident marker before any warmer ran"):
            model_cache.rehearse_model_cache(dev, tmp_path / "fsx", store, warmer_here,
                                             tmp_path / "work2", "chat-small", "1.0.0", view=_PlainView)
    finally:
        store.stop()


def test_a_warmer_command_the_rehearsal_cannot_run_is_named(dev, tmp_path):
    from rehearsal import model_cache

    container = {**model_cache.warmer_container(dev), "command": ["/bin/warm"]}
    with pytest.raises(model_cache.ModelCacheError, match="does not start with the image's python3"):
        model_cache.warmer_command(container, "http://s3.local")


# -- the rollout scenarios' commands and the batch worker's pod --------------------------------------------------


def test_rollout_start_declares_the_new_llm_versions_weights_as_the_stack_does(tmp_path, monkeypatch):
    """The schema requires weightsGib of an LLM's versions: `rollout start` of a new chat-small version passes the
    size the stack declares for its active version (the candidates are the same demo model), a Python model none."""
    from types import SimpleNamespace

    from rehearsal import scenarios

    shutil.copytree(REPO_ROOT / "stacks", tmp_path / "stacks")
    ctx = SimpleNamespace(stack="dev-us-east-1", config_dir=tmp_path / "stacks")
    seen: list[tuple] = []

    async def rollout(_ctx, action, model_id, *extra):
        seen.append((action, model_id, extra))
        return {}

    monkeypatch.setattr(scenarios, "rollout", rollout)
    entry = {"package": "s3://b/models/model-cache/x/1.1.0/", "ioFingerprint": "sha256:ab"}
    asyncio.run(scenarios._start(ctx, "chat-small", "1.1.0", entry))
    asyncio.run(scenarios._start(ctx, "scorer", "1.1.0", entry))
    assert seen[0] == ("start", "chat-small", ("--version", "1.1.0", "--package", entry["package"],
                                               "--io-fingerprint", "sha256:ab", "--weights-gib", "6"))
    assert "--weights-gib" not in seen[1][2]


def test_the_new_versions_size_is_the_active_versions_and_never_made_up():
    from rehearsal.scenarios import weights_gib_args

    llm = {"id": "chat", "kind": "vllm", "active": "1.1.0",
           "versions": [{"version": "1.0.0", "weightsGib": 6}, {"version": "1.1.0", "weightsGib": 7.5}]}
    assert weights_gib_args(llm) == ["--weights-gib", "7.5"]
    assert weights_gib_args({"id": "r", "kind": "python", "versions": [{"version": "1.0.0"}]}) == []
    unsized = {**llm, "versions": [{"version": "1.1.0"}]}
    with pytest.raises(RuntimeError, match="chat: its active version 1.1.0 declares no weightsGib"):
        weights_gib_args(unsized)


def test_the_batch_worker_runs_as_rendered_against_the_rehearsals_s3(dev, tmp_path):
    """Every stack update waits for the batch worker's Deployment: the rehearsal runs its pod as rendered
    (its command, exactly its env on top, its volumes), its bucket exists, and what IRSA and S3's endpoint give in
    the cloud stands in under the rendered env."""
    from rehearsal import cluster

    (worker,) = [d for d in dev.pod_deployments() if render.component(d["inputs"]) == render.BATCH_WORKER]
    assert cluster._runs_pods(render.DEPLOYMENT, worker["inputs"])  # a stack update's step waits for its pods
    endpoint = "http://10.213.0.1:5000"
    key_secret = next(v["secret"]["secretName"] for v in worker["inputs"]["spec"]["template"]["spec"]["volumes"]
                      if "secret" in v)
    (plan,) = podspec.pod_plans(worker, IMAGE, {}, lambda pod, volume: tmp_path / pod / volume,
                                substitutions.cloud_env(endpoint), {key_secret: str(tmp_path / "worker-key")})
    (container,) = worker["inputs"]["spec"]["template"]["spec"]["containers"]
    assert plan.argv == container["command"] and plan.argv[:3] == ["python3", "-m", "serving_image.batch.worker"]
    store = plan.argv[plan.argv.index("--store") + 1]
    assert store.removeprefix("s3://").split("/")[0] in dev.buckets()  # the rehearsal creates every rendered bucket
    rendered = {e["name"]: e["value"] for e in container["env"]}
    assert plan.rendered_env == rendered and all(plan.env[k] == v for k, v in rendered.items())
    assert plan.env["AWS_ENDPOINT_URL_S3"] == endpoint and plan.env["AWS_ACCESS_KEY_ID"] == "rehearsal"
    assert not set(substitutions.cloud_env(endpoint)) & set(rendered)  # never a rendered value replaced
    mounts = {m.target: m for m in plan.mounts}
    assert not mounts["/tmp"].read_only and not mounts[pc.MULTIPROC_DIR].read_only  # the metrics' files
    assert plan.env[pc.ENV_MULTIPROC_DIR] == pc.MULTIPROC_DIR
    key_dir = mounts[rendered["LLM_SERVING_BATCH_WORKER_API_KEY_FILE"].rsplit("/", 1)[0]]
    # its required Secret, as the rehearsal makes it (secrets.py), read-only
    assert key_dir.kind == "bind" and key_dir.read_only and key_dir.source == str(tmp_path / "worker-key")
    ready = plan.probes["readiness"]
    assert (ready.path, ready.port) == ("/metrics", int(plan.argv[plan.argv.index("--metrics-port") + 1]))


def test_a_required_secret_volume_is_named(tmp_path):
    dep = _deployment(volumeMounts=[{"name": "key", "mountPath": "/k"}])
    dep["inputs"]["spec"]["template"]["spec"]["volumes"] = [{"name": "key", "secret": {"secretName": "s"}}]
    with pytest.raises(podspec.PodSpecError, match="the Secret 's', which is not optional"):
        podspec.pod_plans(dep, IMAGE, {}, lambda p, v: tmp_path)


def test_an_image_changed_under_a_running_rehearsal_is_named():
    """A commit to the image's build context while the rehearsal runs re-renders every Deployment with a new digest;
    the step is refused naming both images and why, not as a pod that never got Ready."""
    from rehearsal.cluster import template_change

    def dep(image: str) -> dict:
        return {"spec": {"template": {"spec": {"containers": [{"name": "c", "image": image}]}}}}

    message = template_change("w", dep("repo@sha256:aa"), dep("repo@sha256:bb"))
    assert "its image changed during the rehearsal (repo@sha256:aa -> repo@sha256:bb)" in message
    other = dep("i")
    other["spec"]["template"]["spec"]["containers"][0]["args"] = ["--x"]
    assert "its pod template changed;" in template_change("w", dep("i"), other)
