"""The Secrets a rendered stack's pods mount, made here (docs/rehearsal.md, "Secrets and access"): in the cloud
External Secrets syncs them from AWS Secrets Manager (infra/gateway_auth.py); the rehearsal stands in for both.
Every ExternalSecret of the rendered stack becomes its target Secret, written as a Secret volume is (one file per
data entry, read-only) under a directory of this run, with key material generated for this run alone: the secret
store's JSON object holds one key per client the stack names (every `remoteRef.property`) and the rehearsal's own
client, REHEARSAL_CLIENT, whose key the rehearsal's requests present. Nothing is written outside the run's
directory, nothing is kept.

    rendered ExternalSecrets  --plan_secrets-->  SecretsPlan (pure)  --write-->  {Secret name: host directory}
"""

from __future__ import annotations

import secrets as _random
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

EXTERNAL_SECRET = "kubernetes:external-secrets.io/v1:ExternalSecret"
REHEARSAL_CLIENT = "rehearsal-client"  # the client id the rehearsal's own requests present


class SecretsError(ValueError):
    pass


@dataclass(frozen=True)
class SecretsPlan:
    store: dict[str, dict[str, str]]  # the secret store: remote key -> its JSON object (client id -> key)
    secrets: dict[str, dict[str, str]]  # Kubernetes Secret name -> data (entry -> value)

    def client_key(self, client: str = REHEARSAL_CLIENT) -> str:
        for values in self.store.values():
            if client in values:
                return values[client]
        raise SecretsError(f"no key for client {client!r} in the rehearsal's secret store")

    def write(self, root: Path) -> dict[str, str]:
        """Each Secret as a directory of files (0444 in a 0555 directory: the pod's user reads them, nobody
        writes); returns Secret name -> directory."""
        out = {}
        for name, data in sorted(self.secrets.items()):
            directory = root / name
            directory.mkdir(parents=True)
            for entry, value in sorted(data.items()):
                path = directory / entry
                path.write_text(value)
                path.chmod(0o444)
            directory.chmod(0o555)
            out[name] = str(directory)
        return out


# The run's own credential: what every request the rehearsal makes presents (its traffic, its load, its scenarios'
# checks, its experiment), set once by Node.install when the run's Secrets are made. A rehearsal is one run per
# process, so one credential per process.
_run_plan: SecretsPlan | None = None


def use_for_requests(plan: SecretsPlan) -> None:
    global _run_plan
    _run_plan = plan


def run_key() -> str | None:
    """The rehearsal client's key, or None when the stack renders no caller authentication (no key in its store)."""
    if _run_plan is None:
        return None
    try:
        return _run_plan.client_key()
    except SecretsError:
        return None


def auth_headers() -> dict[str, str]:
    """The header (HTTP) or metadata (gRPC) that carries the run's key; empty without one."""
    from llm_serving import pod_contract as pc

    key = run_key()
    return {pc.AUTHORIZATION_HEADER: pc.bearer_value(key)} if key else {}


def plan_secrets(external_secrets: Iterable[Mapping[str, Any]],
                 new_key: Callable[[], str] = lambda: _random.token_urlsafe(32)) -> SecretsPlan:
    """The secret store and the Secrets for the rendered ExternalSecrets' inputs (`dataFrom[].extract` takes every
    property of the remote key, `data[].remoteRef` one)."""
    specs = [(str(e["metadata"]["name"]), e.get("spec") or {}) for e in external_secrets]
    store: dict[str, dict[str, str]] = {}
    for name, spec in specs:
        for item in spec.get("dataFrom") or []:
            remote = (item.get("extract") or {}).get("key")
            if not remote:
                raise SecretsError(f"ExternalSecret {name}: dataFrom {item} is not an `extract` the rehearsal makes")
            store.setdefault(remote, {})
        for item in spec.get("data") or []:
            ref = item.get("remoteRef") or {}
            if not ref.get("key") or not ref.get("property"):
                raise SecretsError(f"ExternalSecret {name}: data {item} names no remoteRef key and property")
            store.setdefault(ref["key"], {}).setdefault(ref["property"], "")
    for values in store.values():
        values.setdefault(REHEARSAL_CLIENT, "")
        for client in values:
            values[client] = new_key()
    secrets: dict[str, dict[str, str]] = {}
    for name, spec in specs:
        target = str((spec.get("target") or {}).get("name") or name)
        data = secrets.setdefault(target, {})
        for item in spec.get("dataFrom") or []:
            data.update(store[item["extract"]["key"]])
        for item in spec.get("data") or []:
            data[item["secretKey"]] = store[item["remoteRef"]["key"]][item["remoteRef"]["property"]]
    return SecretsPlan(store, secrets)
