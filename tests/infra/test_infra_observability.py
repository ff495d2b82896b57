"""The committed observability files (deploy/observability/) deployed by every shipped stack (infra/observability.py):
the PrometheusRule is the rules file, the Grafana ConfigMap is the dashboard, and the PodMonitor scrapes exactly the
model-server pods the same stack creates, on their metrics port, with the target labels the rules and the dashboard
select by.

The PodMonitor's relabelings are evaluated here with Prometheus' relabeling semantics on the discovery labels of the
pods of the stack's recorded Deployments (Kubernetes pod discovery: one target per container port), and compared
with what `prometheus/llm-serving-scrape.yml` yields for the same pods.
"""

from __future__ import annotations

import ast
import copy
import json
import re

import pytest
import yaml

from infra.config import ConfigError, parse_stack_config
from infra.manifests import Manifest, manifests, validate_manifests
from infra.mockrun import REPO_ROOT, MockedResource, StackRun, run_stack, shipped_run, stack_config_path
from infra.observability import DASHBOARD_FILE as DASHBOARD
from infra.observability import OBSERVABILITY_DIR
from infra.observability import RULES_FILE as RULES

SCRAPE = OBSERVABILITY_DIR / "prometheus" / "llm-serving-scrape.yml"
POD_MONITOR = "kubernetes:monitoring.coreos.com/v1:PodMonitor"
PROMETHEUS_RULE = "kubernetes:monitoring.coreos.com/v1:PrometheusRule"
CONFIG_MAP = "kubernetes:core/v1:ConfigMap"
DEPLOYMENT = "kubernetes:apps/v1:Deployment"
POD_TEMPLATES = (DEPLOYMENT, "kubernetes:apps/v1:DaemonSet", "kubernetes:apps/v1:StatefulSet")
PLATFORM_LABELS = ("app.kubernetes.io/part-of", "app.kubernetes.io/managed-by", "app.kubernetes.io/component")


def only(run: StackRun, type_token: str, name_part: str = "observability") -> MockedResource:
    found = [r for r in run.of_type(type_token) if name_part in r.name]
    assert len(found) == 1, f"{run.stack}: expected one {type_token} ({name_part}), got {[r.name for r in found]}"
    return found[0]


# -- Prometheus relabeling and Kubernetes pod discovery, as Prometheus implements them ------------------------------


def _expand(template: str, match: re.Match) -> str:
    """Go's regexp Expand as Prometheus uses it: `$1`, `${1}`, `$name`; an unknown group expands to ''."""
    def group(m: re.Match) -> str:
        ref = m.group(1) or m.group(2)
        try:
            return match.group(int(ref) if ref.isdigit() else ref) or ""
        except IndexError:
            return ""

    return re.sub(r"\$\{(\w+)\}|\$(\w+)", group, template)


def relabel(labels: dict[str, str], rules: list[dict], camel: bool) -> dict[str, str] | None:
    """Prometheus' relabel_config semantics (keep, drop, replace, labelmap); None when the target is dropped.
    `camel`: PodMonitor field names (sourceLabels, targetLabel) instead of the scrape file's (source_labels...)."""
    labels = dict(labels)
    for rule in rules:
        action = rule.get("action", "replace").lower()
        regex = re.compile(f"^(?:{rule.get('regex', '(.*)')})$")
        sources = rule.get("sourceLabels" if camel else "source_labels") or []
        target = rule.get("targetLabel" if camel else "target_label")
        replacement = rule.get("replacement", "$1")
        value = rule.get("separator", ";").join(labels.get(s, "") for s in sources)
        if action == "keep":
            if not regex.match(value):
                return None
        elif action == "drop":
            if regex.match(value):
                return None
        elif action == "replace":
            m = regex.match(value)
            if m:
                new = _expand(target, m)
                result = _expand(replacement, m)
                if result:
                    labels[new] = result
                else:
                    labels.pop(new, None)
        elif action == "labelmap":
            for name, val in list(labels.items()):
                m = regex.match(name)
                if m:
                    labels[_expand(replacement, m)] = val
        else:
            raise AssertionError(f"relabel action {action!r} is not evaluated by this test")
    return labels


def sanitize(name: str) -> str:
    return re.sub(r"[^a-zA-Z0-9_]", "_", name)


def pod_targets(workload: MockedResource) -> list[dict[str, str]]:
    """Kubernetes pod discovery's targets (one per container port) for one pod of a workload's template."""
    meta = workload.inputs["metadata"]
    template = workload.inputs["spec"]["template"]
    pod_labels = template["metadata"]["labels"]
    pod = f"{meta['name']}-5d8f7c9b4-x2k7q"
    base = {"__meta_kubernetes_namespace": meta.get("namespace", "default"), "__meta_kubernetes_pod_name": pod,
            **{f"__meta_kubernetes_pod_label_{sanitize(k)}": v for k, v in pod_labels.items()},
            **{f"__meta_kubernetes_pod_labelpresent_{sanitize(k)}": "true" for k in pod_labels}}
    out = []
    for container in template["spec"]["containers"]:
        for port in container.get("ports", []):
            out.append({**base, "__address__": f"10.0.0.1:{port['containerPort']}",
                        "__meta_kubernetes_pod_container_name": container["name"],
                        "__meta_kubernetes_pod_container_port_name": port.get("name", ""),
                        "__meta_kubernetes_pod_container_port_number": str(port["containerPort"]),
                        "__meta_kubernetes_pod_container_port_protocol": port.get("protocol", "TCP")})
    return out


def finish(labels: dict[str, str] | None) -> frozenset | None:
    """A target's labels once relabeling is done: `instance` defaults to the address, the `__` labels go."""
    if labels is None:
        return None
    labels = {"instance": labels["__address__"], **labels}
    return frozenset((k, v) for k, v in labels.items() if not k.startswith("__"))


def workloads(run: StackRun) -> list[MockedResource]:
    return [r for t in POD_TEMPLATES for r in run.of_type(t)]


def pod_monitor_targets(spec: dict, run: StackRun) -> set[frozenset]:
    """What the operator makes of a PodMonitor: pods in namespaceSelector.matchNames whose labels match the selector,
    their container port named by the endpoint, then the endpoint's relabelings."""
    (endpoint,) = spec["podMetricsEndpoints"]
    out = set()
    for w in workloads(run):
        if w.inputs["metadata"].get("namespace") not in spec["namespaceSelector"]["matchNames"]:
            continue
        pod_labels = w.inputs["spec"]["template"]["metadata"]["labels"]
        if any(pod_labels.get(k) != v for k, v in spec["selector"]["matchLabels"].items()):
            continue
        for target in pod_targets(w):
            if target["__meta_kubernetes_pod_container_port_name"] != endpoint["port"]:
                continue
            labels = finish(relabel(target, endpoint.get("relabelings", []), camel=True))
            if labels is not None:
                out.add(labels)
    return out


def scrape_file_targets(run: StackRun) -> set[frozenset]:
    (job,) = yaml.safe_load(SCRAPE.read_text())["scrape_configs"]
    out = set()
    for w in workloads(run):
        for target in pod_targets(w):
            labels = finish(relabel(target, job["relabel_configs"], camel=False))
            if labels is not None:
                out.add(labels)
    return out


def model_server_deployments(run: StackRun) -> list[MockedResource]:
    """The stack's model servers, known by what they run (the model id in their environment), not by labels."""
    out = []
    for d in run.of_type(DEPLOYMENT):
        env = {e["name"] for c in d.inputs["spec"]["template"]["spec"]["containers"] for e in c.get("env", [])}
        if "LLM_SERVING_MODEL_ID" in env:
            out.append(d)
    return out


def env_of(deployment: MockedResource) -> dict[str, str]:
    (container,) = deployment.inputs["spec"]["template"]["spec"]["containers"]
    return {e["name"]: e.get("value") for e in container["env"]}


# -- every shipped stack -----------------------------------------------------------------------------------------


def test_every_stack_deploys_the_rules_the_pod_monitor_and_the_dashboard_in_the_monitoring_namespace(stack):
    run, cfg = stack
    objects = [only(run, PROMETHEUS_RULE), only(run, POD_MONITOR), only(run, CONFIG_MAP)]
    for r in objects:
        meta = r.inputs["metadata"]
        assert meta["namespace"] == cfg.serving.monitoring_namespace, r.name
        assert r.provider, f"{r.name} has no explicit Kubernetes provider (it would go to the ambient cluster)"
        assert meta["labels"]["app.kubernetes.io/part-of"] == "llm-serving"
        assert meta["labels"]["app.kubernetes.io/managed-by"] == "pulumi"
        assert all(k in meta["labels"] for k in PLATFORM_LABELS), meta["labels"]
    for r in objects[:2]:  # what kube-prometheus-stack's podMonitorSelector and ruleSelector look for
        assert r.inputs["metadata"]["labels"]["release"] == cfg.serving.monitoring_release_label == \
            "kube-prometheus-stack"


def test_prometheus_rule_spec_is_the_committed_rules_file(stack):
    run, _ = stack
    rule = only(run, PROMETHEUS_RULE).inputs
    assert rule["apiVersion"] == "monitoring.coreos.com/v1" and rule["kind"] == "PrometheusRule"
    committed = yaml.safe_load(RULES.read_text())
    assert rule["spec"] == committed
    alerts = [r["alert"] for g in rule["spec"]["groups"] for r in g["rules"]]
    assert len(alerts) >= 7 and "LLMServingPodDown" in alerts


def test_dashboard_config_map_holds_the_committed_dashboard_with_the_sidecar_label(stack):
    run, _ = stack
    cm = only(run, CONFIG_MAP).inputs
    assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert cm["data"] == {"llm-serving.json": DASHBOARD.read_text()}
    dashboard = json.loads(cm["data"]["llm-serving.json"])
    assert dashboard["uid"] == "llm-serving" and dashboard["panels"]
    assert len(cm["data"]["llm-serving.json"].encode()) < 1024 * 1024  # a ConfigMap's size limit


def test_pod_monitor_selects_exactly_the_model_server_pods_of_the_stack(stack):
    run, cfg = stack
    spec = only(run, POD_MONITOR).inputs["spec"]
    servers = model_server_deployments(run)
    assert len(servers) >= 1
    assert spec["namespaceSelector"] == {"matchNames": sorted({d.inputs["metadata"]["namespace"] for d in servers})}
    assert spec["namespaceSelector"]["matchNames"] == [cfg.serving.namespace]
    selector = spec["selector"]["matchLabels"]
    assert selector and set(spec["selector"]) == {"matchLabels"}
    for w in workloads(run):
        pod_labels = w.inputs["spec"]["template"]["metadata"]["labels"]
        matches = all(pod_labels.get(k) == v for k, v in selector.items())
        assert matches is (w in servers), f"{w.name}: selected={matches}, model server={w in servers}"


def test_pod_monitor_scrapes_the_containers_metrics_port(stack):
    run, _ = stack
    (endpoint,) = only(run, POD_MONITOR).inputs["spec"]["podMetricsEndpoints"]
    scrape = yaml.safe_load(SCRAPE.read_text())
    (job,) = scrape["scrape_configs"]
    assert endpoint["interval"] == job.get("scrape_interval", scrape["global"]["scrape_interval"])
    (port_rule,) = [r for r in job["relabel_configs"]
                    if r.get("source_labels") == ["__meta_kubernetes_pod_container_port_number"]]
    assert endpoint["path"] == job["metrics_path"]
    for d in model_server_deployments(run):
        ports = {p["name"]: p["containerPort"] for c in d.inputs["spec"]["template"]["spec"]["containers"]
                 for p in c["ports"]}
        assert str(ports[endpoint["port"]]) == port_rule["regex"] == "8002", (d.name, ports)


def test_pod_monitor_targets_carry_the_recommended_labels_as_the_scrape_file_does(stack):
    run, cfg = stack
    spec = only(run, POD_MONITOR).inputs["spec"]
    targets = pod_monitor_targets(spec, run)
    servers = model_server_deployments(run)
    assert len(targets) == len(servers)  # one target per pod: the metrics port only
    assert targets == scrape_file_targets(run)  # the same targets, with the same labels
    by_instance = {dict(t)["app_kubernetes_io_instance"]: dict(t) for t in targets}
    for d in servers:
        env, labels = env_of(d), by_instance[d.inputs["metadata"]["name"]]
        assert labels["app_kubernetes_io_name"] == env["LLM_SERVING_MODEL_ID"]
        assert labels["app_kubernetes_io_version"] == env["LLM_SERVING_MODEL_VERSION"]
        assert labels["app_kubernetes_io_part_of"] == "llm-serving"
        assert labels["namespace"] == cfg.serving.namespace
        assert labels["pod"].startswith(d.inputs["metadata"]["name"] + "-")
        assert labels["instance"].endswith(":8002")


def test_rules_and_dashboard_select_only_labels_the_targets_have(stack):
    run, _ = stack
    targets = [dict(t) for t in pod_monitor_targets(only(run, POD_MONITOR).inputs["spec"], run)]
    names = set.intersection(*(set(t) for t in targets))
    texts = {"rules": RULES.read_text(), "dashboard": DASHBOARD.read_text()}
    for what, text in texts.items():
        used = set(re.findall(r"\bapp_kubernetes_io_[a-z_]+", text))
        assert {"app_kubernetes_io_name", "app_kubernetes_io_version", "app_kubernetes_io_part_of"} <= used, what
        assert used <= names, f"{what} selects by {sorted(used - names)}, which no target has"
        for value in re.findall(r'app_kubernetes_io_part_of=\\?"([^"\\]+)', text):
            assert all(t["app_kubernetes_io_part_of"] == value for t in targets), (what, value)


def test_the_observability_objects_validate_against_their_crds(stack):
    run, _ = stack
    items = [m for m in manifests(run) if m.kind in ("PodMonitor", "PrometheusRule", "ConfigMap")]
    assert sorted(m.kind for m in items) == ["ConfigMap", "PodMonitor", "PrometheusRule"]
    assert validate_manifests(items, "1.33") == []


# -- the checks above can fail -----------------------------------------------------------------------------------


def test_a_pod_monitor_without_the_labelmap_or_on_another_port_differs_from_the_scrape_file():
    run = shipped_run("prod-us-east-1")
    spec = only(run, POD_MONITOR).inputs["spec"]
    assert pod_monitor_targets(spec, run) == scrape_file_targets(run)

    no_labelmap = copy.deepcopy(spec)
    relabelings = no_labelmap["podMetricsEndpoints"][0]["relabelings"]
    relabelings[:] = [r for r in relabelings if r["action"] != "labelmap"]
    targets = pod_monitor_targets(no_labelmap, run)
    assert targets and targets != scrape_file_targets(run)
    assert not any("app_kubernetes_io_name" in dict(t) for t in targets)

    other_port = copy.deepcopy(spec)
    other_port["podMetricsEndpoints"][0]["port"] = "openai"
    assert pod_monitor_targets(other_port, run) != scrape_file_targets(run)

    other_namespace = copy.deepcopy(spec)
    other_namespace["namespaceSelector"]["matchNames"] = ["default"]
    assert pod_monitor_targets(other_namespace, run) == set()


def test_relabel_evaluator_follows_prometheus_semantics():
    labels = {"__meta_kubernetes_pod_label_app_kubernetes_io_name": "chat", "__meta_kubernetes_pod_label_team": "x",
              "__meta_kubernetes_namespace": "ns", "__address__": "10.0.0.1:8002"}
    out = relabel(labels, [{"action": "labelmap", "regex": "__meta_kubernetes_pod_label_(app_kubernetes_io_.+)"},
                           {"source_labels": ["__meta_kubernetes_namespace"], "target_label": "namespace"}],
                  camel=False)
    assert finish(out) == {("app_kubernetes_io_name", "chat"), ("namespace", "ns"), ("instance", "10.0.0.1:8002")}
    assert relabel(labels, [{"action": "keep", "source_labels": ["__meta_kubernetes_namespace"], "regex": "n"}],
                   camel=False) is None  # anchored: "n" does not match "ns"


def test_crd_validation_catches_a_broken_pod_monitor_and_rule():
    items = {m.kind: m for m in manifests(shipped_run("prod-us-east-1"))}

    def broken(kind: str, change) -> Manifest:
        original = items[kind]
        body = copy.deepcopy(original.body)
        change(body)
        return Manifest(stack="test", resource=original.resource, kind=kind, api_version=body["apiVersion"],
                        name=original.name, namespace=original.namespace, body=body)

    findings = validate_manifests([
        broken("PodMonitor", lambda b: b["spec"]["podMetricsEndpoints"][0]["relabelings"][0].update(action="map")),
        broken("PodMonitor", lambda b: b["spec"].pop("selector")),
        broken("PrometheusRule", lambda b: b["spec"]["groups"][0]["rules"][0].update({"for": "5 minutes"})),
    ], "1.33")
    messages = [f.message for f in findings]
    assert len(findings) == 3, messages
    assert messages[0].startswith("/spec/podMetricsEndpoints/0/relabelings/0/action: must be equal to one of")
    assert messages[1].startswith("/spec: must have required property selector")
    assert messages[2].startswith("/spec/groups/0/rules/0/for: must match pattern")


# -- config ------------------------------------------------------------------------------------------------------


def test_release_label_follows_the_stack_config():
    serving = yaml.safe_load(stack_config_path("dev-us-east-1").read_text())["config"]["llm-serving:serving"]
    assert "monitoringReleaseLabel" not in serving  # the shipped stacks use the default
    run = run_stack("dev-us-east-1", config_overrides={"serving": {**serving, "monitoringReleaseLabel": "prom"}})
    for typ in (POD_MONITOR, PROMETHEUS_RULE):
        assert only(run, typ).inputs["metadata"]["labels"]["release"] == "prom"
    assert "release" not in only(run, CONFIG_MAP).inputs["metadata"]["labels"]

    run = run_stack("dev-us-east-1", config_overrides={"serving": {**serving, "monitoringReleaseLabel": None}})
    for typ in (POD_MONITOR, PROMETHEUS_RULE):
        assert "release" not in only(run, typ).inputs["metadata"]["labels"]


@pytest.mark.parametrize("value,message", [
    ("kube prometheus", "llm-serving:serving.monitoringReleaseLabel: String should match pattern"),
    ("", "llm-serving:serving.monitoringReleaseLabel: String should match pattern"),
    ("x" * 64, "llm-serving:serving.monitoringReleaseLabel: String should have at most 63 characters"),
    (3, "llm-serving:serving.monitoringReleaseLabel: Input should be a valid string"),
])
def test_a_bad_release_label_is_a_config_error_naming_the_key(value, message):
    raw = yaml.safe_load(stack_config_path("prod-us-east-1").read_text())["config"]
    values = {k.split(":", 1)[1]: v for k, v in raw.items() if k.startswith("llm-serving:")}
    values["serving"] = {**values["serving"], "monitoringReleaseLabel": value}
    with pytest.raises(ConfigError) as info:
        parse_stack_config(values, raw["aws:region"])
    assert str(info.value).startswith(message), str(info.value)


def test_the_program_reads_the_committed_files_and_imports_no_serving_code():
    tree = ast.parse((REPO_ROOT / "infra" / "observability.py").read_text())
    imported = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    imported |= {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
    assert not {m for m in imported if m.split(".")[0] == "serving_image"}, imported
    from infra import observability

    assert observability.RULES_FILE == RULES and observability.DASHBOARD_FILE == DASHBOARD
    with pytest.raises(ValueError, match="expected a Prometheus rules file"):
        observability.load_rules(DASHBOARD)  # JSON is YAML, but not a rules file
