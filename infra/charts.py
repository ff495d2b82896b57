"""The Helm charts the program installs, pinned, and which chart installs the CRDs of which API group.

No Pulumi import: the policies (`crds-before-custom-resources`) and the tests read these tables without the runtime.
"""

from __future__ import annotations

# Helm charts, pinned (bumped only through review; `helm show chart` of each pin is what was reviewed).
CHARTS = {
    "gateway-crds": {"chart": "oci://docker.io/envoyproxy/gateway-crds-helm", "version": "v1.8.2"},
    "envoy-gateway": {"chart": "oci://docker.io/envoyproxy/gateway-helm", "version": "v1.8.2"},
    "kube-prometheus-stack": {"chart": "kube-prometheus-stack", "version": "79.10.0",
                              "repo": "https://prometheus-community.github.io/helm-charts"},
    "karpenter-crd": {"chart": "oci://public.ecr.aws/karpenter/karpenter-crd", "version": "1.8.1"},
    "karpenter": {"chart": "oci://public.ecr.aws/karpenter/karpenter", "version": "1.8.1"},
    "cert-manager": {"chart": "cert-manager", "version": "v1.18.2", "repo": "https://charts.jetstack.io"},
    "external-dns": {"chart": "external-dns", "version": "1.19.0",
                     "repo": "https://kubernetes-sigs.github.io/external-dns/"},
    # The API keys' sync from AWS Secrets Manager (infra/gateway_auth.py); 0.16 serves the external-secrets.io/v1 API.
    "external-secrets": {"chart": "external-secrets", "version": "0.16.2",
                         "repo": "https://charts.external-secrets.io"},
}
# Which chart installs the CRDs of which API group (the `crds-before-custom-resources` policy reads this table).
CRD_SOURCES = {
    "gateway.networking.k8s.io": "gateway-crds",
    "gateway.envoyproxy.io": "gateway-crds",
    "monitoring.coreos.com": "kube-prometheus-stack",
    "karpenter.sh": "karpenter-crd",
    "karpenter.k8s.aws": "karpenter-crd",
    "cert-manager.io": "cert-manager",
    "acme.cert-manager.io": "cert-manager",
    "keda.sh": "keda",  # infra/serving_platform.py
    "external-secrets.io": "external-secrets",  # infra/gateway_auth.py
}


def chart_key(chart: str) -> str | None:
    """The CHARTS key of a Helm release's `chart` value ("keda" for KEDA's, infra/serving_platform.py)."""
    if chart == "keda":
        return "keda"
    return next((k for k, spec in CHARTS.items() if spec["chart"] == chart), None)
