"""The Gateway's retry policy (its BackendTrafficPolicy, docs/rehearsal.md, "Rollouts under load") in
HAProxy's terms: the one place that knows both Envoy Gateway's retry triggers and what HAProxy's `retry-on` can do,
so that haproxy_config.py writes a RetryPolicy without reading the rendered policy.

Envoy Gateway's `retry` becomes, in every backend, `retries <numRetries>`, `retry-on` with HAProxy's names for the
triggers (`connect-failure` -> conn-failure, `reset` -> empty-response (the pod closed or reset the connection without
an answer), `retriable-status-codes` -> the `httpStatusCodes`, `5xx`, `gateway-error`) and `option redispatch 1`, so
that every retry goes to another server when there is one, as Envoy Gateway's retry policy does (its `previous_hosts`
predicate), and `option http-buffer-request` (HAProxy retries only a request it holds whole, so it reads the body
before choosing a server; Envoy buffers a request for its retries too). HAProxy retries only before any byte of the
answer went to the client, as Envoy does. What HAProxy cannot do is refused by name: gRPC-status triggers (the status
comes in trailers, after the answer began), `retriable-4xx`, `refused-stream`, `reset-before-request`, status codes
outside HAProxy's `retry-on` list, a per-retry timeout or back-off. A policy's `timeout` section (idle connection
timeouts, pod_contract.py) is connection management, which HAProxy does its own way here (`timeout server`, one
request per HTTP/1.1 client connection): read, not realised. Without a policy a failed attempt is the client's
failure (`retries 0`), as with Envoy's default route.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from rehearsal.gateway_routes import Gateway, ProxyConfigError, resource_name, resource_spec

BACKEND_TRAFFIC_POLICY = "kubernetes:gateway.envoyproxy.io/v1alpha1:BackendTrafficPolicy"


@dataclass(frozen=True)
class RetryPolicy:
    """A Gateway-wide retry policy, in HAProxy's terms."""

    retries: int
    retry_on: tuple[str, ...]  # HAProxy's `retry-on` keywords and status codes
    source: str  # the BackendTrafficPolicy it comes from


ENVOY_DEFAULT_RETRIES = 2  # Envoy Gateway's numRetries when the policy gives none
_HAPROXY_RETRY_STATUSES = frozenset({401, 403, 404, 408, 425, 500, 501, 502, 503, 504})  # what `retry-on` accepts
_TRIGGER_STATUSES = {"5xx": (500, 501, 502, 503, 504), "gateway-error": (502, 503, 504)}
_TRIGGER_KEYWORDS = {"connect-failure": ("conn-failure",), "reset": ("empty-response",)}
_POLICY_KEYS = {"targetRefs", "targetRef", "retry", "timeout"}


def retry_from_rendered(resources: Iterable[Mapping[str, Any]], gateway: Gateway) -> RetryPolicy | None:
    """The retry policy of the BackendTrafficPolicy attached to `gateway` (None when there is none, or it has no
    `retry`); a policy attached to anything else, or asking for what HAProxy cannot do, is refused by name."""
    found: list[RetryPolicy] = []
    for resource in resources:
        if resource.get("type") != BACKEND_TRAFFIC_POLICY:
            continue
        name = resource_name(resource)
        spec = resource_spec(resource)
        extra = sorted(set(spec) - _POLICY_KEYS)
        if extra:
            raise ProxyConfigError(f"BackendTrafficPolicy {name}: {', '.join(extra)} not realised (retry only)")
        targets = spec.get("targetRefs") or ([spec["targetRef"]] if spec.get("targetRef") else [])
        if not targets or any(t.get("kind") != "Gateway" or t.get("name") != gateway.name for t in targets):
            raise ProxyConfigError(f"BackendTrafficPolicy {name}: only a policy attached to Gateway {gateway.name} "
                                   f"is realised (targets {[(t.get('kind'), t.get('name')) for t in targets]})")
        retry = spec.get("retry")
        if retry is None:
            continue
        unknown = sorted(set(retry) - {"numRetries", "retryOn"})
        if unknown:
            raise ProxyConfigError(f"BackendTrafficPolicy {name}: retry.{', retry.'.join(unknown)} not realised "
                                   "(HAProxy has no per-retry timeout or back-off)")
        retry_on = retry.get("retryOn") or {}
        triggers = list(retry_on.get("triggers") or [])
        statuses = [int(c) for c in retry_on.get("httpStatusCodes") or []]
        keywords: list[str] = []
        for trigger in triggers:
            if trigger in _TRIGGER_KEYWORDS:
                keywords += _TRIGGER_KEYWORDS[trigger]
            elif trigger in _TRIGGER_STATUSES:
                statuses += _TRIGGER_STATUSES[trigger]
            elif trigger != "retriable-status-codes":
                raise ProxyConfigError(f"BackendTrafficPolicy {name}: retry trigger {trigger!r} is not realised "
                                       "(connect-failure, reset, retriable-status-codes, 5xx, gateway-error)")
        if statuses and "retriable-status-codes" not in triggers and not set(triggers) & set(_TRIGGER_STATUSES):
            raise ProxyConfigError(f"BackendTrafficPolicy {name}: httpStatusCodes without the "
                                   "retriable-status-codes trigger retry nothing in Envoy; refused as a likely mistake")
        if "retriable-status-codes" in triggers and not retry_on.get("httpStatusCodes"):
            raise ProxyConfigError(f"BackendTrafficPolicy {name}: retriable-status-codes without httpStatusCodes")
        refused = sorted(set(statuses) - _HAPROXY_RETRY_STATUSES)
        if refused:
            raise ProxyConfigError(f"BackendTrafficPolicy {name}: HAProxy cannot retry on status {refused} "
                                   f"(it can on {sorted(_HAPROXY_RETRY_STATUSES)})")
        if not keywords and not statuses:
            raise ProxyConfigError(f"BackendTrafficPolicy {name}: a retry policy without a trigger")
        count = int(retry.get("numRetries", ENVOY_DEFAULT_RETRIES))
        if count < 0:
            raise ProxyConfigError(f"BackendTrafficPolicy {name}: numRetries {count} is negative")
        ordered = tuple(dict.fromkeys(keywords)) + tuple(str(c) for c in sorted(set(statuses)))
        found.append(RetryPolicy(count, ordered, name))
    if len(found) > 1:
        raise ProxyConfigError(f"Gateway {gateway.name}: {len(found)} BackendTrafficPolicies with a retry "
                               f"({', '.join(p.source for p in found)}); Envoy Gateway would take the oldest")
    return found[0] if found else None
