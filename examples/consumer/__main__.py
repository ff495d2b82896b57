"""An example client service's Pulumi program: it takes the LLM endpoints it calls from the serving stack's
outputs (docs/stack-outputs.md) and hands them to its pods as a ConfigMap, so a model moving to another hostname
or region is one `pulumi up` of the client, never an edited constant. The ConfigMap also holds the whole client
contract as `stack-outputs.json`, the file llm_serving_client reads at run time (docs/clients.md, "Discovery"):
its experiments, in-process marks and every model's routes."""

import pulumi
import pulumi_kubernetes as k8s

from infra.stack_reference import ServingStack

config = pulumi.Config()
serving = ServingStack(config.require("servingStack"))
wanted = config.require_object("models")  # [{model, protocol, env, version?}]

endpoints = {
    item["env"]: serving.endpoint(item["model"], item.get("protocol", "openai"), item.get("version"))
    for item in wanted
}
k8s.core.v1.ConfigMap(
    "llm-endpoints",
    metadata={"name": "llm-endpoints", "namespace": config.require("namespace"),
              "labels": {"app.kubernetes.io/part-of": "search", "app.kubernetes.io/managed-by": "pulumi"}},
    data={**endpoints, "LLM_SERVING_REGION": serving.region(), "stack-outputs.json": serving.client_document()},
)
pulumi.export("endpoints", endpoints)
