"""`make plan`'s checks: every shipped stack's Kubernetes manifests against the Kubernetes OpenAPI schema
(kubernetes-validate) and the CRDs' schemas, checkov's Kubernetes checks with reasoned suppressions only, and the
plan itself (tables, JSON, manifests) on one stack end to end."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import yaml

from infra import plan
from infra.manifests import (
    Manifest,
    is_builtin,
    load_suppressions,
    manifests,
    validate_manifests,
    write_manifests,
)
from infra.mockrun import shipped_run, shipped_stacks


@pytest.mark.parametrize("stack", shipped_stacks())
def test_every_manifest_of_every_stack_validates(stack):
    items = manifests(shipped_run(stack))
    kinds = {m.kind for m in items}
    assert {"Deployment", "Service", "PodDisruptionBudget", "HTTPRoute", "GRPCRoute", "Gateway",
            "PersistentVolume", "PersistentVolumeClaim", "NetworkPolicy"} <= kinds
    assert any(not is_builtin(m) for m in items) and any(is_builtin(m) for m in items)
    assert validate_manifests(items, "1.33") == []


def broken(kind: str, change) -> Manifest:
    """The shipped prod stack's first `kind` by name (a model server, for a Deployment), changed by `change`. Chosen
    by name, not by the order the mock runtime registered the resources in: that order follows the machine's load,
    and a batch worker's Deployment (which sets a CPU limit) once came first and took the CPU-limit finding away."""
    original = min((m for m in manifests(shipped_run("prod-us-east-1")) if m.kind == kind and (
        kind != "Deployment" or m.body["metadata"]["labels"].get("app.kubernetes.io/component") == "model-server")),
        key=lambda m: m.name)
    body = copy.deepcopy(original.body)
    change(body)
    return Manifest(stack="test", resource=original.resource, kind=kind, api_version=body["apiVersion"],
                    name=original.name, namespace=original.namespace, body=body)


def test_schema_errors_are_found_in_builtin_and_custom_kinds():
    def bad_replicas(body):
        body["spec"]["replicas"] = "four"

    def unknown_field(body):
        body["spec"]["template"]["spec"]["containers"][0]["gpus"] = 8

    def bad_port(body):
        body["spec"]["rules"][0]["backendRefs"][0]["port"] = 70000

    def bad_trigger(body):
        body["spec"]["minReplicaCount"] = "one"

    findings = validate_manifests([broken("Deployment", bad_replicas), broken("Deployment", unknown_field),
                                   broken("HTTPRoute", bad_port), broken("ScaledObject", bad_trigger)], "1.33")
    messages = [f.message for f in findings]
    assert len(findings) == 4, messages
    assert "spec/replicas" in messages[0] and "'four' is not of type 'integer'" in messages[0]
    assert "gpus" in messages[1]
    assert messages[2].startswith("/spec/rules/0/backendRefs/0/port: must be <= 65535")
    assert messages[3].startswith("/spec/minReplicaCount: must be integer")


def test_a_custom_kind_without_a_schema_is_an_error_not_a_pass():
    manifest = Manifest(stack="t", resource="x", kind="Widget", api_version="example.com/v1", name="x",
                        namespace="n", body={"apiVersion": "example.com/v1", "kind": "Widget",
                                             "metadata": {"name": "x"}, "spec": {}})
    (finding,) = validate_manifests([manifest], "1.33")
    assert "no CRD schema for example.com/v1/Widget" in finding.message


def test_suppressions_need_a_written_reason(tmp_path: Path):
    for s in load_suppressions(plan.SUPPRESSIONS):
        assert len(s.reason) > 80 and s.kinds and s.names
    bad = tmp_path / "s.yaml"
    bad.write_text(yaml.safe_dump({"suppressions": [{"check": "CKV_K8S_11", "reason": "because"}]}))
    with pytest.raises(ValueError, match="suppressions\\[0\\] \\(CKV_K8S_11\\) needs a written reason"):
        load_suppressions(bad)


def test_checkov_reports_what_the_suppressions_do_not_cover(tmp_path: Path):
    """A privileged model server is a finding that no suppression covers; the CPU-limit finding is suppressed."""
    deployment = broken("Deployment", lambda b: b["spec"]["template"]["spec"]["containers"][0]["securityContext"]
                        .update({"privileged": True}))
    write_manifests([deployment], tmp_path / "manifests" / "test")
    findings, _ = plan.run_checkov(plan.DEFAULT_CHECKOV, tmp_path / "manifests",
                                   load_suppressions(plan.SUPPRESSIONS))
    by_check = {f.check_id: f for f in findings}
    assert by_check["CKV_K8S_16"].suppressed_by is None  # privileged containers
    assert by_check["CKV_K8S_11"].suppressed_by  # CPU limits, suppressed with its reason


def test_make_plan_end_to_end_on_one_stack(tmp_path: Path, capsys):
    assert plan.main(["--stack", "prod-us-west-2", "--out", str(tmp_path)]) == 0
    printed = capsys.readouterr().out
    assert "prod-us-west-2: " in printed and "aws:eks/nodeGroup:NodeGroup" in printed and "ranker" in printed
    doc = json.loads((tmp_path / "plan.json").read_text())
    entry = doc["prod-us-west-2"]
    assert entry["error"] is None and entry["schemaErrors"] == []
    assert [f for f in entry["checkov"] if not f["suppressed_by"]] == []
    assert len(entry["run"]["resources"]) == len(shipped_run("prod-us-west-2").resources)
    written = sorted(p.name for p in (tmp_path / "manifests" / "prod-us-west-2").iterdir())
    assert written == sorted(entry["manifests"]) and "deployment-llm-serving-ranker-4-0-0.yaml" in written
