"""Parity with `pulumi preview --policy-pack policies`: the analyzer path gives the same findings as the runner.

The Pulumi CLI cannot be installed here, so this drives pulumi_policy's own analyzer servicer (the object the
PolicyPack's gRPC server dispatches to; building it starts nothing) with the protobuf requests the CLI would send:
the stack's name and config in the environment (PULUMI_STACK, PULUMI_CONFIG, as the CLI starts a policy pack), each
resource's properties as a protobuf Struct, custom timeouts in seconds, and no policy config. It runs in a fresh
interpreter because the analyzer configures Pulumi's process-wide runtime settings.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

from llm_serving.repository import REPO_ROOT
from policies.compat import DEFAULT_PATH as DEFAULT_COMPAT

SCRIPT = r'''
import json, os, sys
from google.protobuf import json_format, struct_pb2
from pulumi.runtime import proto
from pulumi_policy import EnforcementLevel
from pulumi_policy.policy import _PolicyAnalyzerServicer
from policies._props import duration_seconds
from policies.catalog import ALL_POLICIES, by_name
from policies.offline import evaluate
from tests.infra.policy_support import compliant_stack, inputs_of

stack = compliant_stack("prod-us-east-1")
inputs_of(stack, "gpu")["instanceTypes"] = ["g4dn.xlarge"]          # resource rule, needs the env from the stack
stack.remove("models-pab")                                           # stack rule, joins side resources
stack.models()[0]["loadTimeSeconds"] = 1800                          # resource rule, reads the models from config
stack.get("llama-v1").custom_timeouts.update(update="5m")            # resource rule, reads custom timeouts
inputs_of(stack, "model-cache-fs")["tags"] = {"team": "ml-platform"}  # advisory
# Stack rule reading the real serving_image/compat.toml (no policy config under the CLI): an old release.
inputs_of(stack, "serving-image")["buildArgs"] = {"TRITON_IMAGE_TAG": "24.01-vllm-python-py3"}

os.environ.update(
    PULUMI_PROJECT=stack.project, PULUMI_STACK=stack.stack, PULUMI_DRY_RUN="true",
    PULUMI_CONFIG=json.dumps({k: v if isinstance(v, str) else json.dumps(v) for k, v in stack.config.items()}),
)
servicer = _PolicyAnalyzerServicer("llm-serving", "0.1.0", ALL_POLICIES, EnforcementLevel.ADVISORY)


def struct(inputs):
    return json_format.ParseDict(inputs, struct_pb2.Struct())


def options(r):
    t = r.custom_timeouts or {}
    timeouts = proto.AnalyzerResourceOptions.CustomTimeouts(
        **{k: duration_seconds(t[k]) for k in ("create", "update", "delete") if k in t})
    return proto.AnalyzerResourceOptions(customTimeouts=timeouts) if t else proto.AnalyzerResourceOptions()


found = set()
for r in stack.resources:
    response = servicer.Analyze(proto.AnalyzeRequest(type=r.type, properties=struct(r.inputs), urn=r.urn,
                                                     name=r.name, options=options(r)), None)
    for d in response.diagnostics:
        found.add((d.policyName, d.urn or r.urn, d.message.split("\n", 1)[1]))
    assert not [d for d in response.diagnostics if "can't run policy" in d.message], response.diagnostics
stack_request = proto.AnalyzeStackRequest(resources=[
    proto.AnalyzerResource(type=r.type, properties=struct(r.inputs), urn=r.urn, name=r.name, options=options(r),
                           parent=r.parent or "", dependencies=r.dependencies)
    for r in stack.resources])
for d in servicer.AnalyzeStack(stack_request, None).diagnostics:
    found.add((d.policyName, d.urn, d.message.split("\n", 1)[1]))

offline = {(f.policy, f.urn or "", f.message) for f in evaluate(stack.resources, stack.stack, stack.project,
                                                                 stack.config) if f.enforcement != "not applicable"}
print(json.dumps({"analyzer": sorted(found), "offline": sorted(offline)}))
'''


def test_analyzer_and_offline_runner_agree():
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    for key in ("PULUMI_CONFIG", "PULUMI_STACK", "PULUMI_PROJECT"):
        env.pop(key, None)
    proc = subprocess.run([sys.executable, "-c", SCRIPT], cwd=REPO_ROOT, env=env, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    analyzer = {tuple(x) for x in result["analyzer"]}
    offline = {tuple(x) for x in result["offline"]}
    assert analyzer == offline
    expected = {"gpu-nodes-approved-instance-types", "s3-public-access-block", "serving-probes",
                "serving-update-timeout", "cost-allocation-tags"}
    if DEFAULT_COMPAT.is_file():  # before the file existed the pin rule was not applicable, on both paths
        expected.add("serving-image-pins")
    assert {p for p, _, _ in analyzer} == expected
