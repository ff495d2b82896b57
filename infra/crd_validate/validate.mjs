// Validates custom resources against their CRDs' JSON schemas, with the validators that @kubernetes-models
// generates from the upstream CRDs (Gateway API v1, KEDA v2, Prometheus Operator v1: PodMonitor, PrometheusRule;
// Karpenter v1: NodePool, EC2NodeClass; cert-manager v1: ClusterIssuer, Certificate; Envoy Gateway v1alpha1:
// BackendTrafficPolicy, ClientTrafficPolicy, SecurityPolicy; External Secrets v1: SecretStore, ExternalSecret).
// Reads a JSON array of manifests on stdin and prints a JSON array of {index, kind, name, errors}: a kind this file
// does not know is an error, never a pass.
import { Certificate } from "@kubernetes-models/cert-manager/cert-manager.io/v1/Certificate";
import { ClusterIssuer } from "@kubernetes-models/cert-manager/cert-manager.io/v1/ClusterIssuer";
import { BackendTrafficPolicy } from "@kubernetes-models/envoy-gateway/gateway.envoyproxy.io/v1alpha1/BackendTrafficPolicy";
import { ClientTrafficPolicy } from "@kubernetes-models/envoy-gateway/gateway.envoyproxy.io/v1alpha1/ClientTrafficPolicy";
import { SecurityPolicy } from "@kubernetes-models/envoy-gateway/gateway.envoyproxy.io/v1alpha1/SecurityPolicy";
import { ExternalSecret } from "@kubernetes-models/external-secrets/external-secrets.io/v1/ExternalSecret";
import { SecretStore } from "@kubernetes-models/external-secrets/external-secrets.io/v1/SecretStore";
import { Gateway } from "@kubernetes-models/gateway-api/gateway.networking.k8s.io/v1/Gateway";
import { GatewayClass } from "@kubernetes-models/gateway-api/gateway.networking.k8s.io/v1/GatewayClass";
import { GRPCRoute } from "@kubernetes-models/gateway-api/gateway.networking.k8s.io/v1/GRPCRoute";
import { HTTPRoute } from "@kubernetes-models/gateway-api/gateway.networking.k8s.io/v1/HTTPRoute";
import { EC2NodeClass } from "@kubernetes-models/karpenter/karpenter.k8s.aws/v1/EC2NodeClass";
import { NodePool } from "@kubernetes-models/karpenter/karpenter.sh/v1/NodePool";
import { ScaledObject } from "@kubernetes-models/keda/keda.sh/v1alpha1/ScaledObject";
import { PodMonitor } from "@kubernetes-models/prometheus-operator/monitoring.coreos.com/v1/PodMonitor";
import { PrometheusRule } from "@kubernetes-models/prometheus-operator/monitoring.coreos.com/v1/PrometheusRule";

const MODELS = new Map(
  [Gateway, GatewayClass, GRPCRoute, HTTPRoute, ScaledObject, PodMonitor, PrometheusRule, NodePool, EC2NodeClass,
    ClusterIssuer, Certificate, BackendTrafficPolicy, ClientTrafficPolicy, SecurityPolicy, ExternalSecret,
    SecretStore]
    .map((m) => [`${m.apiVersion}/${m.kind}`, m]),
);

let input = "";
for await (const chunk of process.stdin) input += chunk;
const results = JSON.parse(input).map((manifest, index) => {
  const key = `${manifest.apiVersion}/${manifest.kind}`;
  const name = manifest.metadata?.name ?? "";
  const Model = MODELS.get(key);
  if (!Model) {
    return { index, kind: manifest.kind, name, errors: [`no CRD schema for ${key} (known: ${[...MODELS.keys()].join(", ")})`] };
  }
  try {
    new Model(manifest).validate();
    return { index, kind: manifest.kind, name, errors: [] };
  } catch (err) {
    const details = (err.errors ?? []).map((e) => `${e.instancePath || "<root>"}: ${e.message}${e.params ? " " + JSON.stringify(e.params) : ""}`);
    return { index, kind: manifest.kind, name, errors: details.length ? details : [String(err.message ?? err)] };
  }
});
process.stdout.write(JSON.stringify(results));
