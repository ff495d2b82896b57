"""What KEDA and the Kubernetes HPA controller do with one rendered ScaledObject, poll by poll.

Pure and deterministic: the caller injects the time, the query's value and the Deployment's replicas; nothing here
reads a clock, sleeps or queries Prometheus. One `poll` stands for one HPA sync reading KEDA's metric (the HPA syncs
every 15 s by default, which is the pollingInterval infra/serving.py renders). The decision is taken as applied: the
next poll's `current_replicas` is what the Deployment's `spec.replicas` is then, normally this decision's replicas.
Standard library only, so that .venv-infra imports it too (tests/infra/test_autoscaler_stack.py).

Where each rule comes from:

- Kubernetes, "Horizontal Pod Autoscaling" (kubernetes.io/docs/tasks/run-application/horizontal-pod-autoscale/),
  "Algorithm details": desired = ceil(current * currentMetricValue / desiredMetricValue), with an average value
  target the metric is averaged over the target's current replicas, and no scaling while the ratio is within the
  tolerance (0.1 by default, kube-controller-manager's `--horizontal-pod-autoscaler-tolerance`).
  "Configurable scaling behavior": policies limit the change over their periodSeconds; selectPolicy Max (the
  default) takes the policy allowing the largest change, Min the smallest, Disabled none; a scale-down takes the
  highest recommendation within its stabilization window, a scale-up the lowest within its own; unset fields take
  the defaults (scale-up: window 0, Percent 100 and Pods 4 per 15 s, Max; scale-down: window 300 s, Percent 100 per
  15 s).
- The HPA controller's source (kubernetes/kubernetes pkg/controller/podautoscaler), for what the page leaves open:
  for an External AverageValue metric the ratio is value / (target * current) and the desired count
  ceil(value / target) (replica_calculator.go, GetExternalPerPodMetricReplicas); a scale-up Percent limit rounds up,
  a scale-down one truncates, and a policy's period starts from the replicas before the scale events the HPA itself
  made within it; windows and periods count what is strictly newer than their start; the bounds clamp after the
  policies; a current count outside [min, max] is set to the bound before any metric is read; and a metric that
  cannot be read changes nothing and records no recommendation (horizontal.go).
- KEDA, "ScaledObject specification" (keda.sh/docs/2.17/reference/scaledobject-spec/, KEDA 2.17 is the chart
  infra/serving_platform.py installs): `advanced.horizontalPodAutoscalerConfig.behavior` is the HPA's behavior as
  is; cooldownPeriod applies only to scaling to zero, which a minReplicaCount of 1 or more rules out; `fallback`:
  once a trigger's consecutive failures pass failureThreshold, KEDA hands the HPA target * replicas, where the
  replicas are fallback.replicas (`static`, the default), the current replicas (`currentReplicas`), or the higher
  (`currentReplicasIfHigher`) or lower (`currentReplicasIfLower`) of the two. KEDA's pkg/fallback/fallback.go: "pass"
  is strictly more (the first fallback is on failed poll failureThreshold + 1), and the target in that product is
  truncated to an integer. Since kedacore/keda#6520 (in 2.17) KEDA's own loop no longer jumps to fallback.replicas
  on the first error, so the fallback reaches the Deployment only through the HPA: its tolerance, windows and
  policies apply to it.
- KEDA, "Prometheus" scaler (keda.sh/docs/2.13/scalers/prometheus/): `ignoreNullValues` defaults to true, which
  reads an empty result as 0; "false" makes it the scaler's error. The scaler's source
  (pkg/scalers/prometheus_scaler.go, ExecutePromQuery) does so still, and treats a NaN or infinite value the same way.

Not modelled (a spec that needs them is refused by name): scaling to or from zero (activation thresholds,
cooldownPeriod, idleReplicaCount), more than one trigger, scalingModifiers, the HPA's per-direction tolerance. Nor:
KEDA's milli-unit rounding of the metric; how often a real KEDA counts a failure (here once per poll; KEDA counts
each failed read of the scaler, and its own loop may read it besides the HPA's requests: not confirmed); pods that
are not ready (no part in an External metric); a Deployment that does not reach the replicas it was given (the
caller's `current_replicas` says so).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

TOLERANCE = 0.1  # kube-controller-manager's --horizontal-pod-autoscaler-tolerance default
FALLBACK_BEHAVIORS = ("static", "currentReplicas", "currentReplicasIfHigher", "currentReplicasIfLower")
SELECT_POLICIES = ("Max", "Min", "Disabled")
POLICY_TYPES = ("Pods", "Percent")


@dataclass(frozen=True)
class Policy:
    type: str  # Pods or Percent
    value: int
    period_s: int

    def __str__(self) -> str:
        return f"{self.type} {self.value}{'%' if self.type == 'Percent' else ''}/{self.period_s}s"


@dataclass(frozen=True)
class Rules:
    """One direction of the HPA's behavior."""
    window_s: int
    policies: tuple[Policy, ...]
    select: str


DEFAULT_SCALE_UP = Rules(0, (Policy("Percent", 100, 15), Policy("Pods", 4, 15)), "Max")
DEFAULT_SCALE_DOWN = Rules(300, (Policy("Percent", 100, 15),), "Max")


@dataclass(frozen=True)
class Fallback:
    failure_threshold: int
    replicas: int
    behavior: str

    def replicas_for(self, current: int) -> int:
        return {"static": self.replicas, "currentReplicas": current,
                "currentReplicasIfHigher": max(current, self.replicas),
                "currentReplicasIfLower": min(current, self.replicas)}[self.behavior]


@dataclass(frozen=True)
class Decision:
    replicas: int
    reason: str


def _fields(where: str, doc: Any, allowed: tuple[str, ...]) -> dict[str, Any]:
    if not isinstance(doc, dict):
        raise ValueError(f"{where}: expected a mapping, got {doc!r}")
    unknown = sorted(set(doc) - set(allowed))
    if unknown:
        raise ValueError(f"{where}.{unknown[0]}: not modelled by rehearsal/autoscaler.py (it models {list(allowed)})")
    return doc


def _int(where: str, value: Any, low: int = 0) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ValueError(f"{where}: expected an integer >= {low}, got {value!r}")
    return value


def _choice(where: str, value: Any, choices: tuple[str, ...]) -> str:
    if value not in choices:
        raise ValueError(f"{where}: {value!r} is not modelled (it models {list(choices)})")
    return value


def _rules(where: str, doc: dict[str, Any] | None, default: Rules) -> Rules:
    """The API server's defaulting: what a direction leaves unset is the default's."""
    if doc is None:
        return default
    doc = _fields(where, doc, ("stabilizationWindowSeconds", "selectPolicy", "policies"))
    policies = []
    for i, item in enumerate(doc.get("policies") or []):
        at = f"{where}.policies[{i}]"
        item = _fields(at, item, ("type", "value", "periodSeconds"))
        policies.append(Policy(_choice(f"{at}.type", item.get("type"), POLICY_TYPES),
                               _int(f"{at}.value", item.get("value"), 1),
                               _int(f"{at}.periodSeconds", item.get("periodSeconds"), 1)))
    return Rules(_int(f"{where}.stabilizationWindowSeconds", doc.get("stabilizationWindowSeconds", default.window_s)),
                 tuple(policies) or default.policies,
                 _choice(f"{where}.selectPolicy", doc.get("selectPolicy", default.select), SELECT_POLICIES))


@dataclass
class Autoscaler:
    target: str  # the Deployment it scales
    query: str  # the caller evaluates it (at the trigger's serverAddress, which is not kept)
    threshold: float
    min_replicas: int
    max_replicas: int
    polling_interval_s: int
    ignore_null_values: bool
    scale_up: Rules
    scale_down: Rules
    fallback: Fallback | None
    tolerance: float = TOLERANCE
    _failures: int = field(default=0, init=False, repr=False)
    _recommendations: list[tuple[float, int]] = field(default_factory=list, init=False, repr=False)
    _up_events: list[tuple[float, int]] = field(default_factory=list, init=False, repr=False)
    _down_events: list[tuple[float, int]] = field(default_factory=list, init=False, repr=False)

    @classmethod
    def from_scaled_object(cls, spec: dict[str, Any]) -> Autoscaler:
        """From a rendered ScaledObject's `spec`; a field it does not model is refused by name."""
        spec = _fields("spec", spec, ("scaleTargetRef", "minReplicaCount", "maxReplicaCount", "pollingInterval",
                                      "cooldownPeriod", "advanced", "fallback", "triggers"))
        ref = _fields("spec.scaleTargetRef", spec.get("scaleTargetRef"), ("apiVersion", "kind", "name"))
        if not ref.get("name"):
            raise ValueError("spec.scaleTargetRef.name: missing")
        # Scaling to and from zero is KEDA's own (activation, cooldownPeriod), not the HPA's: not modelled.
        minimum = _int("spec.minReplicaCount", spec.get("minReplicaCount", 0), 1)
        maximum = _int("spec.maxReplicaCount", spec.get("maxReplicaCount", 100), minimum)
        _int("spec.cooldownPeriod", spec.get("cooldownPeriod", 300))  # no effect with minReplicaCount >= 1
        advanced = _fields("spec.advanced", spec.get("advanced") or {}, ("horizontalPodAutoscalerConfig",))
        at = "spec.advanced.horizontalPodAutoscalerConfig"
        hpa = _fields(at, advanced.get("horizontalPodAutoscalerConfig") or {}, ("behavior",))
        behavior = _fields(f"{at}.behavior", hpa.get("behavior") or {}, ("scaleUp", "scaleDown"))
        fallback = None
        if "fallback" in spec:
            fb = _fields("spec.fallback", spec["fallback"], ("failureThreshold", "replicas", "behavior"))
            fallback = Fallback(_int("spec.fallback.failureThreshold", fb.get("failureThreshold")),
                                _int("spec.fallback.replicas", fb.get("replicas")),
                                _choice("spec.fallback.behavior", fb.get("behavior", "static"), FALLBACK_BEHAVIORS))
        triggers = spec.get("triggers") or []
        if len(triggers) != 1:
            raise ValueError(f"spec.triggers: one trigger is modelled, got {len(triggers)}")
        trigger = _fields("spec.triggers[0]", triggers[0], ("type", "metricType", "metadata"))
        _choice("spec.triggers[0].type", trigger.get("type"), ("prometheus",))
        _choice("spec.triggers[0].metricType", trigger.get("metricType", "AverageValue"), ("AverageValue",))
        meta = _fields("spec.triggers[0].metadata", trigger.get("metadata"),
                       ("serverAddress", "query", "threshold", "ignoreNullValues"))
        for key in ("serverAddress", "query", "threshold"):
            if key not in meta:
                raise ValueError(f"spec.triggers[0].metadata.{key}: missing")
        try:
            threshold = float(meta["threshold"])
        except ValueError:
            threshold = math.nan
        if not threshold > 0:
            raise ValueError(f"spec.triggers[0].metadata.threshold: expected a number > 0, got {meta['threshold']!r}")
        return cls(
            target=ref["name"], query=meta["query"], threshold=threshold,
            min_replicas=minimum, max_replicas=maximum,
            polling_interval_s=_int("spec.pollingInterval", spec.get("pollingInterval", 30), 1),
            ignore_null_values=_choice("spec.triggers[0].metadata.ignoreNullValues",
                                       meta.get("ignoreNullValues", "true"), ("true", "false")) == "true",
            scale_up=_rules(f"{at}.behavior.scaleUp", behavior.get("scaleUp"), DEFAULT_SCALE_UP),
            scale_down=_rules(f"{at}.behavior.scaleDown", behavior.get("scaleDown"), DEFAULT_SCALE_DOWN),
            fallback=fallback)

    def poll(self, now_s: float, value: float | None, current_replicas: int) -> Decision:
        """One HPA sync at `now_s` with the query's `value` (None: the query returned no series)."""
        if current_replicas > self.max_replicas:
            return self._apply(now_s, current_replicas, self.max_replicas, "above maxReplicaCount")
        if current_replicas < self.min_replicas:
            return self._apply(now_s, current_replicas, self.min_replicas, "below minReplicaCount")
        metric, source = self._metric(value, current_replicas)
        if metric is None:
            return Decision(current_replicas, source)
        ratio = metric / (self.threshold * current_replicas)
        if abs(1.0 - ratio) <= self.tolerance:
            desired, reason = current_replicas, "within tolerance"
        else:
            desired, reason = math.ceil(metric / self.threshold), f"ceil({metric:g} / {self.threshold:g})"
        stabilized = self._stabilize(now_s, desired, current_replicas)
        if stabilized != desired:
            reason = f"stabilized (scale-{'down' if desired < current_replicas else 'up'} window)"
        replicas, limited = self._limit(now_s, stabilized, current_replicas)
        return self._apply(now_s, current_replicas, replicas, ", ".join(filter(None, (source, limited or reason))))

    def _metric(self, value: float | None, current: int) -> tuple[float | None, str]:
        """KEDA's side: the value the HPA gets, or None (the scaler's error, no fallback yet), and where it came
        from when it is not the query's."""
        if value is not None and math.isfinite(value):
            self._failures = 0
            return value, ""
        if self.ignore_null_values:
            self._failures = 0
            return 0.0, "no value read as 0 (ignoreNullValues true)"
        self._failures += 1
        if self.fallback is None:
            return None, f"no metric (failed poll {self._failures}, no fallback): no change"
        if self._failures <= self.fallback.failure_threshold:
            return None, (f"no metric (failed poll {self._failures}, fallback after "
                          f"{self.fallback.failure_threshold}): no change")
        # KEDA's fallback.go: the target truncated to an integer, times the replicas.
        return (math.trunc(self.threshold) * self.fallback.replicas_for(current),
                f"fallback: {self.fallback.behavior} after {self._failures} failed polls")

    def _stabilize(self, now: float, desired: int, current: int) -> int:
        up_start, down_start = now - self.scale_up.window_s, now - self.scale_down.window_s
        self._recommendations = [(t, r) for t, r in self._recommendations if t > min(up_start, down_start)]
        up = min([desired] + [r for t, r in self._recommendations if t > up_start])
        down = max([desired] + [r for t, r in self._recommendations if t > down_start])
        self._recommendations.append((now, desired))
        return min(max(current, up), down)

    def _limit(self, now: float, desired: int, current: int) -> tuple[int, str]:
        """The policies' rate, then the bounds; the reason when either changed the count."""
        if desired > current:
            limit, why = self._policy_limit(now, current, self.scale_up, up=True)
            limit = max(limit, current)
            if self.max_replicas > limit:
                return (limit, why) if desired > limit else (desired, "")
            return (self.max_replicas, "clamped to maxReplicaCount") if desired > self.max_replicas else (desired, "")
        if desired < current:
            limit, why = self._policy_limit(now, current, self.scale_down, up=False)
            limit = min(limit, current)
            if self.min_replicas < limit:
                return (limit, why) if desired < limit else (desired, "")
            return (self.min_replicas, "clamped to minReplicaCount") if desired < self.min_replicas else (desired, "")
        return desired, ""

    def _policy_limit(self, now: float, current: int, rules: Rules, up: bool) -> tuple[int, str]:
        if rules.select == "Disabled":
            return current, f"scale-{'up' if up else 'down'} disabled (selectPolicy Disabled)"
        proposals = []
        for policy in rules.policies:
            start = (current - sum(c for t, c in self._up_events if t > now - policy.period_s)
                     + sum(c for t, c in self._down_events if t > now - policy.period_s))
            if up:
                proposed = (start + policy.value if policy.type == "Pods"
                            else math.ceil(start * (1 + policy.value / 100)))
            else:
                proposed = (start - policy.value if policy.type == "Pods"
                            else math.trunc(start * (1 - policy.value / 100)))
            proposals.append((proposed, policy))
        # Max selects the policy allowing the largest change (the highest limit up, the lowest down), Min the smallest.
        pick = max if (rules.select == "Max") == up else min
        proposed, policy = pick(proposals, key=lambda p: p[0])
        return proposed, f"limited by policy {policy}"

    def _apply(self, now: float, current: int, replicas: int, reason: str) -> Decision:
        """The HPA's scale events, which its policies' periods count."""
        longest = max(p.period_s for p in (*self.scale_up.policies, *self.scale_down.policies))
        self._up_events = [(t, c) for t, c in self._up_events if t > now - longest]
        self._down_events = [(t, c) for t, c in self._down_events if t > now - longest]
        if replicas > current:
            self._up_events.append((now, replicas - current))
        elif replicas < current:
            self._down_events.append((now, current - replicas))
        return Decision(replicas, reason)
