"""The stack's network: a new VPC with private subnets in three AZs, or an existing VPC by id."""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass, field

import pulumi
import pulumi_aws as aws

AZ_COUNT = 3


@dataclass(frozen=True)
class NetworkArgs:
    cluster_name: str
    cidr: str = "10.0.0.0/16"
    vpc_id: str | None = None
    private_subnet_ids: list[str] | None = None
    tags: dict[str, str] = field(default_factory=dict)


def subnet_cidrs(cidr: str) -> tuple[list[str], list[str]]:
    """Three large private subnets (pods take IPs from them under the VPC CNI) and three small public ones (NAT)."""
    net = ipaddress.ip_network(cidr)
    quarters = list(net.subnets(prefixlen_diff=2))
    private = [str(q) for q in quarters[:AZ_COUNT]]
    public = [str(s) for s in list(quarters[3].subnets(prefixlen_diff=2))[:AZ_COUNT]]
    return private, public


class Network(pulumi.ComponentResource):
    vpc_id: pulumi.Output[str]
    private_subnet_ids: list[pulumi.Output[str]]
    availability_zones: list[pulumi.Output[str]]

    def __init__(self, name: str, args: NetworkArgs, opts: pulumi.ResourceOptions | None = None):
        super().__init__("llm-serving:infra:Network", name, None, opts)
        child = pulumi.ResourceOptions(parent=self)
        if args.vpc_id:
            self._existing(name, args)
        else:
            self._new(name, args, child)
        self.register_outputs({"vpcId": self.vpc_id, "privateSubnetIds": self.private_subnet_ids})

    def _existing(self, name: str, args: NetworkArgs) -> None:
        vpc = aws.ec2.get_vpc_output(id=args.vpc_id)
        self.vpc_id = vpc.id
        self.private_subnet_ids = [pulumi.Output.from_input(s) for s in args.private_subnet_ids or []]
        self.availability_zones = []

    def _new(self, name: str, args: NetworkArgs, child: pulumi.ResourceOptions) -> None:
        azs = aws.get_availability_zones_output(state="available")
        zone_names = [azs.names.apply(lambda names, i=i: names[i]) for i in range(AZ_COUNT)]
        private_cidrs, public_cidrs = subnet_cidrs(args.cidr)
        vpc = aws.ec2.Vpc(f"{name}-vpc", cidr_block=args.cidr, enable_dns_hostnames=True, enable_dns_support=True,
                          tags={**args.tags, "Name": f"{name}-vpc"}, opts=child)
        igw = aws.ec2.InternetGateway(f"{name}-igw", vpc_id=vpc.id, tags=args.tags, opts=child)
        public_rt = aws.ec2.RouteTable(f"{name}-public", vpc_id=vpc.id, tags=args.tags,
                                       routes=[{"cidr_block": "0.0.0.0/0", "gateway_id": igw.id}], opts=child)
        cluster_tag = {f"kubernetes.io/cluster/{args.cluster_name}": "shared"}
        self.private_subnet_ids = []
        for i in range(AZ_COUNT):
            public = aws.ec2.Subnet(
                f"{name}-public-{i}", vpc_id=vpc.id, cidr_block=public_cidrs[i], availability_zone=zone_names[i],
                map_public_ip_on_launch=False,
                tags={**args.tags, **cluster_tag, "Name": f"{name}-public-{i}", "kubernetes.io/role/elb": "1"},
                opts=child)
            aws.ec2.RouteTableAssociation(f"{name}-public-{i}", subnet_id=public.id, route_table_id=public_rt.id,
                                          opts=child)
            # One NAT gateway per AZ: losing an AZ must not cut the other AZs' nodes off ECR and the EKS API.
            eip = aws.ec2.Eip(f"{name}-nat-{i}", domain="vpc", tags=args.tags, opts=child)
            nat = aws.ec2.NatGateway(f"{name}-nat-{i}", subnet_id=public.id, allocation_id=eip.id, tags=args.tags,
                                     opts=child)
            private = aws.ec2.Subnet(
                f"{name}-private-{i}", vpc_id=vpc.id, cidr_block=private_cidrs[i], availability_zone=zone_names[i],
                tags={**args.tags, **cluster_tag, "Name": f"{name}-private-{i}",
                      "kubernetes.io/role/internal-elb": "1"},
                opts=child)
            rt = aws.ec2.RouteTable(f"{name}-private-{i}", vpc_id=vpc.id, tags=args.tags,
                                    routes=[{"cidr_block": "0.0.0.0/0", "nat_gateway_id": nat.id}], opts=child)
            aws.ec2.RouteTableAssociation(f"{name}-private-{i}", subnet_id=private.id, route_table_id=rt.id,
                                          opts=child)
            self.private_subnet_ids.append(private.id)
        self.vpc_id = vpc.id
        self.availability_zones = zone_names
