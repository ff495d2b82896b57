"""The issue's scripted rollout: three prod regions, a failure injected in the second, which stops there and rolls
that region back; the first keeps its step (docs/rollouts.md, "Regions, waves and the analysis gate"), the third is
not touched.

Runner: `MockRunner`, i.e. the real program (infra/__main__.py) under Pulumi's mock runtime on edited copies of
the shipped stack files, with the update itself played by infra.rollout.simulator (there is no Pulumi CLI, provider or
cluster here; the Automation API runner cannot run). Prometheus answers are canned per region (rollout_support).
Each scenario runs the program 6 times (3 starting states, the first region's step, the failed step, the rollback).
Every update is checked by the policy pack's gate, passed explicitly here (infra never imports policies;
`llm-serving rollout` passes the same gate, see the policy test below).
"""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import pytest

from infra.rollout import simulator
from infra.rollout.cli import main
from infra.rollout.gate import GateThresholds, PrometheusClient
from infra.rollout.orchestrate import Options, Rollout, prometheus_gate
from infra.rollout.runner import MockRunner
from infra.rollout.simulator import Faults
from infra.rollout.stackfile import StackFile
from llm_serving_cli.main import main as llm_serving_main
from policies.gate import blocking_violations
from tests.infra.rollout_support import CannedPrometheus, Health, copy_stacks

pytestmark = pytest.mark.timeout(900)

STACKS = ["prod-us-east-1", "prod-us-west-2", "prod-eu-west-1"]
MODEL = "chat-large"


@pytest.fixture
def prom():
    canned = CannedPrometheus()
    url = canned.start()
    yield canned, url
    canned.stop()


def _prepare(runner: MockRunner) -> None:
    with ThreadPoolExecutor(3) as pool:  # the starting states: the program once per stack, in parallel
        list(pool.map(runner.prepare, STACKS))


def _model(config_dir, stack):
    return StackFile.load(config_dir / f"Pulumi.{stack}.yaml").model(MODEL)


def test_gate_failure_in_the_second_region_stops_there_and_rolls_it_back(tmp_path, prom):
    """`llm-serving rollout advance` (the command itself) with us-west-2's candidate failing the analysis gate."""
    canned, url = prom
    config_dir, state_dir = copy_stacks(tmp_path / "stacks"), tmp_path / "state"
    # us-east-1 ships at 25%; the other two regions were started at 10% (what `rollout start` leaves).
    for stack in STACKS[1:]:
        sf = StackFile.load(config_dir / f"Pulumi.{stack}.yaml")
        package = _model(config_dir, "prod-us-east-1").version("2.4.0")
        sf.start(MODEL, {"version": "2.4.0", "package": package.package, "ioFingerprint": package.io_fingerprint,
                         "weightsGib": 132}, 10)
        sf.save()
    _prepare(MockRunner(config_dir, state_dir, policy_gate=blocking_violations))
    third_before = (config_dir / "Pulumi.prod-eu-west-1.yaml").read_text()
    third_state_before = (state_dir / "prod-eu-west-1.json").read_text()
    canned.series = {
        ("prod-us-east-1", MODEL, "2.4.0"): Health(error_ratio=0.01),
        ("prod-us-west-2", MODEL, "2.4.0"): Health(error_ratio=0.20),
        ("prod-eu-west-1", MODEL, "2.4.0"): Health(error_ratio=0.0),
    }

    rc = main(["advance", MODEL, "--stacks", ",".join(STACKS), "--runner", "mock", "--config-dir", str(config_dir),
               "--state-dir", str(state_dir), *[f"--prometheus={s}={url}/{s}" for s in STACKS]],
              policy_gate=blocking_violations)

    assert rc == 1  # stopped
    runner = MockRunner(config_dir, state_dir)
    # First region: its step passed its own gate and stays (50%: 2 + 2 of 4 replicas).
    first = _model(config_dir, "prod-us-east-1")
    assert (first.active, first.candidate, first.weight) == ("2.3.0", "2.4.0", 50)
    live = runner.live("prod-us-east-1")
    assert simulator.route_weights(live, MODEL)["chat-large-http"] == {"2.3.0": 50, "2.4.0": 50}
    assert simulator.ready_replicas(live, MODEL) == {"2.3.0": 2, "2.4.0": 2}
    assert runner.outputs("prod-us-east-1")["models"][MODEL]["routeWeights"] == {"2.3.0": 50, "2.4.0": 50}
    # Second region: rolled back in one update, the active version has every replica and all traffic.
    second = _model(config_dir, "prod-us-west-2")
    assert (second.active, second.candidate, [v.version for v in second.versions]) == ("2.3.0", None, ["2.3.0"])
    live = runner.live("prod-us-west-2")
    assert simulator.route_weights(live, MODEL) == {"chat-large-http": {"2.3.0": 100},
                                                    "chat-large-grpc": {"2.3.0": 100}}
    assert simulator.ready_replicas(live, MODEL) == {"2.3.0": 2}  # the candidate's Deployment is gone
    assert runner.outputs("prod-us-west-2")["models"][MODEL]["routeWeights"] == {"2.3.0": 100}
    # Third region: not touched, not even queried.
    assert (config_dir / "Pulumi.prod-eu-west-1.yaml").read_text() == third_before
    assert (state_dir / "prod-eu-west-1.json").read_text() == third_state_before
    assert {s for s, _ in canned.queries} == {"prod-us-east-1", "prod-us-west-2"}


def test_candidate_never_ready_in_the_second_region_never_gets_traffic(tmp_path, prom):
    """`start` everywhere; us-west-2's candidate never becomes ready: its update stops before the route changes,
    the rollback removes the candidate; at no moment of any update does traffic reach a version without ready
    pods, and no red-black step runs more than replicas + surge."""
    canned, url = prom
    config_dir, state_dir = copy_stacks(tmp_path / "stacks"), tmp_path / "state"
    sf = StackFile.load(config_dir / "Pulumi.prod-us-east-1.yaml")
    entry = sf.model(MODEL).version("2.4.0")
    version = {"version": "2.4.0", "package": entry.package, "ioFingerprint": entry.io_fingerprint, "weightsGib": 132}
    sf.rollback(MODEL)  # start from no rollout anywhere
    sf.save()
    seen: list[tuple[str, str, dict, list, int]] = []

    def observe(stack, live, step):
        seen.append((stack, step, simulator.route_weights(live, MODEL), simulator.traffic_to_unready(live, MODEL),
                     sum(simulator.model_replicas(live, MODEL).values())))

    runner = MockRunner(config_dir, state_dir, faults={"prod-us-west-2": Faults(frozenset({(MODEL, "2.4.0")}))},
                        observe=observe, policy_gate=blocking_violations)
    _prepare(runner)
    third_before = (config_dir / "Pulumi.prod-eu-west-1.yaml").read_text()
    canned.series = {(s, MODEL, "2.4.0"): Health() for s in STACKS}
    clients = {s: PrometheusClient(f"{url}/{s}") for s in STACKS}
    events: list[str] = []
    report = Rollout(runner, MODEL, STACKS, Options(), gate=prometheus_gate(clients, GateThresholds()),
                     on_event=events.append).start(version)

    assert [(s.stack, s.status) for s in report.stacks] == [
        ("prod-us-east-1", "started"), ("prod-us-west-2", "rolled back"), ("prod-eu-west-1", "not reached")]
    assert not report.ok
    failed = report.stacks[1]
    assert "chat-large-2-4-0-deployment: Deployment did not become ready (0/1 pods ready)" in failed.detail
    assert failed.gate is None  # the update failed: no gate was read
    # The first region: candidate at the first step, within replicas + surge at every moment.
    assert report.stacks[0].after == "2.3.0 90% | 2.4.0 10%"
    assert report.stacks[0].peak_replicas == 5 == report.stacks[0].gpu_bound
    # Never traffic to pods that are not ready, anywhere, at any step.
    assert [s for s in seen if s[3]] == []
    # In us-west-2 the route never carried 2.4.0: the failed update stopped before it; the rollback kept it so.
    west = [s for s in seen if s[0] == "prod-us-west-2"]
    assert west and all(set(w["chat-large-http"]) == {"2.3.0"} for _, _, w, _, _ in west)
    assert any(step == "create kubernetes:apps/v1:Deployment::chat-large-2-4-0-deployment" for _, step, *_ in west)
    assert west[-1][1] == "delete kubernetes:apps/v1:Deployment::chat-large-2-4-0-deployment"
    live = runner.live("prod-us-west-2")
    assert simulator.ready_replicas(live, MODEL) == {"2.3.0": 2}
    assert _model(config_dir, "prod-us-west-2").candidate is None
    assert (config_dir / "Pulumi.prod-eu-west-1.yaml").read_text() == third_before
    assert not [s for s in seen if s[0] == "prod-eu-west-1"]
    assert any("rolling back (update failed" in e for e in events)


def test_a_mandatory_policy_blocks_the_update_before_anything_changes(tmp_path, capsys):
    """`llm-serving rollout` (the top-level command, which builds the policy gate and hands it to infra's rollout
    CLI) checks every mock update with the policy pack offline, as `pulumi up --policy-pack` would: a versioned
    version whose I/O fingerprint equals an existing version's is refused (§4: versioned is only for an interface
    change), the file goes back, and the deployed state never changed."""
    config_dir, state_dir = copy_stacks(tmp_path / "stacks"), tmp_path / "state"
    path = config_dir / "Pulumi.prod-us-west-2.yaml"
    before = path.read_text()
    same_as_4 = StackFile.load(path).model("ranker").versions[-1].io_fingerprint
    with pytest.raises(SystemExit) as exited:
        llm_serving_main(["rollout", "start", "ranker", "--stacks", "prod-us-west-2", "--version", "5.0.0",
                          "--package", "s3://acme-llm-prod-us-east-1/models/model-cache/ranker/5.0.0/",
                          "--io-fingerprint", same_as_4, "--runner", "mock", "--config-dir", str(config_dir),
                          "--state-dir", str(state_dir), "--no-gate", "--json"])
    assert exited.value.code == 1
    (entry,) = json.loads(capsys.readouterr().out)["stacks"]
    assert entry["status"] == "rolled back"
    assert "a mandatory policy blocked it: [rollout-versioned-only-on-io-change]" in entry["detail"]
    assert path.read_text() == before
    live = MockRunner(config_dir, state_dir).live("prod-us-west-2")
    assert simulator.model_replicas(live, "ranker") == {"3.0.0": 2, "4.0.0": 2}


def test_a_vllm_candidate_with_another_fingerprint_is_refused_by_the_schema(tmp_path, capsys):
    """Every vllm package has the vLLM tensor contract's fingerprint, so a red-black candidate of an LLM with another
    one is not a vllm package: the stack schema refuses the edit, naming the field, before any update runs."""
    config_dir, state_dir = copy_stacks(tmp_path / "stacks"), tmp_path / "state"
    path = config_dir / "Pulumi.prod-eu-west-1.yaml"
    before = path.read_text()
    with pytest.raises(SystemExit) as exited:
        llm_serving_main(["rollout", "start", MODEL, "--stacks", "prod-eu-west-1", "--version", "3.0.0", "--package",
                          "s3://acme-llm-prod-us-east-1/models/model-cache/chat-large/3.0.0/", "--io-fingerprint",
                          "sha256:" + "ab" * 32, "--runner", "mock", "--config-dir", str(config_dir), "--state-dir",
                          str(state_dir), "--no-gate", "--json"])
    assert exited.value.code == 1
    (entry,) = json.loads(capsys.readouterr().out)["stacks"]
    assert entry["status"] == "failed"
    assert "versions[1].ioFingerprint" in entry["detail"] and "not the vLLM tensor contract's" in entry["detail"]
    assert path.read_text() == before


def test_step_order_of_a_forward_step_and_of_a_rollback_in_the_real_program(tmp_path):
    """§4's order, from the program's own dependencies: a step grows the candidate, then moves the routes, then
    shrinks the active; a rollback grows the active back (capacity), then moves the routes, then removes the
    candidate."""
    config_dir, state_dir = copy_stacks(tmp_path / "stacks"), tmp_path / "state"
    steps: list[str] = []
    runner = MockRunner(config_dir, state_dir, observe=lambda stack, live, step: steps.append(step),
                        policy_gate=blocking_violations)
    runner.prepare("prod-us-east-1")
    rollout = Rollout(runner, MODEL, ["prod-us-east-1"])

    def order(*names: str) -> list[int]:
        return [next(i for i, s in enumerate(steps) if s.endswith(name)) for name in names]

    report = rollout.advance()  # 25% -> 50%: candidate 1 -> 2, active 3 -> 2 (4 replicas, surge 1)
    assert [(s.status, s.after, s.peak_replicas, s.gpu_bound) for s in report.stacks] == [
        ("advanced", "2.3.0 50% | 2.4.0 50%", 5, 5)]
    cand, http, grpc, active = order("Deployment::chat-large-2-4-0-deployment", "HTTPRoute::chat-large-http",
                                     "GRPCRoute::chat-large-grpc", "Deployment::chat-large-2-3-0-deployment")
    assert cand < http and cand < grpc and max(http, grpc) < active

    steps.clear()
    report = rollout.abort()
    assert [(s.status, s.after) for s in report.stacks] == [("rolled back", "2.3.0 100%")]
    active, http, grpc, gone = order("Deployment::chat-large-2-3-0-deployment", "HTTPRoute::chat-large-http",
                                     "GRPCRoute::chat-large-grpc", "delete kubernetes:apps/v1:Deployment::"
                                     "chat-large-2-4-0-deployment")
    assert steps[active].startswith("update") and active < http and active < grpc and max(http, grpc) < gone
    assert report.stacks[0].peak_replicas == 6 == report.stacks[0].gpu_bound  # 4 back on the active + 2 candidate
    live = runner.live("prod-us-east-1")
    assert simulator.ready_replicas(live, MODEL) == {"2.3.0": 4}
    assert simulator.route_weights(live, MODEL)["chat-large-http"] == {"2.3.0": 100}


def test_a_version_an_experiment_calls_is_kept_even_idle(tmp_path, prom, capsys):
    """An experiment's arm names the ranker's 3.0.0 (at 0% for now): `advance` keeps that version although it had no
    request, since removing it would leave the experiment on a version the stack no longer serves."""
    canned, url = prom
    config_dir, state_dir = copy_stacks(tmp_path / "stacks"), tmp_path / "state"
    stack_file = config_dir / "Pulumi.prod-us-west-2.yaml"
    stack_file.write_text(stack_file.read_text() + """\
    - name: ranker-v4
      unit: user
      arms:
        - {name: old, model: ranker, version: 3.0.0, percent: 0}
        - {name: new, model: ranker, version: 4.0.0, percent: 100}
""")
    canned.series = {}
    args = ["advance", "ranker", "--stacks", "prod-us-west-2", "--runner", "mock", "--config-dir", str(config_dir),
            "--state-dir", str(state_dir), f"--prometheus=prod-us-west-2={url}/prod-us-west-2", "--idle-window",
            "3d", "--json"]
    assert main(args, policy_gate=blocking_violations) == 0
    (entry,) = json.loads(capsys.readouterr().out)["stacks"]
    assert entry["status"] == "unchanged" and "3.0.0 (an arm of experiment ranker-v4)" in entry["detail"]
    assert [v.version for v in StackFile.load(stack_file).model("ranker").versions] == ["3.0.0", "4.0.0"]


def test_versioned_idle_version_removed_by_a_later_update(tmp_path, prom, capsys):
    """prod-us-west-2's ranker serves 3.0.0 and 4.0.0 (the shipped versioned shape). With requests on 3.0.0 in the
    idle window nothing is removed, nor while Prometheus lacks its series or holds them for part of the window;
    once it is proven idle, `advance` removes it in one update (the newest, 4.0.0, is never queried), and the
    overlap is reported (pods: the ranker has no GPUs)."""
    canned, url = prom
    config_dir, state_dir = copy_stacks(tmp_path / "stacks"), tmp_path / "state"
    args = ["advance", "ranker", "--stacks", "prod-us-west-2", "--runner", "mock", "--config-dir", str(config_dir),
            "--state-dir", str(state_dir), f"--prometheus=prod-us-west-2={url}/prod-us-west-2", "--idle-window",
            "3d", "--json"]
    canned.series = {("prod-us-west-2", "ranker", "3.0.0"): Health(requests=12)}
    assert main(args, policy_gate=blocking_violations) == 0
    (entry,) = json.loads(capsys.readouterr().out)["stacks"]
    # the ranker has no GPUs (a CPU model): its overlap is 2 pods of 3.0.0 on the CPU node group, no GPU
    assert entry["status"] == "unchanged" and entry["overlap_gpus"] == 0
    assert "the overlap holds 2 pods (no GPUs)" in entry["detail"]
    assert "3.0.0 (12 requests)" in entry["detail"]

    # Prometheus has no series of 3.0.0 (a broken PodMonitor, a restart): nothing proves it idle, so it stays, and
    # the detail names the series it lacked.
    canned.series = {}
    assert main(args, policy_gate=blocking_violations) == 0
    (entry,) = json.loads(capsys.readouterr().out)["stacks"]
    assert entry["status"] == "unchanged"
    assert ('3.0.0 (not proven idle in 3d: no data for up{app_kubernetes_io_name="ranker", '
            'app_kubernetes_io_version="3.0.0"} (every target scraped for the whole 3d); '
            'nv_inference_request_success{app_kubernetes_io_name="ranker", app_kubernetes_io_version="3.0.0"} '
            '(a series for the whole 3d))') in entry["detail"]
    # Scraped for the whole window, its counter there, but only partly: still kept.
    canned.series = {("prod-us-west-2", "ranker", "3.0.0"): Health(requests=0, scraped=False)}
    assert main(args, policy_gate=blocking_violations) == 0
    (entry,) = json.loads(capsys.readouterr().out)["stacks"]
    assert entry["status"] == "unchanged" and "3.0.0 (not proven idle in 3d" in entry["detail"]
    assert [v.version for v in StackFile.load(config_dir / "Pulumi.prod-us-west-2.yaml").model("ranker").versions] \
        == ["3.0.0", "4.0.0"]

    canned.series = {("prod-us-west-2", "ranker", "3.0.0"): Health(requests=0)}  # proven idle
    assert main(args, policy_gate=blocking_violations) == 0
    (entry,) = json.loads(capsys.readouterr().out)["stacks"]
    assert entry["status"] == "removed idle"
    assert "removed ['3.0.0'] (no request in 3d), freeing 2 pods (no GPUs); kept 4.0.0 (newest)" in entry["detail"]
    assert [v.version for v in StackFile.load(config_dir / "Pulumi.prod-us-west-2.yaml").model("ranker").versions] \
        == ["4.0.0"]
    live = MockRunner(config_dir, state_dir).live("prod-us-west-2")
    assert simulator.model_replicas(live, "ranker") == {"4.0.0": 2}
    assert simulator.route_weights(live, "ranker") == {"ranker-4-0-0-http": {"4.0.0": 100},
                                                    "ranker-4-0-0-grpc": {"4.0.0": 100}}
    assert {q.split('app_kubernetes_io_version="')[1].split('"')[0] for _, q in canned.queries} == {"3.0.0"}


def test_a_red_black_rollout_back_to_a_lower_version_completes(tmp_path):
    """After 2.4.0 was finalized, the team rolls back to 2.3.0 as a new red-black rollout: every update passes the
    policy pack (the protected version is the one with the traffic, not the highest number: at weight 100 the old
    2.4.0 has no replicas), and the finalize leaves 2.3.0 alone, named by the stack outputs as activeVersion."""
    stack = "prod-us-west-2"
    config_dir, state_dir = copy_stacks(tmp_path / "stacks"), tmp_path / "state"
    path = config_dir / f"Pulumi.{stack}.yaml"
    sf = StackFile.load(path)
    lower = sf.model(MODEL).version("2.3.0")
    back = {"version": "2.3.0", "package": lower.package, "ioFingerprint": lower.io_fingerprint, "weightsGib": 132}
    higher = {**back, "version": "2.4.0", "package": lower.package.replace("/2.3.0/", "/2.4.0/")}
    sf.start(MODEL, higher, 100)
    sf.finalize(MODEL)  # 2.4.0 is the active version, alone
    sf.save()
    runner = MockRunner(config_dir, state_dir, policy_gate=blocking_violations)
    runner.prepare(stack)
    assert runner.outputs(stack)["models"][MODEL]["activeVersion"] == "2.4.0"
    rollout = Rollout(runner, MODEL, [stack], Options(steps=(50, 100)))

    reports = [rollout.start(back), rollout.advance(), rollout.advance()]

    assert [(r.stacks[0].status, r.stacks[0].after) for r in reports] == [
        ("started", "2.4.0 50% | 2.3.0 50%"), ("advanced", "2.4.0 0% | 2.3.0 100%"), ("finalized", "2.3.0 100%")]
    assert all(r.ok for r in reports), [r.stacks[0].detail for r in reports]
    model = StackFile.load(path).model(MODEL)
    assert (model.active, model.candidate, [v.version for v in model.versions]) == ("2.3.0", None, ["2.3.0"])
    live = runner.live(stack)
    assert simulator.ready_replicas(live, MODEL) == {"2.3.0": 2}
    assert simulator.route_weights(live, MODEL)["chat-large-http"] == {"2.3.0": 100}
    assert runner.outputs(stack)["models"][MODEL]["activeVersion"] == "2.3.0"
