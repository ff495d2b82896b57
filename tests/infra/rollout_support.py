"""Helpers for the rollout tests: copies of the shipped stack files, and a Prometheus HTTP API with canned answers.

Why canned answers: the analysis gate needs, per region, a Prometheus that holds a GPU fleet's request counters and
latency histograms for a candidate version; no such fleet exists here, and making a real Prometheus hold given
error ratios per region takes one server per region and many seconds of scraping per scenario. The real PromQL of
the gate runs on Debian's Prometheus in test_rollout_gate.py; the scenario tests only need each region's verdict,
so this server answers `/api/v1/query` (Prometheus' documented JSON shape) per region prefix
(`/<stack>/api/v1/query`, as behind a route prefix), choosing the value by the kind of query the gate sends.
"""

from __future__ import annotations

import json
import re
import shutil
import threading
import urllib.parse
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

from llm_serving.repository import REPO_ROOT

STACKS = REPO_ROOT / "stacks"


def copy_stacks(dest: Path) -> Path:
    dest.mkdir(parents=True, exist_ok=True)
    for path in STACKS.glob("Pulumi.*.yaml"):
        shutil.copy(path, dest / path.name)
    return dest


@dataclass
class Health:
    """What one version looks like in one region's Prometheus."""

    requests: float = 1000.0
    error_ratio: float = 0.0
    latency_s: float = 1.5
    scraped: bool = True  # its targets up and its request counter present for the whole window (the idle proof)


@dataclass
class CannedPrometheus:
    # (stack, model id, version) -> Health; anything unlisted has no series at all
    series: dict[tuple[str, str, str], Health] = field(default_factory=dict)
    queries: list[tuple[str, str]] = field(default_factory=list)  # (stack, promql) as received

    def start(self) -> str:
        canned = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):  # keep pytest output clean
                pass

            def do_GET(self):  # noqa: N802
                url = urllib.parse.urlsplit(self.path)
                stack, _, rest = url.path.strip("/").partition("/")
                if rest != "api/v1/query":
                    self.send_error(404)
                    return
                promql = urllib.parse.parse_qs(url.query)["query"][0]
                canned.queries.append((stack, promql))
                name = re.search(r'app_kubernetes_io_name="([^"]+)"', promql).group(1)
                version = re.search(r'app_kubernetes_io_version="([^"]+)"', promql).group(1)
                health = canned.series.get((stack, name, version))
                if health is None:
                    value = 0.0 if "vector(0)" in promql and "/" not in promql else None
                elif promql.startswith("min_over_time("):  # the idle proof's coverage (gate.scraped_query ...)
                    value = 1.0 if health.scraped else 0.0
                elif promql.startswith("histogram_quantile"):
                    value = health.latency_s
                elif "increase(" in promql:
                    value = health.requests
                else:
                    value = health.error_ratio
                result = [] if value is None else [{"metric": {}, "value": [1764400000.0, repr(value)]}]
                body = json.dumps({"status": "success", "data": {"resultType": "vector", "result": result}})
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.end_headers()
                self.wfile.write(body.encode())

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        return f"http://127.0.0.1:{self.server.server_address[1]}"

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()
