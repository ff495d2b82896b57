"""The part of Triton's `triton_python_backend_utils` that a Python-backend model uses to read its requests and
answer them, for running its `model.py` in the caller's process (installed under that module name while the model
is imported, llm_serving_client/inprocess/python_model.py).

Tensors, requests, responses and errors only: what the ranker and the pipeline steps call. Business-logic scripting
(`InferenceRequest(...).exec()`, calling other models of the server) has no server here: it raises, naming the call,
so a model that needs it is never silently half-run.
"""

from __future__ import annotations

import numpy as np

_TRITON_TO_NUMPY = {"TYPE_BOOL": np.bool_, "TYPE_UINT8": np.uint8, "TYPE_UINT16": np.uint16, "TYPE_UINT32": np.uint32,
                    "TYPE_UINT64": np.uint64, "TYPE_INT8": np.int8, "TYPE_INT16": np.int16, "TYPE_INT32": np.int32,
                    "TYPE_INT64": np.int64, "TYPE_FP16": np.float16, "TYPE_FP32": np.float32,
                    "TYPE_FP64": np.float64, "TYPE_STRING": np.object_}


class TritonError(Exception):
    UNKNOWN, INTERNAL, NOT_FOUND, INVALID_ARG, UNAVAILABLE, UNSUPPORTED, ALREADY_EXISTS, CANCELLED = range(8)

    def __init__(self, message: str, code: int = 1):
        super().__init__(message)
        self._message, self._code = message, code

    def message(self) -> str:
        return self._message

    def code(self) -> int:
        return self._code


class Tensor:
    def __init__(self, name: str, array: np.ndarray):
        self._name, self._array = name, np.asarray(array)

    def name(self) -> str:
        return self._name

    def as_numpy(self) -> np.ndarray:
        return self._array


class InferenceRequest:
    """A request handed to `execute`. Constructed by a model to call another model (BLS), it cannot run here."""

    def __init__(self, inputs: list[Tensor] | None = None, request_id: str = "", model_name: str = "", **_: object):
        self._inputs, self._request_id, self._model_name = list(inputs or []), request_id, model_name

    def inputs(self) -> list[Tensor]:
        return self._inputs

    def request_id(self) -> str:
        return self._request_id

    def exec(self, *args: object, **kwargs: object):
        raise TritonError(f"business-logic scripting (calling model {self._model_name!r}) needs a Triton server; "
                          f"a model that calls other models does not run in the caller's process",
                          TritonError.UNSUPPORTED)

    async_exec = exec


class InferenceResponse:
    def __init__(self, output_tensors: list[Tensor] | None = None, error: TritonError | None = None):
        self._outputs, self._error = list(output_tensors or []), error

    def output_tensors(self) -> list[Tensor]:
        return self._outputs

    def has_error(self) -> bool:
        return self._error is not None

    def error(self) -> TritonError | None:
        return self._error


def get_input_tensor_by_name(request: InferenceRequest, name: str) -> Tensor | None:
    return next((t for t in request.inputs() if t.name() == name), None)


def get_output_tensor_by_name(response: InferenceResponse, name: str) -> Tensor | None:
    return next((t for t in response.output_tensors() if t.name() == name), None)


def get_output_config_by_name(model_config: dict, name: str) -> dict | None:
    return next((o for o in model_config.get("output", []) if o["name"] == name), None)


def get_input_config_by_name(model_config: dict, name: str) -> dict | None:
    return next((i for i in model_config.get("input", []) if i["name"] == name), None)


def triton_string_to_numpy(triton_type: str):
    return _TRITON_TO_NUMPY[triton_type]
