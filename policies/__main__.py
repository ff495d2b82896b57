"""The CrossGuard pack: `pulumi preview --policy-pack policies` (needs the Pulumi CLI and a cloud account).

Offline, the same rules run through `python -m policies.offline`; nothing else may construct the PolicyPack,
because its constructor starts the analyzer's gRPC server and blocks.
"""

from pulumi_policy import EnforcementLevel, PolicyPack

from policies.catalog import ALL_POLICIES

PolicyPack(
    name="llm-serving",
    enforcement_level=EnforcementLevel.ADVISORY,
    policies=ALL_POLICIES,
)
