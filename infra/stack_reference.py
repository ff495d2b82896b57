"""Resolve a model's endpoint from a serving stack, for client services' own Pulumi programs.

    serving = ServingStack("acme/llm-serving/prod-us-east-1")
    base_url = serving.endpoint("chat-large", "openai")        # Output[str]

The outputs are validated against the client contract (llm_serving.stack_outputs, docs/stack-outputs.md) when
they resolve: a model the stack does not serve, an unknown protocol or a pinned version of a red-black model fails
the consumer's update with a message naming what exists, instead of deploying a client with a wrong address.
Only the client-facing outputs are read (`get_output` per key), so a secret infrastructure output such as the
kubeconfig does not make the endpoints secret.
"""

from __future__ import annotations

import pulumi

from llm_serving.stack_outputs import CLIENT_KEYS, StackOutputs, parse_stack_outputs


class ServingStack:
    def __init__(self, stack_name: str, opts: pulumi.ResourceOptions | None = None):
        self.reference = pulumi.StackReference(stack_name, opts=opts)
        values = {key: self.reference.get_output(key) for key in CLIENT_KEYS}
        self.outputs: pulumi.Output[StackOutputs] = pulumi.Output.all(**values).apply(parse_stack_outputs)

    def endpoint(self, model_id: str, protocol: str = "openai", version: str | None = None) -> pulumi.Output[str]:
        return self.outputs.apply(lambda outputs: outputs.endpoint(model_id, protocol, version))

    def region(self) -> pulumi.Output[str]:
        return self.outputs.apply(lambda outputs: outputs.region)

    def client_document(self) -> pulumi.Output[str]:
        """The client contract as the JSON document a running service reads (llm_serving_client's discovery,
        docs/clients.md, "Discovery"): validated here, so a client is never deployed with a document it would refuse."""
        return self.outputs.apply(lambda outputs: outputs.model_dump_json(by_alias=True, indent=1))
