"""Tensor inference over KServe v2 gRPC (NVIDIA's tritonclient): the ranker, an ensemble, any non-LLM model.

Inputs are checked against the model's metadata (names, datatypes, shapes) before they are sent, so a wrong tensor
is an error naming the model and the input instead of a server round trip; the metadata is asked once per route.
A unary ModelInfer is idempotent: it is retried on UNAVAILABLE within the deadline (llm_serving_client.retry).
"""

from __future__ import annotations

import threading
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np
import tritonclient.grpc as grpcclient
from tritonclient.utils import InferenceServerException, np_to_triton_dtype

from llm_serving_client.discovery import Route
from llm_serving_client.errors import CallError, DeadlineExceeded, InvalidRequest, ServerError, Unavailable


@dataclass(frozen=True)
class TensorSpec:
    name: str
    datatype: str
    shape: tuple[int, ...]  # -1: any size (the batch dimension of a batching model included)


@dataclass(frozen=True)
class ModelIO:
    inputs: dict[str, TensorSpec]
    outputs: dict[str, TensorSpec]


def _specs(items) -> dict[str, TensorSpec]:
    return {t.name: TensorSpec(t.name, t.datatype, tuple(int(d) for d in t.shape)) for t in items}


def check_inputs(route: Route, io: ModelIO, inputs: Mapping[str, np.ndarray]) -> None:
    """Every input the model declares is given with its datatype and a shape its dims allow; no other input is."""
    def bad(field: str, message: str) -> InvalidRequest:
        return InvalidRequest(message, model=route.model, version=route.version, field=field)

    unknown = sorted(set(inputs) - set(io.inputs))
    if unknown:
        raise bad(unknown[0], f"is not an input of the model (inputs: {sorted(io.inputs)})")
    missing = sorted(set(io.inputs) - set(inputs))
    if missing:
        raise bad(missing[0], f"is missing (inputs: {sorted(io.inputs)})")
    for name, array in inputs.items():
        spec = io.inputs[name]
        if not isinstance(array, np.ndarray):
            raise bad(name, f"is a {type(array).__name__}; pass a numpy array of {spec.datatype}")
        datatype = np_to_triton_dtype(array.dtype)
        if datatype != spec.datatype:
            raise bad(name, f"is {datatype} ({array.dtype}); the model takes {spec.datatype}")
        if len(array.shape) != len(spec.shape) or any(d != -1 and d != s for d, s in zip(spec.shape, array.shape,
                                                                                          strict=True)):
            raise bad(name, f"has shape {list(array.shape)}; the model takes {list(spec.shape)} (-1: any size)")


def _error(route: Route, exc: InferenceServerException, what: str) -> CallError:
    status, message = str(exc.status() or ""), exc.message() or str(exc)
    kwargs = {"model": route.model, "version": route.version}
    if "UNAVAILABLE" in status:
        return Unavailable(f"{what}: {message}", **kwargs)
    if "DEADLINE_EXCEEDED" in status or "Deadline Exceeded" in message:
        return DeadlineExceeded(f"{what}: {message}", **kwargs)
    if "INVALID_ARGUMENT" in status or "NOT_FOUND" in status:
        return InvalidRequest(f"{what}: {message}", **kwargs)
    return ServerError(f"{what} ({status or 'no status'}): {message}", **kwargs)


class TensorTransport:
    """One gRPC channel per address, and the I/O of each model asked once."""

    def __init__(self) -> None:
        self._clients: dict[tuple[str, bool], grpcclient.InferenceServerClient] = {}
        self._io: dict[tuple[str, str], ModelIO] = {}
        self._lock = threading.Lock()

    def _client(self, route: Route) -> grpcclient.InferenceServerClient:
        key = (route.address, route.tls)
        with self._lock:
            if key not in self._clients:
                gateway = route.gateway
                if gateway is None:
                    self._clients[key] = grpcclient.InferenceServerClient(route.address, ssl=route.tls)
                else:
                    # The gateway's address dialled; the TLS name and the :authority stay the route's hostname, by
                    # which the gateway picks the model's GRPCRoute.
                    # Given channel_args, tritonclient drops its default options: its message size limits kept.
                    host = route.address.rpartition(":")[0]
                    limits = [(f"grpc.max_{way}_message_length", grpcclient.MAX_GRPC_MESSAGE_SIZE)
                              for way in ("send", "receive")]
                    self._clients[key] = grpcclient.InferenceServerClient(
                        gateway.address, ssl=True, root_certificates=gateway.ca_file, channel_args=[
                            *limits, ("grpc.ssl_target_name_override", host), ("grpc.default_authority", host)])
            return self._clients[key]

    def model_io(self, route: Route, timeout_s: float, headers: dict[str, str]) -> ModelIO:
        key = (route.address, route.model)
        if key not in self._io:
            try:
                meta = self._client(route).get_model_metadata(route.model, headers=headers, client_timeout=timeout_s)
            except InferenceServerException as exc:
                raise _error(route, exc, "asking the model's metadata") from None
            self._io[key] = ModelIO(_specs(meta.inputs), _specs(meta.outputs))
        return self._io[key]

    @staticmethod
    def serialise(inputs: Mapping[str, np.ndarray], io: ModelIO) -> list[grpcclient.InferInput]:
        wire = []
        for name, array in inputs.items():
            tensor = grpcclient.InferInput(name, list(array.shape), io.inputs[name].datatype)
            tensor.set_data_from_numpy(array)
            wire.append(tensor)
        return wire

    def infer(self, route: Route, wire: list[grpcclient.InferInput], outputs: list[str], timeout_s: float,
              headers: dict[str, str]) -> grpcclient.InferResult:
        requested = [grpcclient.InferRequestedOutput(name) for name in outputs]
        try:
            return self._client(route).infer(route.model, wire, outputs=requested, client_timeout=timeout_s,
                                             headers=headers)
        except InferenceServerException as exc:
            raise _error(route, exc, "ModelInfer") from None

    def close(self) -> None:
        with self._lock:
            for client in self._clients.values():
                client.close()
            self._clients.clear()
