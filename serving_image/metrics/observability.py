"""Dashboards (Grafana JSON) and alert rules (Prometheus rule files), generated from code.

`python -m serving_image.metrics.observability [--out deploy/observability]` writes:
- `grafana/llm-serving.json`: one dashboard, selectable by model and version;
- `prometheus/llm-serving-alerts.yml`: the alert rules (KV-cache usage, queue depth, preemption rate, TTFT p99,
  error rate, metrics upstream down, pod down);
- `prometheus/llm-serving-scrape.yml`: a Prometheus configuration that scrapes every model-server pod's port 8002
  and keeps its §3.10 labels.
The files are committed; a test checks that they equal this module's output, `promtool check rules` and
`promtool test rules` check the rules, and the engine test runs every expression on a real Prometheus.

Selection is by the Kubernetes recommended labels (docs/architecture.md §3.10). Prometheus' Kubernetes discovery
turns the pod label `app.kubernetes.io/name` into `__meta_kubernetes_pod_label_app_kubernetes_io_name`, and the
scrape config's `labelmap` keeps it as the target label `app_kubernetes_io_name` (and likewise for version,
component, part-of): those are the names used here.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass
from pathlib import Path

import yaml

from llm_serving.repository import REPO_ROOT
from serving_image.metrics.proxy import PREFIX

NAME = "app_kubernetes_io_name"
VERSION = "app_kubernetes_io_version"
PART_OF = 'app_kubernetes_io_part_of="llm-serving"'
BY = f"{NAME}, {VERSION}"
# Alerts: every model server of the platform. Dashboards: the models and versions picked in the variables.
ALERT_SEL = PART_OF
PANEL_SEL = f'{PART_OF}, {NAME}=~"$model", {VERSION}=~"$version"'

DASHBOARD_FILE = Path("grafana/llm-serving.json")
RULES_FILE = Path("prometheus/llm-serving-alerts.yml")
SCRAPE_FILE = Path("prometheus/llm-serving-scrape.yml")
DEFAULT_OUT = REPO_ROOT / "deploy" / "observability"


@dataclass(frozen=True)
class Thresholds:
    kv_cache_usage: float = 0.9  # vllm:kv_cache_usage_perc is a fraction (1 = full)
    waiting_requests: float = 16
    preemptions_per_s: float = 1.0
    ttft_p99_s: float = 2.0
    error_ratio: float = 0.05


def alert_rules(t: Thresholds = Thresholds()) -> dict:
    def alert(name: str, expr: str, for_: str, severity: str, summary: str, description: str) -> dict:
        return {
            "alert": name,
            "expr": expr,
            "for": for_,
            "labels": {"severity": severity},
            "annotations": {"summary": summary, "description": description},
        }

    who = "{{ $labels." + NAME + " }} {{ $labels." + VERSION + " }}"
    rules = [
        alert(
            "LLMServingKVCacheNearlyFull",
            f"max by ({BY}) (vllm:kv_cache_usage_perc{{{ALERT_SEL}}}) > {t.kv_cache_usage}",
            "5m", "warning",
            f"KV cache of {who} above {t.kv_cache_usage:.0%}",
            "Requests will be preempted or queue. Add replicas or lower max_num_seqs. Value: {{ $value }}.",
        ),
        alert(
            "LLMServingQueueDepthHigh",
            f"sum by ({BY}) (vllm:num_requests_waiting{{{ALERT_SEL}}}) > {t.waiting_requests:g}",
            "5m", "warning",
            f"{who}: more than {t.waiting_requests:g} requests waiting",
            "Requests wait for a free slot in the engine; the autoscaler should add replicas. Value: {{ $value }}.",
        ),
        alert(
            "LLMServingPreemptionRateHigh",
            f"sum by ({BY}) (rate(vllm:num_preemptions_total{{{ALERT_SEL}}}[5m])) > {t.preemptions_per_s:g}",
            "10m", "warning",
            f"{who}: more than {t.preemptions_per_s:g} preemptions/s",
            "The KV cache is too small for the load: preempted requests are recomputed. Value: {{ $value }}/s.",
        ),
        alert(
            "LLMServingTTFTP99High",
            f"histogram_quantile(0.99, sum by (le, {BY}) "
            f"(rate(vllm:time_to_first_token_seconds_bucket{{{ALERT_SEL}}}[5m]))) > {t.ttft_p99_s:g}",
            "10m", "critical",
            f"{who}: p99 time to first token above {t.ttft_p99_s:g} s",
            "Users wait for the first token. Check queue depth and KV-cache usage. Value: {{ $value }} s.",
        ),
        alert(
            "LLMServingErrorRateHigh",
            f"sum by ({BY}) (rate(nv_inference_request_failure{{{ALERT_SEL}}}[5m]))"
            f" / (sum by ({BY}) (rate(nv_inference_request_success{{{ALERT_SEL}}}[5m]))"
            f" + sum by ({BY}) (rate(nv_inference_request_failure{{{ALERT_SEL}}}[5m]))) > {t.error_ratio:g}",
            "5m", "critical",
            f"{who}: more than {t.error_ratio:.0%} of requests fail",
            "Triton (or the local front-ends) count failed requests by reason. Value: {{ $value }}.",
        ),
        alert(
            "LLMServingMetricsUpstreamDown",
            f"max by ({BY}) ({PREFIX}upstream_up{{{ALERT_SEL}}}) == 0",
            "2m", "warning",
            f"{who}: Triton's metrics cannot be fetched by the metrics proxy",
            "Only vLLM's metrics are served; request counts and error-rate alerts are blind. See the proxy log.",
        ),
        alert(
            "LLMServingPodDown",
            f"up{{{ALERT_SEL}}} == 0",
            "2m", "critical",
            f"{who}: a model server pod does not answer on its metrics port",
            "The pod is down or restarting (a dead engine exits so that Kubernetes restarts it).",
        ),
    ]
    return {"groups": [{"name": "llm-serving", "rules": rules}]}


@dataclass(frozen=True)
class Panel:
    title: str
    exprs: tuple[tuple[str, str], ...]  # (PromQL, legend)
    unit: str = "short"


def panels() -> list[Panel]:
    s = PANEL_SEL
    by = f"by ({BY})"
    legend = "{{" + NAME + "}} {{" + VERSION + "}}"

    def quantile(q: float, metric: str) -> str:
        return f"histogram_quantile({q}, sum by (le, {BY}) (rate({metric}_bucket{{{s}}}[$__rate_interval])))"

    return [
        Panel("Requests running / waiting", (
            (f"sum {by} (vllm:num_requests_running{{{s}}})", f"running {legend}"),
            (f"sum {by} (vllm:num_requests_waiting{{{s}}})", f"waiting {legend}"),
        )),
        Panel("KV-cache usage", ((f"max {by} (vllm:kv_cache_usage_perc{{{s}}})", legend),), "percentunit"),
        Panel("Prefix-cache hit rate", ((
            f"sum {by} (rate(vllm:prefix_cache_hits_total{{{s}}}[$__rate_interval]))"
            f" / sum {by} (rate(vllm:prefix_cache_queries_total{{{s}}}[$__rate_interval]))", legend),),
            "percentunit"),
        Panel("Preemptions / s", (
            (f"sum {by} (rate(vllm:num_preemptions_total{{{s}}}[$__rate_interval]))", legend),), "ops"),
        Panel("Time to first token", (
            (quantile(0.5, "vllm:time_to_first_token_seconds"), f"p50 {legend}"),
            (quantile(0.99, "vllm:time_to_first_token_seconds"), f"p99 {legend}"),
        ), "s"),
        Panel("Inter-token latency", (
            (quantile(0.5, "vllm:inter_token_latency_seconds"), f"p50 {legend}"),
            (quantile(0.99, "vllm:inter_token_latency_seconds"), f"p99 {legend}"),
        ), "s"),
        Panel("End-to-end request latency", (
            (quantile(0.5, "vllm:e2e_request_latency_seconds"), f"p50 {legend}"),
            (quantile(0.99, "vllm:e2e_request_latency_seconds"), f"p99 {legend}"),
        ), "s"),
        Panel("Tokens / s", (
            (f"sum {by} (rate(vllm:prompt_tokens_total{{{s}}}[$__rate_interval]))", f"prompt {legend}"),
            (f"sum {by} (rate(vllm:generation_tokens_total{{{s}}}[$__rate_interval]))", f"generated {legend}"),
        ), "short"),
        Panel("Requests / s (Triton)", (
            (f"sum {by} (rate(nv_inference_request_success{{{s}}}[$__rate_interval]))", f"ok {legend}"),
            (f"sum by ({BY}, reason) (rate(nv_inference_request_failure{{{s}}}[$__rate_interval]))",
             f"failed {{{{reason}}}} {legend}"),
        ), "reqps"),
        Panel("Average request / queue time (Triton)", (
            (f"sum {by} (rate(nv_inference_request_duration_us{{{s}}}[$__rate_interval]))"
             f" / sum {by} (rate(nv_inference_request_success{{{s}}}[$__rate_interval])) / 1e6",
             f"request {legend}"),
            (f"sum {by} (rate(nv_inference_queue_duration_us{{{s}}}[$__rate_interval]))"
             f" / sum {by} (rate(nv_inference_request_success{{{s}}}[$__rate_interval])) / 1e6",
             f"queue {legend}"),
        ), "s"),
        Panel("Pending requests (Triton)", (
            (f"sum {by} (nv_inference_pending_request_count{{{s}}})", legend),)),
        Panel("Metrics upstream up", ((f"min {by} ({PREFIX}upstream_up{{{s}}})", legend),)),
    ]


def dashboard() -> dict:
    grafana_panels = []
    for i, panel in enumerate(panels()):
        grafana_panels.append({
            "id": i + 1,
            "type": "timeseries",
            "title": panel.title,
            "datasource": {"type": "prometheus", "uid": "${datasource}"},
            "gridPos": {"h": 8, "w": 12, "x": 12 * (i % 2), "y": 8 * (i // 2)},
            "fieldConfig": {"defaults": {"unit": panel.unit}, "overrides": []},
            "targets": [
                {"refId": chr(ord("A") + j), "expr": expr, "legendFormat": legend_format}
                for j, (expr, legend_format) in enumerate(panel.exprs)
            ],
        })

    def variable(name: str, label: str, query: str) -> dict:
        return {
            "name": name, "label": label, "type": "query",
            "datasource": {"type": "prometheus", "uid": "${datasource}"},
            "query": {"query": query, "refId": name}, "definition": query,
            "includeAll": True, "multi": True, "allValue": ".*", "refresh": 2, "sort": 1,
            "current": {"text": "All", "value": "$__all"},
        }

    return {
        "uid": "llm-serving",
        "title": "LLM serving: Triton + vLLM",
        "description": "Generated by serving_image.metrics.observability; do not edit by hand.",
        "tags": ["llm-serving", "vllm", "triton"],
        "schemaVersion": 39,
        "version": 1,
        "editable": False,
        "refresh": "30s",
        "time": {"from": "now-1h", "to": "now"},
        "timezone": "utc",
        "templating": {"list": [
            {"name": "datasource", "label": "Prometheus", "type": "datasource", "query": "prometheus"},
            variable("model", "Model", f"label_values(vllm:num_requests_running{{{PART_OF}}}, {NAME})"),
            variable("version", "Version",
                     f'label_values(vllm:num_requests_running{{{PART_OF}, {NAME}=~"$model"}}, {VERSION})'),
        ]},
        "panels": grafana_panels,
    }


def scrape_config(rules_path: str = "llm-serving-alerts.yml", discovery: dict | None = None) -> dict:
    """A Prometheus configuration that scrapes port 8002 of every model-server pod and keeps the pod's §3.10
    labels as target labels (the names the dashboards and alerts select by).

    `discovery` replaces the Kubernetes service discovery (the tests give a file discovery that yields the same
    `__meta_kubernetes_*` labels, since no cluster is reachable here).
    """
    return {
        "global": {"scrape_interval": "15s", "evaluation_interval": "15s"},
        "rule_files": [rules_path],
        "scrape_configs": [{
            "job_name": "llm-serving",
            "metrics_path": "/metrics",
            **(discovery if discovery is not None else {"kubernetes_sd_configs": [{"role": "pod"}]}),
            "relabel_configs": [
                # only the platform's model servers
                {"source_labels": ["__meta_kubernetes_pod_label_app_kubernetes_io_part_of",
                                   "__meta_kubernetes_pod_label_app_kubernetes_io_component"],
                 "regex": "llm-serving;model-server", "action": "keep"},
                # only their merged metrics port (docs/architecture.md §3.2)
                {"source_labels": ["__meta_kubernetes_pod_container_port_number"], "regex": "8002",
                 "action": "keep"},
                # app.kubernetes.io/name -> app_kubernetes_io_name, and version, component, part-of
                {"regex": "__meta_kubernetes_pod_label_(app_kubernetes_io_.+)", "action": "labelmap"},
                {"source_labels": ["__meta_kubernetes_namespace"], "target_label": "namespace"},
                {"source_labels": ["__meta_kubernetes_pod_name"], "target_label": "pod"},
            ],
        }],
    }


def panel_expressions(board: dict) -> list[str]:
    return [target["expr"] for panel in board["panels"] for target in panel["targets"]]


def render_files() -> dict[Path, str]:
    """{relative path: file content} of everything generated."""
    rules = "# Generated by serving_image.metrics.observability; do not edit by hand.\n" + yaml.safe_dump(
        alert_rules(), sort_keys=False, width=1000
    )
    scrape = "# Generated by serving_image.metrics.observability; do not edit by hand.\n" + yaml.safe_dump(
        scrape_config(), sort_keys=False, width=1000
    )
    return {
        DASHBOARD_FILE: json.dumps(dashboard(), indent=2) + "\n",
        RULES_FILE: rules,
        SCRAPE_FILE: scrape,
    }


def write(out_dir: Path) -> list[Path]:
    written = []
    for relative, content in render_files().items():
        path = out_dir / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(content)
        written.append(path)
    return written


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Write the Grafana dashboard and the Prometheus alert rules")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = parser.parse_args(argv)
    for path in write(args.out):
        print(path)


if __name__ == "__main__":
    main()
