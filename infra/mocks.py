"""Answers for Pulumi's mock runtime: what AWS, Kubernetes and the image builder would return.

Only the cloud is mocked (there is no account here, docs/architecture.md §5): the program, the provider SDKs' resource
classes, their type tokens and the dependency tracking are the real ones. Each resource's mocked state is its inputs
plus the few computed outputs the program reads (ids, ARNs, endpoints, the image digest), all deterministic so that
two runs of a stack produce the same plan.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import pulumi

from infra.image_context import context_hash

ACCOUNT_ID = "123456789012"


def _short_hash(*parts: str, length: int = 17) -> str:
    return hashlib.sha256("/".join(parts).encode()).hexdigest()[:length]


class PlatformMocks(pulumi.runtime.Mocks):
    """Mocked AWS/Kubernetes/docker-build answers for one stack in one region."""

    def __init__(self, region: str, stack_outputs: dict[str, dict[str, Any]] | None = None):
        self.region = region
        # Outputs that a StackReference to another stack resolves to (the consumer example's tests set these).
        self.stack_outputs = stack_outputs or {}

    # -- invokes -------------------------------------------------------------------------------------------------
    def call(self, args: pulumi.runtime.MockCallArgs):
        token = args.token
        if token == "aws:index/getCallerIdentity:getCallerIdentity":
            return {
                "accountId": ACCOUNT_ID,
                "arn": f"arn:aws:iam::{ACCOUNT_ID}:user/plan",
                "userId": "AIDAPLAN",
                "id": ACCOUNT_ID,
            }, []
        if token == "aws:index/getRegion:getRegion":
            return {"name": self.region, "region": self.region, "id": self.region}, []
        if token == "aws:index/getPartition:getPartition":
            return {"partition": "aws", "dnsSuffix": "amazonaws.com", "id": "aws"}, []
        if token == "aws:index/getAvailabilityZones:getAvailabilityZones":
            names = [f"{self.region}{suffix}" for suffix in "abcd"]
            return {"names": names, "zoneIds": [f"{self.region[:3]}-az{i}" for i in range(1, 5)], "id": self.region}, []
        if token == "aws:ec2/getVpc:getVpc":
            return {"id": args.args.get("id"), "cidrBlock": "10.200.0.0/16", "arn": "arn:aws:ec2:vpc"}, []
        if token == "aws:ec2/getSubnets:getSubnets":
            vpc = str(args.args.get("filters", [{}])[0].get("values", ["vpc"])[0])
            return {"ids": [f"subnet-{_short_hash(vpc, str(i))}" for i in range(3)], "id": vpc}, []
        if token == "aws:ecr/getAuthorizationToken:getAuthorizationToken":
            return {
                "userName": "AWS",
                "password": "mock-ecr-token",
                "authorizationToken": "QVdTOm1vY2s=",
                "proxyEndpoint": f"https://{ACCOUNT_ID}.dkr.ecr.{self.region}.amazonaws.com",
                "id": self.region,
            }, []
        raise NotImplementedError(f"the mock runtime has no answer for invoke {token!r}; add one to infra/mocks.py")

    # -- resources -----------------------------------------------------------------------------------------------
    def new_resource(self, args: pulumi.runtime.MockResourceArgs):
        typ, name, inputs = args.typ, args.name, dict(args.inputs)
        if typ == "pulumi:pulumi:StackReference":  # a read, not a registration: `custom` is unset
            ref = inputs.get("name", name)
            if ref not in self.stack_outputs:
                raise KeyError(f"stack reference {ref!r} has no mocked outputs (have: {sorted(self.stack_outputs)})")
            return ref, {"name": ref, "outputs": self.stack_outputs[ref], "secretOutputNames": ["kubeconfig"]}
        if not args.custom:  # component resources have no provider-side state
            return f"{name}-component", inputs
        rid = f"{typ.split(':')[-1].lower()}-{_short_hash(typ, name)}"
        state = dict(inputs)
        service = typ.split(":")[1].split("/")[0] if typ.startswith("aws:") else ""
        if typ.startswith("aws:"):
            state.setdefault("arn", f"arn:aws:{service}:{self.region}:{ACCOUNT_ID}:{name}")
        extra = self._extra_state(typ, name, rid, inputs)
        state.update(extra)
        return extra.get("id", rid), state

    def _extra_state(self, typ: str, name: str, rid: str, inputs: dict) -> dict[str, Any]:
        region = self.region
        if typ == "aws:eks/cluster:Cluster":
            cluster_name = inputs.get("name", name)
            oidc = f"oidc.eks.{region}.amazonaws.com/id/{_short_hash(cluster_name, length=32).upper()}"
            return {
                "id": cluster_name,
                "name": cluster_name,
                "endpoint": f"https://{_short_hash(cluster_name, length=32).upper()}.gr7.{region}.eks.amazonaws.com",
                "certificateAuthority": {"data": "LS0tLS1CRUdJTiBDRVJUSUZJQ0FURS0tLS0t"},
                "identities": [{"oidcs": [{"issuer": f"https://{oidc}"}]}],
                "vpcConfig": {**inputs.get("vpcConfig", {}), "clusterSecurityGroupId": f"sg-{_short_hash(name)}"},
                "arn": f"arn:aws:eks:{region}:{ACCOUNT_ID}:cluster/{cluster_name}",
            }
        if typ == "aws:iam/role:Role":
            role_name = inputs.get("name", name)
            return {"name": role_name, "arn": f"arn:aws:iam::{ACCOUNT_ID}:role/{role_name}", "id": role_name}
        if typ == "aws:iam/policy:Policy":
            return {"arn": f"arn:aws:iam::{ACCOUNT_ID}:policy/{inputs.get('name', name)}"}
        if typ == "aws:iam/openIdConnectProvider:OpenIdConnectProvider":
            url = str(inputs.get("url", "")).removeprefix("https://")
            return {"arn": f"arn:aws:iam::{ACCOUNT_ID}:oidc-provider/{url}"}
        if typ == "aws:s3/bucket:Bucket":
            bucket = inputs.get("bucket", f"{name}-{_short_hash(name, length=7)}")
            return {
                "id": bucket,
                "bucket": bucket,
                "arn": f"arn:aws:s3:::{bucket}",
                "bucketRegionalDomainName": f"{bucket}.s3.{region}.amazonaws.com",
            }
        if typ == "aws:kms/key:Key":
            h = _short_hash(typ, name, region, length=32)
            key_id = f"{h[:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:32]}"
            return {"id": key_id, "keyId": key_id, "arn": f"arn:aws:kms:{region}:{ACCOUNT_ID}:key/{key_id}"}
        if typ == "aws:fsx/lustreFileSystem:LustreFileSystem":
            fs_id = f"fs-{_short_hash(name)}"
            return {
                "id": fs_id,
                "dnsName": f"{fs_id}.fsx.{region}.amazonaws.com",
                "mountName": _short_hash(name, length=8),
                "arn": f"arn:aws:fsx:{region}:{ACCOUNT_ID}:file-system/{fs_id}",
            }
        if typ == "aws:ecr/repository:Repository":
            repo_name = inputs.get("name", name)
            return {
                "id": repo_name,
                "name": repo_name,
                "repositoryUrl": f"{ACCOUNT_ID}.dkr.ecr.{region}.amazonaws.com/{repo_name}",
                "arn": f"arn:aws:ecr:{region}:{ACCOUNT_ID}:repository/{repo_name}",
                "registryId": ACCOUNT_ID,
            }
        if typ == "docker-build:index:Image":
            # Relative to the program's working directory, as docker-build resolves it (the CLI runs the program
            # from its main directory): a context that does not exist there fails the run, as the build would.
            context = Path(str((inputs.get("context") or {}).get("location", ""))).resolve()
            dockerfile = (inputs.get("dockerfile") or {}).get("location")
            if not context.is_dir():
                raise FileNotFoundError(f"docker-build context {context} does not exist (relative to the working "
                                        f"directory {Path.cwd()}, the program's main directory)")
            if dockerfile and not Path(str(dockerfile)).resolve().parent.is_dir():
                raise FileNotFoundError(f"docker-build dockerfile {dockerfile} is not under an existing directory "
                                        f"(relative to {Path.cwd()})")
            # BuildKit digests depend on layers; the plan needs one property: it changes exactly when the context does.
            digest = "sha256:" + context_hash(context, Path(str(dockerfile)).resolve() if dockerfile
                                              else context / "Dockerfile")
            tags = inputs.get("tags") or []
            ref = f"{str(tags[0]).rsplit(':', 1)[0]}@{digest}" if tags else digest
            return {"digest": digest, "ref": ref}
        if typ.startswith("aws:ec2/") and typ.split(":")[-1] in {"Vpc", "Subnet", "SecurityGroup", "InternetGateway",
                                                                   "NatGateway", "RouteTable", "Eip"}:
            prefix = {"Vpc": "vpc", "Subnet": "subnet", "SecurityGroup": "sg", "InternetGateway": "igw",
                      "NatGateway": "nat", "RouteTable": "rtb", "Eip": "eipalloc"}[typ.split(":")[-1]]
            return {"id": f"{prefix}-{_short_hash(typ, name)}"}
        if typ == "aws:ec2/launchTemplate:LaunchTemplate":
            return {"id": f"lt-{_short_hash(name)}", "latestVersion": 1, "defaultVersion": 1}
        if typ == "aws:ec2/placementGroup:PlacementGroup":
            return {"name": inputs.get("name", f"{name}-{_short_hash(name, length=7)}")}
        if typ.startswith("kubernetes:") and not typ.startswith("kubernetes:helm"):
            metadata = dict(inputs.get("metadata") or {})
            metadata.setdefault("name", name)
            return {"metadata": metadata}
        return {}


def to_config_value(value: Any) -> str:
    """Stack config as the Pulumi engine hands it to a program: strings as they are, everything else as JSON."""
    if isinstance(value, str):
        return value
    return json.dumps(value)
