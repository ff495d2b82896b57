"""The stack's ECR repository and the serving image, built by the program from `serving_image/Dockerfile` with the
repository root as its context (the Dockerfile copies `llm_serving/`, `native/`, ... from there), and pushed there.

Every Deployment pins the image by the digest this build reports, so a change to the image's context changes the
pod template and rolls out like any other change (docs/architecture.md §2). The tag is the context's content hash: ECR's
tags are immutable, and the same context always gets the same tag. The hash covers every file the Dockerfile copies
(infra/image_context.py).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path

import pulumi
import pulumi_aws as aws
import pulumi_docker_build as docker_build

from infra.config import TritonPin
from infra.image_context import image_tag
from llm_serving.repository import REPO_ROOT

CONTEXT = "."  # the repository root: what serving_image/Dockerfile's COPY instructions expect
DOCKERFILE = "serving_image/Dockerfile"


def from_workdir(repo_path: str) -> str:
    """A repository path as docker-build must receive it: relative to the working directory the Pulumi CLI runs the
    program in (Pulumi.yaml's `main`, infra/), e.g. `../serving_image`. Relative, so that the state does not carry
    the machine's checkout path. The same from any working directory: the CLI's (infra/) or the repository root."""
    return os.path.relpath((REPO_ROOT / repo_path).resolve(), Path.cwd().resolve())


@dataclass(frozen=True)
class ServingImageArgs:
    repository_name: str
    triton: TritonPin
    kms_key_arn: pulumi.Input[str]
    # The home region builds and replicates its repository to these regions (ECR replication). Another region
    # builds nothing: it runs the home region's digest (`home_image`, its `servingImage` output), replicated into
    # this region's repository of the same name, so every region runs the same bytes (docs/first-update.md).
    replica_regions: tuple[str, ...] = ()
    home_image: pulumi.Input[str] | None = None
    tags: dict[str, str] = field(default_factory=dict)


class ServingImage(pulumi.ComponentResource):
    repository_url: pulumi.Output[str]
    digest: pulumi.Output[str]
    image_ref: pulumi.Output[str]  # <repository>@sha256:..., what the Deployments run

    def __init__(self, name: str, args: ServingImageArgs, opts: pulumi.ResourceOptions | None = None):
        super().__init__("llm-serving:infra:ServingImage", name, None, opts)
        child = pulumi.ResourceOptions(parent=self)
        repo = aws.ecr.Repository(
            name,
            name=args.repository_name,
            image_tag_mutability="IMMUTABLE",
            image_scanning_configuration={"scan_on_push": True},
            encryption_configurations=[{"encryption_type": "KMS", "kms_key": args.kms_key_arn}],
            tags=args.tags,
            opts=child,
        )
        aws.ecr.LifecyclePolicy(name, repository=repo.name, policy=json.dumps({"rules": [{
            "rulePriority": 1, "description": "drop untagged layers after 14 days",
            "selection": {"tagStatus": "untagged", "countType": "sinceImagePushed", "countUnit": "days",
                          "countNumber": 14},
            "action": {"type": "expire"},
        }]}), opts=pulumi.ResourceOptions(parent=repo))

        self.repository_url = repo.repository_url
        if args.home_image is not None:
            digest = pulumi.Output.from_input(args.home_image).apply(lambda ref: ref.rsplit("@", 1)[1])
            self.digest = digest
            self.image_ref = pulumi.Output.all(repo.repository_url, digest).apply(lambda a: f"{a[0]}@{a[1]}")
            self.register_outputs({"repositoryUrl": self.repository_url, "imageRef": self.image_ref})
            return

        build_args = {"TRITON_IMAGE": args.triton.image}
        tag = image_tag(REPO_ROOT / CONTEXT, REPO_ROOT / DOCKERFILE, build_args, prefix=f"triton-{args.triton.release}")
        auth = aws.ecr.get_authorization_token_output(registry_id=repo.registry_id)
        image = docker_build.Image(
            name,
            context={"location": from_workdir(CONTEXT)},
            dockerfile={"location": from_workdir(DOCKERFILE)},
            platforms=["linux/amd64"],
            build_args=build_args,
            push=True,
            tags=[repo.repository_url.apply(lambda url: f"{url}:{tag}")],
            registries=[{"address": repo.repository_url, "username": auth.user_name, "password": auth.password}],
            opts=child,
        )
        if args.replica_regions:
            # Registry-wide, in the home region: every push under this repository's name is copied to the same
            # repository name in each replica region (which that region's stack created, with its own key).
            aws.ecr.ReplicationConfiguration(
                name,
                replication_configuration={"rules": [{
                    "destinations": [{"region": r, "registry_id": repo.registry_id} for r in args.replica_regions],
                    "repository_filters": [{"filter": args.repository_name, "filter_type": "PREFIX_MATCH"}],
                }]},
                opts=pulumi.ResourceOptions(parent=repo))
        self.digest = image.digest
        self.image_ref = pulumi.Output.all(repo.repository_url, image.digest).apply(lambda a: f"{a[0]}@{a[1]}")
        self.register_outputs({"repositoryUrl": self.repository_url, "imageRef": self.image_ref})
