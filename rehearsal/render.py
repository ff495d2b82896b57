"""What Pulumi would create for a stack: the program run under the mock runtime (infra/mockrun.py, in .venv-infra,
whose Pulumi SDKs this environment cannot hold), and the resources the rehearsal brings up from it."""

from __future__ import annotations

import json
import os
import subprocess
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from llm_serving.repository import REPO_ROOT

DEPLOYMENT = "kubernetes:apps/v1:Deployment"
SERVICE = "kubernetes:core/v1:Service"
POD_MONITOR = "kubernetes:monitoring.coreos.com/v1:PodMonitor"
PROMETHEUS_RULE = "kubernetes:monitoring.coreos.com/v1:PrometheusRule"
SCALED_OBJECT = "kubernetes:keda.sh/v1alpha1:ScaledObject"
DRA = "aws:fsx/dataRepositoryAssociation:DataRepositoryAssociation"
NODE_GROUP = "aws:eks/nodeGroup:NodeGroup"
MODEL_SERVER = "model-server"
BUCKET = "aws:s3/bucket:Bucket"
# The Deployments whose pods the rehearsal runs, by their app.kubernetes.io/component: the model servers and the
# batch workers (infra/batch.py, one per LLM). Every stack update waits for each of them as the provider does, so a
# rendered Deployment the rehearsal did not run would fail any update that touches it.
BATCH_WORKER = "batch-worker"
POD_COMPONENTS = (MODEL_SERVER, BATCH_WORKER)

_RENDER = ("import json, sys\n"
           "from infra.mockrun import run_stack, stackrun_to_dict\n"
           "print(json.dumps(stackrun_to_dict(run_stack(sys.argv[1])), default=str))\n")


class RenderError(RuntimeError):
    pass


@dataclass
class Rendered:
    stack: str
    config: dict[str, Any]  # the stack's config, `llm-serving:<key>` -> value
    resources: list[dict[str, Any]]  # {type, name, urn, inputs, ...}
    outputs: dict[str, Any] = field(default_factory=dict)

    def of_type(self, type_token: str) -> list[dict[str, Any]]:
        return [r for r in self.resources if r["type"] == type_token]

    def model_deployments(self) -> list[dict[str, Any]]:
        return [d for d in self.of_type(DEPLOYMENT) if component(d["inputs"]) == MODEL_SERVER]

    def pod_deployments(self) -> list[dict[str, Any]]:
        """Every Deployment whose pods the rehearsal runs (POD_COMPONENTS): the model servers, then the rest."""
        return self.model_deployments() + [d for d in self.of_type(DEPLOYMENT)
                                           if component(d["inputs"]) in POD_COMPONENTS
                                           and component(d["inputs"]) != MODEL_SERVER]

    def buckets(self) -> list[str]:
        """The S3 buckets the program creates (the model bucket, the batch bucket, ...)."""
        return sorted({b["inputs"]["bucket"] for b in self.of_type(BUCKET) if b["inputs"].get("bucket")})

    def services_for(self, deployment: dict[str, Any]) -> list[dict[str, Any]]:
        labels = deployment["inputs"]["spec"]["template"]["metadata"]["labels"]
        namespace = deployment["inputs"]["metadata"].get("namespace")
        return [s for s in self.of_type(SERVICE)
                if s["inputs"]["metadata"].get("namespace") == namespace and selects(
                    s["inputs"]["spec"].get("selector") or {}, labels)]

    def model_services(self) -> list[dict[str, Any]]:
        seen, out = set(), []
        for dep in self.model_deployments():
            for svc in self.services_for(dep):
                if svc["urn"] not in seen:
                    seen.add(svc["urn"])
                    out.append(svc)
        return out

    @property
    def models(self) -> list[dict[str, Any]]:
        return list(self.config.get("llm-serving:models") or [])

    def bucket(self, region: str | None = None) -> str:
        storage = self.config["llm-serving:modelStorage"]
        return f"{storage['bucketPrefix']}-{self.config['llm-serving:environment']}-{region or self.region}"

    @property
    def region(self) -> str:
        return self.config["aws:region"]

    @property
    def home_region(self) -> str:
        return self.config["llm-serving:homeRegion"]

    @property
    def model_prefix(self) -> str:
        return (self.config["llm-serving:modelStorage"].get("modelPrefix") or "models/")


def component(inputs: dict[str, Any]) -> str | None:
    """A resource's app.kubernetes.io/component label (model-server, batch-worker, ...)."""
    return ((inputs.get("metadata") or {}).get("labels") or {}).get("app.kubernetes.io/component")


def selects(selector: dict[str, str], labels: dict[str, str]) -> bool:
    """A Kubernetes equality selector (matchLabels or a Service's selector)."""
    return bool(selector) and all(labels.get(k) == v for k, v in selector.items())


def render(stack: str, infra_python: Path | None = None, timeout: float = 600) -> Rendered:
    python = infra_python or REPO_ROOT / ".venv-infra" / "bin" / "python"
    if not python.exists():
        raise RenderError(f"{python} does not exist: the Pulumi program runs in .venv-infra (make infra-env)")
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    proc = subprocess.run([str(python), "-c", _RENDER, stack], capture_output=True, text=True, cwd=REPO_ROOT,
                          env=env, timeout=timeout)
    if proc.returncode != 0:
        raise RenderError(f"stack {stack}: the program under the mock runtime failed:\n{proc.stderr[-3000:]}")
    doc = json.loads(proc.stdout.strip().splitlines()[-1])
    return Rendered(doc["stack"], doc["config"], doc["resources"], doc.get("outputs") or {})
