"""The analysis gate between rollout steps, and the idle-version check, read from Prometheus' HTTP API
(`GET /api/v1/query`, instant queries). Series are selected by the §3.10 labels as the platform's scrape config
keeps them (`app_kubernetes_io_name`, `app_kubernetes_io_version`), with the metric names of §3.8 (Triton's request
counters; vLLM's end-to-end latency histogram for an LLM, Triton's request duration for the other kinds).
"""

from __future__ import annotations

import json
import math
import re
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
    """Requests served over `window`. Triton creates the success counter when it loads the model, so a version
    without it has no data (the query returns nothing); the failure counter appears on first use (absent: 0)."""
    s = _sel(model_id, version)
    return (f"sum(increase(nv_inference_request_success{{{s}}}[{window}])) + "
            + _or0(f"sum(increase(nv_inference_request_failure{{{s}}}[{window}]))"))


_DURATION_UNITS = {"ms": 0.001, "s": 1, "m": 60, "h": 3600, "d": 86400, "w": 604800, "y": 31536000}
_DURATION = re.compile(r"(\d+)(ms|s|m|h|d|w|y)")


def duration_seconds(window: str) -> float:
    """A Prometheus duration ("7d", "1h30m", "30s") in seconds; anything else is refused, naming it."""
    parts = _DURATION.findall(window) if isinstance(window, str) else []
    if not parts or "".join(n + u for n, u in parts) != window or not any(int(n) for n, _ in parts):
        raise ValueError(f"{window!r} is not a Prometheus duration such as 30s, 10m, 7d or 1h30m")
    return sum(int(n) * _DURATION_UNITS[u] for n, u in parts)


def coverage_step(window: str) -> str:
    """The subquery resolution of the coverage checks: a sample at least every minute (Prometheus' 5 min lookback
    then spans any gap it can see), finer for short windows so that they still get about 60 points."""
    return f"{max(1, min(60, int(duration_seconds(window) // 60)))}s"


def scraped_query(model_id: str, version: str, window: str) -> str:
    """1 when every one of the version's scrape targets answered (`up` 1) at every step of `window`; 0 when, at some
    step, it had no target or one was down (a broken PodMonitor, a Prometheus restart, a retention shorter than the
    window all read as 0)."""
    return f"min_over_time((min(up{{{_sel(model_id, version)}}}) or vector(0))[{window}:{coverage_step(window)}])"


def counter_query(model_id: str, version: str, window: str) -> str:
    """1 or more when the version's success counter has a series at every step of `window`; 0 when it lacked one at
    some step (a relabeling or a rename that drops it)."""
    sel = _sel(model_id, version)
    return (f"min_over_time((count(nv_inference_request_success{{{sel}}}) or vector(0))"
            f"[{window}:{coverage_step(window)}])")


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
    if requests is None:
        return GateResult(False, None, None, None,
                          f"no request counter (nv_inference_request_success) for {model_id} {version} in {t.window}")
    if requests < t.min_requests:
        return GateResult(False, requests, None, None,
                          f"{requests:.0f} requests in {t.window}, fewer than the {t.min_requests:g} needed to "
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


@dataclass(frozen=True)
class IdleEvidence:
    """What Prometheus shows about one version over the idle window. `idle` only when proven: its pods were scraped
    for the whole window, its request counter existed throughout, and it served nothing. `missing` names the series
    that lacked data; with any of them missing the version is not idle, whatever the request count reads."""

    version: str
    window: str
    requests: float | None
    missing: tuple[str, ...] = ()

    @property
    def idle(self) -> bool:
        return not self.missing and self.requests == 0

    def describe(self) -> str:
        if self.missing:
            return f"{self.version} (not proven idle in {self.window}: no data for {'; '.join(self.missing)})"
        if self.requests is None:
            return f"{self.version} (not proven idle in {self.window}: no request count)"
        return f"{self.version} ({self.requests:.0f} requests)"


def idle_evidence(client: PrometheusClient, model_id: str, version: str, window: str) -> IdleEvidence:
    """Is `version` of `model_id` proven idle over `window`? Missing or partial data never reads as idle."""
    sel = _sel(model_id, version)
    missing = []
    if (client.scalar(scraped_query(model_id, version, window)) or 0) < 1:
        missing.append(f"up{{{sel}}} (every target scraped for the whole {window})")
    if (client.scalar(counter_query(model_id, version, window)) or 0) < 1:
        missing.append(f"nv_inference_request_success{{{sel}}} (a series for the whole {window})")
    requests = client.scalar(requests_query(model_id, version, window))
    if requests is None and not missing:
        missing.append(f"nv_inference_request_success{{{sel}}} (its increase over {window})")
    return IdleEvidence(version, window, requests, tuple(missing))
