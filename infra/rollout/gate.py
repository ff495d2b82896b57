"""The analysis gate between rollout steps, and the idle-version check, read from Prometheus' HTTP API
(`GET /api/v1/query`, instant queries). Series are selected by the §3.10 labels as the platform's scrape config
keeps them (`app_kubernetes_io_name`, `app_kubernetes_io_version`), with the metric names of §3.8 (Triton's request
counters; vLLM's end-to-end latency histogram for an LLM, Triton's request duration for the other kinds).
"""

from __future__ import annotations

import json
import math
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass

NAME = "app_kubernetes_io_name"
VERSION = "app_kubernetes_io_version"


class PrometheusError(RuntimeError):
    """Prometheus could not answer (unreachable, HTTP error, or an error in its JSON response)."""


@dataclass(frozen=True)
class PrometheusClient:
    base_url: str  # e.g. http://prometheus-operated.monitoring.svc:9090 (a route prefix, if any, included)
    timeout_s: float = 10.0

    def query(self, promql: str) -> list[tuple[dict, float]]:
        """An instant query; returns (labels, value) for each series of the resulting vector (or the scalar)."""
        url = f"{self.base_url.rstrip('/')}/api/v1/query?{urllib.parse.urlencode({'query': promql})}"
        try:
            with urllib.request.urlopen(url, timeout=self.timeout_s) as resp:
                body = json.loads(resp.read())
        except urllib.error.HTTPError as err:
            # Prometheus answers 400/422/503 with a JSON body naming the error.
            try:
                detail = json.loads(err.read()).get("error", "")
            except (ValueError, AttributeError):
                detail = ""
            raise PrometheusError(f"{self.base_url}: HTTP {err.code} for {promql!r}: {detail}") from None
        except (urllib.error.URLError, TimeoutError, ValueError) as err:
            raise PrometheusError(f"{self.base_url}: query {promql!r} failed: {err}") from None
        if body.get("status") != "success":
            raise PrometheusError(f"{self.base_url}: {body.get('errorType')}: {body.get('error')} ({promql!r})")
        data = body["data"]
        if data["resultType"] == "scalar":
            return [({}, float(data["result"][1]))]
        if data["resultType"] != "vector":
            raise PrometheusError(f"{self.base_url}: expected a vector for {promql!r}, got {data['resultType']}")
        return [(item["metric"], float(item["value"][1])) for item in data["result"]]

    def scalar(self, promql: str) -> float | None:
        """The single value of an aggregated query, or None when no series matched (no data)."""
        result = self.query(promql)
        if len(result) > 1:
            raise PrometheusError(f"{self.base_url}: {promql!r} returned {len(result)} series, expected one")
        if not result or math.isnan(result[0][1]):
            return None
        return result[0][1]


def _sel(model_id: str, version: str) -> str:
    return f'{NAME}="{model_id}", {VERSION}="{version}"'


def _or0(expr: str) -> str:
    # A counter that was never incremented for this version may have no series at all (Triton creates the failure
    # counter per reason on first use): count it as zero instead of letting `+` drop the whole result.
    return f"({expr} or vector(0))"


def requests_query(model_id: str, version: str, window: str) -> str:
    s = _sel(model_id, version)
    return (_or0(f"sum(increase(nv_inference_request_success{{{s}}}[{window}]))") + " + "
            + _or0(f"sum(increase(nv_inference_request_failure{{{s}}}[{window}]))"))


def error_ratio_query(model_id: str, version: str, window: str) -> str:
    s = _sel(model_id, version)
    failures = _or0(f"sum(rate(nv_inference_request_failure{{{s}}}[{window}]))")
    successes = _or0(f"sum(rate(nv_inference_request_success{{{s}}}[{window}]))")
    return f"{failures} / ({successes} + {failures})"


def latency_query(model_id: str, version: str, window: str, quantile: float, kind: str = "vllm") -> str:
    """An LLM's (kind vllm) `quantile` of vLLM's end-to-end latency histogram; any other kind (no vLLM engine in its
    pod, so no histogram) Triton's mean request duration over the window, in seconds: Triton exports cumulative
    duration counters and no latency quantiles."""
    s = _sel(model_id, version)
    if kind == "vllm":
        buckets = f"rate(vllm:e2e_request_latency_seconds_bucket{{{s}}}[{window}])"
        return f"histogram_quantile({quantile}, sum by (le) ({buckets}))"
    return (f"sum(rate(nv_inference_request_duration_us{{{s}}}[{window}])) / "
            f"sum(rate(nv_inference_request_success{{{s}}}[{window}])) / 1e6")


def latency_label(kind: str, quantile: float) -> str:
    return f"p{quantile * 100:g} latency" if kind == "vllm" else "mean latency"


@dataclass(frozen=True)
class GateThresholds:
    max_error_ratio: float = 0.05  # the platform's error-rate alert threshold
    max_latency_s: float = 30.0  # end-to-end request latency at `quantile`
    quantile: float = 0.95
    window: str = "10m"
    min_requests: float = 1  # fewer requests than this in the window: not enough evidence, the gate fails


@dataclass(frozen=True)
class GateResult:
    passed: bool
    requests: float | None
    error_ratio: float | None
    latency_s: float | None
    reason: str

    def describe(self) -> str:
        def fmt(v: float | None, spec: str) -> str:
            return "no data" if v is None else format(v, spec)

        return (f"{'pass' if self.passed else 'FAIL'}: requests {fmt(self.requests, '.0f')}, errors "
                f"{fmt(self.error_ratio, '.2%')}, latency {fmt(self.latency_s, '.2f')}s"
                + ("" if self.passed else f" ({self.reason})"))


def analyze(client: PrometheusClient, model_id: str, version: str, t: GateThresholds,
            kind: str = "vllm") -> GateResult:
    """Does `version` of `model_id` (a model of `kind`, which says where its latency comes from: latency_query) serve
    within the thresholds over the last `t.window`?"""
    requests = client.scalar(requests_query(model_id, version, t.window))
    if requests is None or requests < t.min_requests:
        return GateResult(False, requests, None, None,
                          f"{requests or 0:.0f} requests in {t.window}, fewer than the {t.min_requests:g} needed to "
                          f"judge {model_id} {version}")
    ratio = client.scalar(error_ratio_query(model_id, version, t.window))
    latency = client.scalar(latency_query(model_id, version, t.window, t.quantile, kind))
    reasons = []
    if ratio is None:
        reasons.append(f"no error-ratio data for {model_id} {version}")
    elif ratio > t.max_error_ratio:
        reasons.append(f"error ratio {ratio:.2%} above {t.max_error_ratio:.2%}")
    if latency is None:
        source = ("histogram (vllm:e2e_request_latency_seconds)" if kind == "vllm"
                  else "data (Triton's nv_inference_request_duration_us)")
        reasons.append(f"no latency {source} for {model_id} {version}")
    elif latency > t.max_latency_s:
        reasons.append(f"{latency_label(kind, t.quantile)} {latency:.2f}s above {t.max_latency_s:g}s")
    return GateResult(not reasons, requests, ratio, latency, "; ".join(reasons))


def request_count(client: PrometheusClient, model_id: str, version: str, window: str) -> float:
    """Requests `version` served over `window` (0 when no series exist: a version nobody has called)."""
    return client.scalar(requests_query(model_id, version, window)) or 0.0
