"""The stack outputs' client contract (llm_serving/stack_outputs.py, docs/stack-outputs.md) and the example
consumer (examples/consumer), which resolves its endpoints through a StackReference under the mock runtime: the
referenced stack's outputs are the real outputs of the shipped serving stack's own mock run."""

from __future__ import annotations

import copy
import json
import re
from pathlib import Path

import pytest

from infra.mockrun import REPO_ROOT, StackRunError, run_stack, shipped_run
from llm_serving.stack_outputs import BatchCache, StackOutputsError, parse_stack_outputs

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
    raw["schemaVersion"] = 3
    with pytest.raises(StackOutputsError, match=r"schemaVersion 3 is not supported \(this client reads 1, 2\)"):
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
    exported |= {f"experiments.<name>.{k}" for e in run.outputs["experiments"].values() for k in e}
    # The batch block is optional and rendered by the batch path: documented by its schema's keys.
    exported |= {"batch.endpoint"} | {f"batch.cache.{k}" for k in BatchCache.model_fields}
    assert documented == exported


def _v2_outputs():
    return copy.deepcopy(shipped_run("prod-us-west-2").outputs)


def test_version_2_carries_experiments_and_in_process_marks():
    out = parse_stack_outputs(_v2_outputs())
    assert out.schema_version == 2 and out.batch is None
    arms = out.experiment("chat-temperature").arms
    assert [(a.name, a.percent, a.parameters) for a in arms] == [("control", 90, {}), ("cool", 10,
                                                                                       {"temperature": 0.2})]
    ranker = out.model("ranker").in_process
    assert ranker is not None and sorted(ranker.versions) == ["3.0.0", "4.0.0"]
    # The caller loads from its own region's bucket, the replica of the home region's key.
    assert ranker.versions["4.0.0"].package == "s3://acme-llm-prod-us-west-2/models/model-cache/ranker/4.0.0/"
    assert out.model("chat-large").in_process is None
    with pytest.raises(StackOutputsError, match=r"experiment 'x' is not declared in stack prod-us-west-2 "
                                                r"\(declared: \['chat-temperature'\]\)"):
        out.experiment("x")


def test_a_version_1_document_still_reads_without_the_new_blocks():
    raw = copy.deepcopy(shipped_run("prod-us-east-1").outputs)
    raw["schemaVersion"] = 1
    raw.pop("experiments")
    for model in raw["models"].values():
        model.pop("inProcess")
    out = parse_stack_outputs(raw)
    assert out.experiments == {} and all(m.in_process is None for m in out.models.values())
    raw["experiments"] = {}
    with pytest.raises(StackOutputsError, match=r"schemaVersion 1 has no \['experiments'\]"):
        parse_stack_outputs(raw)


@pytest.mark.parametrize("change,message", [
    (lambda raw: raw["experiments"]["chat-temperature"]["arms"][1].update(percent=20),
     "experiments.chat-temperature.arms: percentages sum to 110, not 100"),
    (lambda raw: raw["experiments"]["chat-temperature"]["arms"][1].update(model="chat-huge"),
     "experiments.chat-temperature.arms[cool].model: 'chat-huge' is not served"),
    (lambda raw: raw["experiments"]["chat-temperature"]["arms"][1].update(version="2.3.0"),
     "experiments.chat-temperature.arms[cool].version: 'chat-large' is red-black"),
    (lambda raw: raw["experiments"]["chat-temperature"]["arms"][1].update(model="ranker", version="2.0.0"),
     "'ranker' does not serve '2.0.0' (served: ['3.0.0', '4.0.0'])"),
    (lambda raw: raw["models"]["chat-large"].update(inProcess=raw["models"]["ranker"]["inProcess"]),
     "inProcess: only a python model runs in the caller's process, not kind vllm"),
    (lambda raw: raw.update(batch={"endpoint": "http://batch/v1", "cache": {"bucket": "b-1", "prefix": "",
                                                                             "region": "us-west-2"}}),
     "batch.endpoint: String should match pattern"),
])
def test_the_schema_names_a_bad_experiment_or_block(change, message):
    raw = _v2_outputs()
    change(raw)
    with pytest.raises(StackOutputsError) as info:
        parse_stack_outputs(raw)
    assert message in str(info.value)


def test_a_batch_block_parses():
    raw = _v2_outputs()
    raw["batch"] = {"endpoint": "https://batch.llm.us-west-2.internal.acme.example/v1",
                    "cache": {"bucket": "acme-llm-batch-prod-us-west-2", "prefix": "cache/", "region": "us-west-2"}}
    assert parse_stack_outputs(raw).batch.cache.prefix == "cache/"


def test_the_consumer_example_resolves_its_endpoints_through_a_stack_reference():
    serving = shipped_run("prod-us-east-1")
    run = run_stack("prod-us-east-1", project=CONSUMER, stack_outputs={SERVING_STACK: serving.outputs})
    assert run.project == "llm-consumer"
    assert [r.name for r in run.of_type("pulumi:pulumi:StackReference")] == [SERVING_STACK]
    refs = [r for r in run.resources if r.type == "kubernetes:core/v1:ConfigMap"]
    assert len(refs) == 1
    data = dict(refs[0].inputs["data"])
    # The document llm_serving_client reads at run time: the serving stack's client contract, as it exported it.
    document = json.loads(data.pop("stack-outputs.json"))
    assert parse_stack_outputs(document) == parse_stack_outputs(serving.outputs)
    assert document["schemaVersion"] == 2 and "kubeconfig" not in document
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
