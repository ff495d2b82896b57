"""Dashboards and alert rules as code: committed files equal the generator's output, promtool checks and unit-tests
the rules, and every dashboard expression parses. (`test_metrics_vllm.py` runs every expression on a real
Prometheus that scrapes the proxy in front of a real vLLM engine.)"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from serving_image.metrics import frontend, observability
from serving_image.metrics.observability import DEFAULT_OUT, RULES_FILE, Thresholds, alert_rules, panel_expressions

RULE_TESTS = DEFAULT_OUT / "tests" / "llm-serving-alerts.test.yml"
METRIC_NAME = re.compile(r"\b((?:vllm:|nv_|llm_serving_metrics_)[a-zA-Z0-9_:]+)")


def promtool(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["promtool", *args], capture_output=True, text=True, cwd=cwd, timeout=120)


def grafana_to_promql(expr: str) -> str:
    """Grafana substitutes its variables before the query reaches Prometheus; do the same."""
    return expr.replace("$__rate_interval", "1m").replace("$model", ".*").replace("$version", ".*")


def test_committed_files_are_the_generators_output():
    for relative, content in observability.render_files().items():
        committed = DEFAULT_OUT / relative
        assert committed.read_text() == content, (
            f"{committed} is stale: run `python -m serving_image.metrics.observability`"
        )


def test_promtool_check_rules():
    result = promtool("check", "rules", str(DEFAULT_OUT / RULES_FILE))
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"SUCCESS: {len(alert_rules()['groups'][0]['rules'])} rules found" in result.stdout


def test_promtool_check_config_of_the_scrape_config(tmp_path):
    """Debian's Prometheus is built without Kubernetes discovery, so promtool checks the configuration with a file
    discovery in its place; everything else (relabeling, rule files) is the generated configuration."""
    generated = yaml.safe_load((DEFAULT_OUT / observability.SCRAPE_FILE).read_text())
    assert generated["scrape_configs"][0]["kubernetes_sd_configs"] == [{"role": "pod"}]
    config = observability.scrape_config(
        str(DEFAULT_OUT / RULES_FILE), discovery={"file_sd_configs": [{"files": [str(tmp_path / "targets.json")]}]}
    )
    path = tmp_path / "prometheus.yml"
    path.write_text(yaml.safe_dump(config))
    result = promtool("check", "config", str(path))
    assert result.returncode == 0, result.stdout + result.stderr
    assert "SUCCESS: 1 rule files found" in result.stdout + result.stderr


def test_scrape_config_turns_pod_labels_into_the_names_the_rules_select_by():
    relabel = observability.scrape_config()["scrape_configs"][0]["relabel_configs"]
    (labelmap,) = [r for r in relabel if r.get("action") == "labelmap"]
    pattern = re.compile(labelmap["regex"])
    # Kubernetes discovery sanitises `app.kubernetes.io/name` to `app_kubernetes_io_name` in the meta label.
    for label in ("name", "version", "part_of", "component"):
        match = pattern.fullmatch(f"__meta_kubernetes_pod_label_app_kubernetes_io_{label}")
        assert match and match.group(1) == f"app_kubernetes_io_{label}"
    used = set(re.findall(r"app_kubernetes_io_[a-z_]+", json.dumps(observability.dashboard())))
    used |= set(re.findall(r"app_kubernetes_io_[a-z_]+", json.dumps(alert_rules())))
    assert used <= {"app_kubernetes_io_name", "app_kubernetes_io_version", "app_kubernetes_io_part_of"}


def test_promtool_test_rules():
    result = promtool("test", "rules", str(RULE_TESTS))
    assert result.returncode == 0, result.stdout + result.stderr
    assert "SUCCESS" in result.stdout


def test_every_alert_has_a_unit_test():
    alerts = {rule["alert"] for rule in alert_rules()["groups"][0]["rules"]}
    tested = {case["alertname"] for test in yaml.safe_load(RULE_TESTS.read_text())["tests"]
              for case in test["alert_rule_test"]}
    assert alerts == tested


@pytest.mark.parametrize(
    "changed",
    [Thresholds(kv_cache_usage=0.97), Thresholds(error_ratio=0.2), Thresholds(ttft_p99_s=10.0)],
    ids=["kv-cache", "error-ratio", "ttft"],
)
def test_rule_unit_tests_catch_a_changed_threshold(tmp_path, changed):
    """The unit tests are not vacuous: the same tests against rules with another threshold fail."""
    rules = tmp_path / "prometheus" / RULES_FILE.name
    rules.parent.mkdir()
    rules.write_text(yaml.safe_dump(alert_rules(changed), sort_keys=False, width=1000))
    (tmp_path / "tests").mkdir()
    shutil.copy(RULE_TESTS, tmp_path / "tests" / RULE_TESTS.name)
    result = promtool("test", "rules", str(tmp_path / "tests" / RULE_TESTS.name))
    assert result.returncode != 0
    assert "FAILED" in result.stdout + result.stderr


def test_every_dashboard_expression_parses(tmp_path):
    board = json.loads((DEFAULT_OUT / observability.DASHBOARD_FILE).read_text())
    exprs = panel_expressions(board)
    assert len(exprs) >= 12
    # promtool parses PromQL when it checks recording rules: one rule per panel expression.
    rules = {"groups": [{"name": "dashboard", "rules": [
        {"record": f"dashboard:expr_{i}", "expr": grafana_to_promql(expr)} for i, expr in enumerate(exprs)
    ]}]}
    path = tmp_path / "dashboard-exprs.yml"
    path.write_text(yaml.safe_dump(rules, width=1000))
    result = promtool("check", "rules", str(path))
    assert result.returncode == 0, result.stdout + result.stderr


def test_dashboard_selects_by_the_kubernetes_labels_and_is_well_formed():
    board = observability.dashboard()
    ids = [panel["id"] for panel in board["panels"]]
    assert len(ids) == len(set(ids))
    for panel in board["panels"]:
        ref_ids = [target["refId"] for target in panel["targets"]]
        assert len(ref_ids) == len(set(ref_ids)), panel["title"]
        for target in panel["targets"]:
            for selector in re.findall(r"\{([^}]*)\}", target["expr"].replace("{{", "").replace("}}", "")):
                assert 'app_kubernetes_io_part_of="llm-serving"' in selector, (panel["title"], selector)
                assert 'app_kubernetes_io_name=~"$model"' in selector, (panel["title"], selector)
    variables = {v["name"] for v in board["templating"]["list"]}
    assert {"datasource", "model", "version"} <= variables


def test_triton_names_in_dashboards_and_alerts_are_ones_triton_exports():
    """vLLM's names are checked against a real engine in test_metrics_vllm.py; Triton's here, against the
    families Triton exports (frontend.FAMILY_NAMES)."""
    texts = panel_expressions(observability.dashboard()) + [
        rule["expr"] for rule in alert_rules()["groups"][0]["rules"]
    ]
    names = {name for text in texts for name in METRIC_NAME.findall(text)}
    triton = {name for name in names if name.startswith("nv_")}
    assert triton, "the dashboards should use Triton's request metrics"
    assert triton <= set(frontend.FAMILY_NAMES)
    assert {"llm_serving_metrics_upstream_up"} <= names
