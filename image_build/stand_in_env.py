"""Values of the image's ENV that name something only NGC's base or a production node has, replaced where the image
runs on this machine (the image check and the rehearsal's pods): the rendered env of a Deployment is laid over
them and never changed."""

from __future__ import annotations

from llm_serving import pod_contract as pc
from serving_image.triton_stub.backends.vllm.engine_in_stub import ENGINE_NICE_ENV

IMAGE_ENV_OVERRIDES: dict[str, str] = {
    # The image runs Triton in-process with the release's vLLM on GPUs; here the engine is vLLM's CPU build.
    pc.ENV_RUNTIME: "local",
    # vLLM's CPU build binds each engine's OpenMP threads to cores of its own choosing ("auto": on this 2-core machine
    # every engine takes core 0 and reserves core 1), so the rehearsal's several engine pods all ran on one core and
    # a new pod's engine took minutes to start while the others served. Here the pods share the machine's cores as
    # the kernel schedules them; in production each pod has its node's CPUs and GPU to itself.
    "VLLM_CPU_OMP_THREADS_BIND": "nobind",
    # vLLM's CPU workers busy-poll their message queue for a second after each step, so two engines serving a light
    # load keep both cores busy; a new pod's Triton stub, sharing those cores, then missed the Python backend's
    # one-second health handshake during its engine's start (measured: a 300 ms sleeper woke up to 590 ms late), the
    # model's load failed and Triton hung waiting for the stub (every red-black candidate's pod, until this). The
    # engines (the stand-in backend's engine, engine_in_stub.ENGINE_NICE_ENV) run at a lower priority than
    # the pods' own processes; in production each pod has its node's CPUs to itself.
    ENGINE_NICE_ENV: "10",
}

