"""Property tests (hypothesis) over random rollout schedules and failures across three regions.

The orchestrator, the stack file edits and the simulator are the real code; the stacks' graphs come from
`GraphRunner` (infra.rollout.graph, shown equal to the real program's graph in test_rollout_graph.py) because a run
of the real program under the mock runtime takes seconds and these tests drive thousands of updates. The gate's
verdicts are drawn by hypothesis (its PromQL is tested against a real Prometheus in test_rollout_gate.py).

Checked at every step of every update (not only between updates):
- every route's weights sum to 100, and traffic goes only to versions with ready pods;
- a forward update never runs more than replicas + surge; a rollback no more than replicas + the candidate's;
- a version is never deleted while a route sends it traffic.
Checked after every command:
- every region's route is exactly what its config says (a failed region never leaves a half-moved route), and a
  rolled-back region's active version has every replica, all ready, and all traffic;
- the regions after a failed one are untouched.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from infra.rollout import simulator
from infra.rollout.gate import GateResult, PrometheusClient
from infra.rollout.orchestrate import Options, Rollout
from infra.rollout.planner import plan_red_black
from infra.rollout.runner import GraphRunner
from infra.rollout.simulator import Faults
from infra.rollout.stackfile import MODELS_KEY, StackFile
from llm_serving.tensor_contract import VLLM_IO_FINGERPRINT
from tests.infra.rollout_support import CannedPrometheus, Health, copy_stacks

STACKS = ["prod-us-east-1", "prod-us-west-2", "prod-eu-west-1"]
MODEL = "chat-large"
FP = VLLM_IO_FINGERPRINT  # the LLM versions in stacks/ (llm_serving/tensor_contract.py computes it)


def _version(v: str) -> dict:
    return {"version": v, "package": f"s3://acme-llm-prod-us-east-1/models/model-cache/chat-large/{v}/",
            "ioFingerprint": FP, "weightsGib": 132}


def _set_model(path: Path, model_id: str, **values) -> None:
    sf = StackFile.load(path)
    entry = next(e for e in sf.config[MODELS_KEY] if e["id"] == model_id)
    entry.update(values)
    sf.save()


class CheckedRunner(GraphRunner):
    """GraphRunner that checks the per-step invariants and each update's GPU bound."""

    def __init__(self, config_dir: Path, state_dir: Path, surge: int):
        super().__init__(config_dir, state_dir, observe=self._observe)
        self.surge = surge
        self.violations: list[str] = []
        self.updates = 0

    def _observe(self, stack: str, live: simulator.Live, step: str) -> None:
        for route, weights in simulator.route_weights(live, MODEL).items():
            if sum(weights.values()) != 100:
                self.violations.append(f"{stack} {step}: {route} weights {weights} do not sum to 100")
        bad = simulator.traffic_to_unready(live, MODEL)
        if bad:
            self.violations.append(f"{stack} {step}: traffic to versions without ready pods: {bad}")

    def up(self, stack: str):
        self.updates += 1
        model = StackFile.load(self.config_path(stack)).model(MODEL)
        before = simulator.model_replicas(self.live(stack), MODEL)
        if model.candidate is not None:
            bound = model.replicas + self.surge
        else:  # rollback or finalize: capacity first, so the other version's replicas are still there
            bound = model.replicas + sum(n for v, n in before.items() if v != model.active)
        result = super().up(stack)
        if result.peak_replicas.get(MODEL, 0) > bound:
            self.violations.append(f"{stack}: update to {model} peaked at {result.peak_replicas[MODEL]} > {bound}")
        return result


commands = st.lists(
    st.tuples(
        st.sampled_from(["advance", "advance", "advance", "abort", "start"]),
        # per region: None (healthy), "never-ready" (the candidate's new pods never get ready), "gate" (bad metrics)
        st.fixed_dictionaries({s: st.sampled_from([None, None, None, "never-ready", "gate"]) for s in STACKS}),
    ),
    min_size=1, max_size=6,
)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    replicas=st.fixed_dictionaries({s: st.integers(1, 6) for s in STACKS}),
    surge=st.integers(1, 2),
    steps=st.lists(st.integers(1, 99), max_size=4, unique=True).map(lambda xs: tuple(sorted(xs)) + (100,)),
    script=commands,
)
def test_random_rollouts_with_failures(replicas, surge, steps, script):
    with tempfile.TemporaryDirectory() as tmp:
        config_dir = copy_stacks(Path(tmp) / "stacks")
        for stack in STACKS:
            _set_model(config_dir / f"Pulumi.{stack}.yaml", MODEL, replicas=replicas[stack])
        runner = CheckedRunner(config_dir, Path(tmp) / "state", surge)
        for stack in STACKS:
            runner.prepare(stack)
        version = 5
        for action, faults in script:
            # "never-ready" hits the version being rolled out (the new one for start, else the stack's candidate);
            # the active version's pods stay healthy, so rollbacks can succeed.
            candidates = {s: StackFile.load(runner.config_path(s)).model(MODEL).candidate for s in STACKS}
            runner.faults = {s: Faults(frozenset({(MODEL, f"2.{version}.0" if action == "start" else candidates[s])}))
                             for s, f in faults.items() if f == "never-ready" and (action == "start" or candidates[s])}

            def gate(stack, model_id, ver, faults=faults):
                bad = faults[stack] == "gate"
                return GateResult(not bad, 100, 0.5 if bad else 0.0, 1.0, "error ratio 50.00% above 5.00%")

            rollout = Rollout(runner, MODEL, STACKS, Options(steps=steps, surge=surge), gate=gate)
            texts = {s: runner.config_path(s).read_text() for s in STACKS}
            lives = {s: simulator.live_to_json(runner.live(s)) for s in STACKS}
            if action == "start":
                report = rollout.start(_version(f"2.{version}.0"))
                version += 1
            elif action == "advance":
                report = rollout.advance()
            else:
                report = rollout.abort()
            assert runner.violations == []
            stopped = False
            for entry in report.stacks:
                stack = entry.stack
                model = StackFile.load(runner.config_path(stack)).model(MODEL)
                live = runner.live(stack)
                plan = plan_red_black(model.active, model.replicas, model.candidate, model.weight)
                want = {s.version: s.weight for s in plan.shares}
                # the route is exactly what the config says: never half-moved
                routes = simulator.route_weights(live, MODEL)
                assert routes and all(w == want for w in routes.values()), (stack, entry, routes)
                assert simulator.ready_replicas(live, MODEL) == {s.version: s.replicas for s in plan.shares}
                if entry.status == "rolled back":
                    assert model.candidate is None and want == {model.active: 100}
                    assert simulator.ready_replicas(live, MODEL) == {model.active: model.replicas}
                if stopped and action != "abort":
                    assert entry.status == "not reached"
                    assert runner.config_path(stack).read_text() == texts[stack]
                    assert simulator.live_to_json(live) == lives[stack]
                stopped = stopped or entry.status in ("rolled back", "failed")
            if action == "abort":
                assert all(e.status in ("rolled back", "unchanged") for e in report.stacks)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    n_versions=st.integers(2, 4),
    # None: Prometheus holds no series of that version (nothing proves it idle)
    requests=st.lists(st.sampled_from([None, 0, 0, 3, 500]), min_size=4, max_size=4),
)
def test_versioned_idle_removal_never_removes_the_newest_or_a_version_with_requests(n_versions, requests):
    canned = CannedPrometheus()
    url = canned.start()
    try:
        with tempfile.TemporaryDirectory() as tmp:
            config_dir = copy_stacks(Path(tmp) / "stacks")
            path = config_dir / "Pulumi.prod-us-west-2.yaml"
            sf = StackFile.load(path)
            entry = next(e for e in sf.config[MODELS_KEY] if e["id"] == "ranker")
            base = dict(entry["versions"][0])
            del entry["versions"][:]
            names = [f"{i + 3}.0.0" for i in range(n_versions)]
            for i, name in enumerate(names):
                entry["versions"].append({**base, "version": name,
                                          "package": base["package"].replace("/3.0.0/", f"/{name}/"),
                                          "ioFingerprint": "sha256:" + f"{i:x}" * 64})
            sf.save()
            runner = GraphRunner(config_dir, Path(tmp) / "state")
            runner.prepare("prod-us-west-2")
            canned.series = {("prod-us-west-2", "ranker", n): Health(requests=r)
                             for n, r in zip(names, requests, strict=False) if r is not None}
            report = Rollout(runner, "ranker", ["prod-us-west-2"], Options(idle_window="7d"),
                             prometheus={"prod-us-west-2": PrometheusClient(f"{url}/prod-us-west-2")}).advance()
            (entry_report,) = report.stacks
            kept = [v.version for v in StackFile.load(path).model("ranker").versions]
            newest = names[-1]
            busy = {n for n, r in zip(names, requests, strict=False) if r != 0}  # served, or not proven idle
            assert newest in kept
            assert set(kept) == busy | {newest}
            assert simulator.model_replicas(runner.live("prod-us-west-2"), "ranker") == {v: 2 for v in kept}
            idle = [n for n in names if n not in kept]
            assert entry_report.status == ("removed idle" if idle else "unchanged")
            # the overlap cost: every version but the newest holds replicas x GPUs; the ranker has none (a CPU
            # model), so its overlap is pods, 2 per older version
            assert entry_report.overlap_gpus == 0
            assert (f"freeing {2 * len(idle)} pods (no GPUs)" if idle
                    else f"holds {2 * (n_versions - 1)} pods (no GPUs)") in entry_report.detail
            assert all('[7d]' in q or '[7d:' in q for _, q in canned.queries)
            asked = {q.split('app_kubernetes_io_version="')[1].split('"')[0] for _, q in canned.queries}
            assert newest not in asked  # the newest is never a removal candidate, so it is not even queried
    finally:
        canned.stop()
