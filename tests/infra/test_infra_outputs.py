"""The stack outputs' client contract (llm_serving/stack_outputs.py, docs/stack-outputs.md) and the example
consumer (examples/consumer), which resolves its endpoints through a StackReference under the mock runtime: the
referenced stack's outputs are the real outputs of the shipped serving stack's own mock run."""

from __future__ import annotations

import copy
import re
from pathlib import Path

import pytest

from infra.mockrun import REPO_ROOT, StackRunError, run_stack, shipped_run
from llm_serving.stack_outputs import StackOutputsError, parse_stack_outputs

CONSUMER = REPO_ROOT / "examples" / "consumer"
SERVING_STACK = "acme/llm-serving/prod-us-east-1"


def outputs(stack: str = "prod-us-west-2"):
    return parse_stack_outputs(shipped_run(stack).outputs)


def test_endpoint_resolution():
    out = outputs()
    assert out.endpoint("chat-large") == "https://chat-large.llm.us-west-2.internal.acme.example/v1"
    assert out.endpoint("chat-large", "grpc") == "chat-large.grpc.llm.us-west-2.internal.acme.example:443"
    assert out.endpoint("chat-large", "kserve_http") == "https://chat-large.llm.us-west-2.internal.acme.example"
    # versioned: the newest by default, any served version on request
    assert out.endpoint("ranker") == "https://ranker-4-0-0.llm.us-west-2.internal.acme.example/v1"
    assert out.endpoint("ranker", "grpc", "3.0.0") == "ranker-3-0-0.grpc.llm.us-west-2.internal.acme.example:443"


@pytest.mark.parametrize("args,message", [
    (("embed-base",), "model 'embed-base' is not served by stack prod-us-west-2 (served: ['chat-large', 'ranker'])"),
    (("ranker", "openai", "2.0.0"), "model 'ranker' does not serve version '2.0.0' in prod-us-west-2"),
    (("chat-large", "openai", "2.3.0"), "model 'chat-large' is red-black: its one endpoint serves"),
    (("chat-large", "websocket"), "protocol 'websocket' is not one of ['openai', 'grpc', 'kserve_http']"),
])
def test_lookups_that_cannot_be_answered_say_why(args, message):
    with pytest.raises(StackOutputsError) as info:
        outputs().endpoint(*args)
    assert message in str(info.value)


def test_the_schema_rejects_malformed_outputs():
    raw = copy.deepcopy(shipped_run("prod-us-east-1").outputs)
    raw["models"]["chat-large"]["routeWeights"] = {"2.3.0": 75, "2.4.0": 30}
    with pytest.raises(StackOutputsError, match="red-black routeWeights must sum to 100"):
        parse_stack_outputs(raw)
    raw = copy.deepcopy(shipped_run("prod-us-east-1").outputs)
    raw["schemaVersion"] = 2
    with pytest.raises(StackOutputsError, match="schemaVersion 2 is not supported"):
        parse_stack_outputs(raw)
    raw = copy.deepcopy(shipped_run("prod-us-east-1").outputs)
    del raw["models"]["chat-large"]["endpoints"]["grpc"]
    with pytest.raises(StackOutputsError, match="models.chat-large.endpoints.grpc: Field required"):
        parse_stack_outputs(raw)


def test_the_documented_schema_matches_the_outputs():
    """Every key of docs/stack-outputs.md's example is a key the program exports, and the other way round."""
    doc = (REPO_ROOT / "docs" / "stack-outputs.md").read_text()
    documented = set(re.findall(r"^\| `([A-Za-z_.<>\[\]]+)` \|", doc, flags=re.M))
    run = shipped_run("prod-us-west-2")
    exported = set(run.outputs)
    model = run.outputs["models"]["ranker"]
    exported |= {f"models.<id>.{k}" for k in model} | {f"models.<id>.endpoints.{k}" for k in model["endpoints"]}
    assert documented == exported


def test_the_consumer_example_resolves_its_endpoints_through_a_stack_reference():
    serving = shipped_run("prod-us-east-1")
    run = run_stack("prod-us-east-1", project=CONSUMER, stack_outputs={SERVING_STACK: serving.outputs})
    assert run.project == "llm-consumer"
    assert [r.name for r in run.of_type("pulumi:pulumi:StackReference")] == [SERVING_STACK]
    refs = [r for r in run.resources if r.type == "kubernetes:core/v1:ConfigMap"]
    assert len(refs) == 1
    data = refs[0].inputs["data"]
    assert data == {
        "CHAT_OPENAI_BASE_URL": serving.outputs["models"]["chat-large"]["endpoints"]["openai"],
        "EMBED_GRPC_TARGET": serving.outputs["models"]["embed-base"]["endpoints"]["grpc"],
        "LLM_SERVING_REGION": "us-east-1",
    }
    assert run.outputs["endpoints"]["CHAT_OPENAI_BASE_URL"] == "https://chat-large.llm.us-east-1.internal.acme.example/v1"


def test_the_consumer_fails_its_update_when_the_model_is_not_served():
    serving = shipped_run("prod-us-east-1")
    with pytest.raises(StackRunError) as info:
        run_stack("prod-us-east-1", project=CONSUMER, stack_outputs={SERVING_STACK: serving.outputs},
                  config_overrides={"models": [{"model": "ranker", "protocol": "grpc", "env": "RANKER"}]})
    assert "model 'ranker' is not served by stack prod-us-east-1 (served: ['chat-large', 'embed-base'])" in str(
        info.value)


def test_the_consumer_example_is_a_pulumi_project():
    assert (CONSUMER / "Pulumi.yaml").is_file() and (CONSUMER / "__main__.py").is_file()
    assert Path(CONSUMER / "Pulumi.prod-us-east-1.yaml").is_file()
