"""Does a model fit what its stack gives it: its weights and KV cache in the GPUs' memory a pod gets, and the reading
of its weights from the model cache (FSx for Lustre) within its startup budget (`loadTimeSeconds`).

The stack declares the sizes (`versions[].weightsGib`, `kvCacheGib`; docs/first-update.md, "Pods fit nodes"); the
schema (`infra.config`) checks them with these functions before any resource exists, and names every number in its
message. No Pulumi import: the schema, the rollout tool and the policies use it without the runtime.
"""

from __future__ import annotations

from dataclasses import dataclass

from infra.instances import INSTANCE_FACTS
from llm_serving.pod_contract import engine_memory_shares

# vLLM's default `gpu_memory_utilization` (pc.ENGINE_MEMORY_BUDGET, 0.9): an engine takes this fraction of each
# GPU's memory for the weights, the activations and the KV cache, and leaves the rest to CUDA and other processes.
# A package starts one engine per task (the stack's `tasks`): together they get this much, in equal shares that the
# Deployment renders (pc.ENV_ENGINE_MEMORY) and the serving side writes as each engine's gpu_memory_utilization.
# A model that is not vLLM (a Python-backend model on a GPU) has no such budget: the GPUs' whole memory.
OTHER_GPU_MEMORY_UTILIZATION = 1.0

# FSx for Lustre PERSISTENT_2: throughput is perUnitStorageThroughput MB/s per TiB of storage. MB here is 10^6 bytes
# (AWS's unit), which also keeps the estimate on the slow side of a reading in MiB.
MB = 10**6
GIB = 2**30
# The engine's own start after the weights are read (vLLM's memory profiling, CUDA graph capture, the front-ends):
# an allowance, not a measurement, added to the reading time before it is compared with loadTimeSeconds.
ENGINE_STARTUP_ALLOWANCE_S = 120


@dataclass(frozen=True)
class GpuMemoryFit:
    weights_gib: float
    kv_cache_gib: float
    gpus: int
    gpu_memory_gib: int  # per GPU, of the pool's type with the least
    instance_type: str
    utilization: float  # what all the pod's engines together may take of each GPU (the sum of their shares)
    # A vllm package's tasks: one engine each (serving_image/triton/models.py), each loading the weights; empty for a
    # model that runs no vLLM engine (its weights are loaded once).
    tasks: tuple[str, ...] = ()

    @property
    def engines(self) -> int:
        return max(1, len(self.tasks))

    @property
    def need_gib(self) -> float:
        return self.engines * self.weights_gib + self.kv_cache_gib

    @property
    def budget_gib(self) -> float:
        return self.gpus * self.gpu_memory_gib * self.utilization

    @property
    def fits(self) -> bool:
        return self.need_gib <= self.budget_gib + 1e-9

    def describe(self) -> str:
        gpu = INSTANCE_FACTS[self.instance_type].gpu
        if self.engines > 1:
            need = (f"tasks {', '.join(self.tasks)} start {self.engines} engines, each loading the weights: "
                    f"{self.engines} x weightsGib {self.weights_gib:g}")
            shares = f" ({self.utilization / self.engines:g} per engine)"
        else:
            need, shares = f"weightsGib {self.weights_gib:g}", ""
        return (f"{need} + kvCacheGib {self.kv_cache_gib:g} = {self.need_gib:g} GiB, the GPU memory the "
                f"{'engines' if self.engines > 1 else 'engine'} may use: {self.gpus} x {self.gpu_memory_gib} GiB "
                f"({gpu}, {self.instance_type}, the pool's least GPU memory) x gpu_memory_utilization "
                f"{self.utilization:g}{shares} = {self.budget_gib:g} GiB")


def gpu_memory_fit(instance_types: list[str], gpus: int, weights_gib: float, kv_cache_gib: float,
                   utilization: float, tasks: tuple[str, ...] = ()) -> GpuMemoryFit:
    """The fit on the pool's type with the least memory per GPU (any type of the pool may host the pod). `tasks`: a
    vllm model's, whose engines share `utilization` (engine_budget)."""
    smallest = min(instance_types, key=lambda t: INSTANCE_FACTS[t].gpu_memory_gib)
    return GpuMemoryFit(weights_gib, kv_cache_gib, gpus, INSTANCE_FACTS[smallest].gpu_memory_gib, smallest,
                        utilization, tuple(tasks))


def engine_budget(tasks: tuple[str, ...]) -> float:
    """What a vllm pod's engines take together: the sum of the shares the Deployment renders
    (pc.engine_memory_shares, at most what one engine may take)."""
    return sum(engine_memory_shares(tasks).values())


@dataclass(frozen=True)
class LoadTime:
    weights_gib: float
    pods: int
    storage_capacity_gib: int
    per_unit_throughput: int  # MB/s per TiB
    load_time_seconds: int

    @property
    def throughput_mb_s(self) -> float:
        return self.per_unit_throughput * self.storage_capacity_gib / 1024

    @property
    def read_seconds(self) -> float:
        """The pods reading the weights at once share the file system's throughput."""
        return self.weights_gib * GIB * self.pods / (self.throughput_mb_s * MB)

    @property
    def needed_seconds(self) -> float:
        return self.read_seconds + ENGINE_STARTUP_ALLOWANCE_S

    @property
    def fits(self) -> bool:
        return self.needed_seconds <= self.load_time_seconds

    def describe(self) -> str:
        return (f"{self.pods} pod(s) reading weightsGib {self.weights_gib:g} at once from FSx at "
                f"{self.throughput_mb_s:g} MB/s (perUnitStorageThroughput {self.per_unit_throughput} MB/s/TiB x "
                f"storageCapacityGib {self.storage_capacity_gib} / 1024) take {self.read_seconds:.0f} s, plus "
                f"{ENGINE_STARTUP_ALLOWANCE_S} s for the engine's start: {self.needed_seconds:.0f} s needed, "
                f"loadTimeSeconds {self.load_time_seconds}")
