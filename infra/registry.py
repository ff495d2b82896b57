"""The stack's ECR repository and the serving image, built by the program from `serving_image/` and pushed there.

Every Deployment pins the image by the digest this build reports, so a change to the image's context changes the
pod template and rolls out like any other change (docs/architecture.md §2). The tag is the context's content hash: ECR's
tags are immutable, and the same context always gets the same tag.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import pulumi
import pulumi_aws as aws
import pulumi_docker_build as docker_build

from infra.config import TritonPin
from infra.image_context import context_hash

REPO_ROOT = Path(__file__).resolve().parent.parent
CONTEXT = "serving_image"
DOCKERFILE = "serving_image/Dockerfile"  # written by the serving-image issue; the plan only needs its path


@dataclass(frozen=True)
class ServingImageArgs:
    repository_name: str
    triton: TritonPin
    kms_key_arn: pulumi.Input[str]
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

        tag = f"triton-{args.triton.release}-{context_hash(REPO_ROOT / CONTEXT)[:16]}"
        auth = aws.ecr.get_authorization_token_output(registry_id=repo.registry_id)
        image = docker_build.Image(
            name,
            context={"location": CONTEXT},
            dockerfile={"location": DOCKERFILE},
            platforms=["linux/amd64"],
            build_args={"TRITON_IMAGE": args.triton.image},
            push=True,
            tags=[repo.repository_url.apply(lambda url: f"{url}:{tag}")],
            registries=[{"address": repo.repository_url, "username": auth.user_name, "password": auth.password}],
            opts=child,
        )
        self.repository_url = repo.repository_url
        self.digest = image.digest
        self.image_ref = pulumi.Output.all(repo.repository_url, image.digest).apply(lambda a: f"{a[0]}@{a[1]}")
        self.register_outputs({"repositoryUrl": self.repository_url, "imageRef": self.image_ref})
