"""A real Prometheus for the rehearsed pods, configured from the rendered monitoring objects.

- The PodMonitor becomes the scrape job the Prometheus Operator would generate: Kubernetes pod discovery (here a
  file the rehearsal writes, with the same `__meta_kubernetes_*` labels per pod and container port), the operator's
  own keep rules (namespace, selector labels, port name), then the PodMonitor's rendered relabelings unchanged.
- The PrometheusRule's groups are loaded as a rule file.
- A KEDA ScaledObject's Prometheus trigger query is evaluated against it (`query_value`); what KEDA and the HPA
  make of the value is rehearsal/autoscaler.py's.
"""

from __future__ import annotations

import json
import re
import subprocess
import time
import urllib.parse
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

_SNAKE = {"sourceLabels": "source_labels", "targetLabel": "target_label", "action": "action", "regex": "regex",
          "replacement": "replacement", "separator": "separator", "modulus": "modulus"}


def sanitize(label: str) -> str:
    """How Kubernetes discovery turns a label name into a Prometheus label name."""
    return re.sub(r"[^a-zA-Z0-9_]", "_", label)


def relabeling(item: dict[str, Any]) -> dict[str, Any]:
    """A PodMonitor relabeling (camelCase) as a Prometheus relabel_config (snake_case)."""
    out = {}
    for key, value in item.items():
        if key not in _SNAKE:
            raise ValueError(f"relabeling key {key!r} is not one the rehearsal translates ({sorted(_SNAKE)})")
        out[_SNAKE[key]] = value.lower() if key == "action" else value
    return out


def scrape_config(pod_monitor: dict[str, Any], targets_file: Path) -> list[dict[str, Any]]:
    """The scrape jobs the Prometheus Operator generates for one PodMonitor (one per podMetricsEndpoint)."""
    meta, spec = pod_monitor["metadata"], pod_monitor["spec"]
    jobs = []
    for i, endpoint in enumerate(spec.get("podMetricsEndpoints") or []):
        relabel = []
        namespaces = (spec.get("namespaceSelector") or {}).get("matchNames")
        if namespaces:
            relabel.append({"source_labels": ["__meta_kubernetes_namespace"], "action": "keep",
                            "regex": "|".join(re.escape(n) for n in namespaces)})
        for key, value in sorted(((spec.get("selector") or {}).get("matchLabels") or {}).items()):
            relabel.append({"source_labels": [f"__meta_kubernetes_pod_label_{sanitize(key)}",
                                              f"__meta_kubernetes_pod_labelpresent_{sanitize(key)}"],
                            "action": "keep", "regex": f"({re.escape(value)});true"})
        if endpoint.get("port"):
            relabel.append({"source_labels": ["__meta_kubernetes_pod_container_port_name"], "action": "keep",
                            "regex": re.escape(endpoint["port"])})
        relabel += [relabeling(r) for r in endpoint.get("relabelings") or []]
        job = {"job_name": f"podMonitor/{meta.get('namespace', 'default')}/{meta['name']}/{i}",
               "metrics_path": endpoint.get("path", "/metrics"),
               "file_sd_configs": [{"files": [str(targets_file)], "refresh_interval": "5s"}],
               "relabel_configs": relabel}
        if endpoint.get("interval"):
            job["scrape_interval"] = endpoint["interval"]
        jobs.append(job)
    return jobs


def pod_targets(pod: str, namespace: str, address: str, labels: dict[str, str], ports: dict[str, int],
                ready: bool) -> list[dict[str, Any]]:
    """What Kubernetes pod discovery reports for one pod: a target per container port."""
    base = {"__meta_kubernetes_namespace": namespace, "__meta_kubernetes_pod_name": pod,
            "__meta_kubernetes_pod_ip": address, "__meta_kubernetes_pod_ready": str(ready).lower()}
    for key, value in labels.items():
        base[f"__meta_kubernetes_pod_label_{sanitize(key)}"] = value
        base[f"__meta_kubernetes_pod_labelpresent_{sanitize(key)}"] = "true"
    return [{"targets": [f"{address}:{port}"],
             "labels": {**base, "__meta_kubernetes_pod_container_port_name": name,
                        "__meta_kubernetes_pod_container_port_number": str(port)}}
            for name, port in sorted(ports.items())]


def rule_file(prometheus_rules: list[dict[str, Any]]) -> dict[str, Any]:
    return {"groups": [g for rule in prometheus_rules for g in rule["spec"].get("groups") or []]}


@dataclass
class Prometheus:
    directory: Path
    port: int
    process: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def write_config(self, jobs: list[dict[str, Any]], rules: dict[str, Any], evaluation_interval: str = "5s"):
        self.directory.mkdir(parents=True, exist_ok=True)
        (self.directory / "rules.yml").write_text(json.dumps(rules, indent=1))
        config = {"global": {"scrape_interval": "15s", "evaluation_interval": evaluation_interval},
                  "rule_files": [str(self.directory / "rules.yml")], "scrape_configs": jobs}
        (self.directory / "prometheus.yml").write_text(json.dumps(config, indent=1))
        return self.directory / "prometheus.yml"

    def start(self, binary: str = "prometheus") -> None:
        log = open(self.directory / "prometheus.log", "w")  # noqa: SIM115 (closed with the process)
        self.process = subprocess.Popen(
            [binary, f"--config.file={self.directory / 'prometheus.yml'}",
             f"--storage.tsdb.path={self.directory / 'data'}", f"--web.listen-address=127.0.0.1:{self.port}"],
            stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"prometheus exited {self.process.returncode}: "
                                   f"{(self.directory / 'prometheus.log').read_text()[-2000:]}")
            try:
                with urllib.request.urlopen(f"{self.url}/-/ready", timeout=1) as r:
                    if r.status == 200:
                        return
            except OSError:
                pass
            time.sleep(0.3)
        raise RuntimeError("prometheus did not become ready within 30s")

    def api(self, path: str, **params: str) -> Any:
        query = urllib.parse.urlencode(params)
        with urllib.request.urlopen(f"{self.url}/api/v1/{path}{'?' + query if query else ''}", timeout=10) as r:
            doc = json.loads(r.read())
        if doc.get("status") != "success":
            raise RuntimeError(f"prometheus {path}: {doc}")
        return doc["data"]

    def query_value(self, expr: str) -> float | None:
        result = self.api("query", query=expr)["result"]
        if not result:
            return None
        return sum(float(r["value"][1]) for r in result)

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.process.kill()
