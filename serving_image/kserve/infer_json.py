"""KServe v2 HTTP `/infer` bodies for Triton models of any datatype (serving_image/kserve/triton_http.py's unary
inference on models that are not decoupled, e.g. the ranker's FP32 tensors): pure translation, no I/O.

The request is JSON, optionally followed by a binary section (Triton's binary tensor data extension, what
tritonclient.http sends by default): the header `Inference-Header-Content-Length` says where the JSON ends, and each
input with `parameters.binary_data_size` takes that many bytes of the section, in order (BYTES elements as 4-byte
little-endian lengths and their bytes, other datatypes little-endian and row-major). Without it an input carries
`data`, a flat or nested JSON list in row-major order.

The response lists every output the request named (all of the model's when it named none), as JSON `data` unless the
output asked for `parameters.binary_data` (or the request for `parameters.binary_data_output`), in which case its
bytes follow the JSON in the same binary section layout. Every malformed part is an InferBodyError naming it.
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from typing import Any

import numpy as np

from serving_image.triton.capi.inference import NUMPY_DTYPES, Input, decode_bytes

HEADER_LENGTH = "Inference-Header-Content-Length"
BINARY_CONTENT_TYPE = "application/octet-stream"


class InferBodyError(ValueError):
    """A request body that cannot be decoded (HTTP 400); the message names the part."""


@dataclass(frozen=True)
class InferCall:
    inputs: list[Input]
    parameters: dict[str, Any]
    outputs: list[str]  # empty: every output of the model
    binary_outputs: frozenset[str]  # outputs to return in the binary section
    binary_by_default: bool  # the request's parameters.binary_data_output
    request_id: str


def _flatten(value: Any) -> list:
    if isinstance(value, list):
        return [item for element in value for item in _flatten(element)]
    return [value]


def _input(item: Any, index: int, section: bytes, offset: int) -> tuple[Input, int]:
    where = f"inputs[{index}]"
    if not isinstance(item, dict):
        raise InferBodyError(f"{where} must be an object with name, datatype, shape and data")
    name, datatype, shape = item.get("name"), item.get("datatype"), item.get("shape")
    if not isinstance(name, str) or not name:
        raise InferBodyError(f"{where}.name must be a non-empty string")
    where = f"input '{name}'"
    if datatype != "BYTES" and datatype not in NUMPY_DTYPES:
        raise InferBodyError(f"{where}: datatype {datatype!r} is not one of BYTES, {', '.join(NUMPY_DTYPES)}")
    if not isinstance(shape, list) or not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0
                                              for d in shape):
        raise InferBodyError(f"{where}: shape must be a list of non-negative integers, got {shape!r}")
    count = int(np.prod(shape)) if shape else 1
    parameters = item.get("parameters") or {}
    if not isinstance(parameters, dict):
        raise InferBodyError(f"{where}: parameters must be an object")
    size = parameters.get("binary_data_size")
    if size is not None:
        if not isinstance(size, int) or isinstance(size, bool) or size < 0 or offset + size > len(section):
            raise InferBodyError(f"{where}: binary_data_size {size!r} does not fit the {len(section) - offset} "
                                 "bytes of binary data left")
        raw, offset = section[offset:offset + size], offset + size
        if datatype == "BYTES":
            values = decode_bytes(raw)
            if len(values) != count or sum(4 + len(v) for v in values) != len(raw):
                raise InferBodyError(f"{where}: {size} bytes of BYTES data do not hold the {count} elements of shape "
                                     f"{shape}")
            return Input.from_bytes(name, values, shape), offset
        expected = count * np.dtype(NUMPY_DTYPES[datatype]).itemsize
        if len(raw) != expected:
            raise InferBodyError(f"{where}: {len(raw)} bytes of binary data; shape {shape} of {datatype} needs "
                                 f"{expected}")
        return Input(name, datatype, tuple(shape), raw), offset
    if "data" not in item:
        raise InferBodyError(f"{where}: neither data nor parameters.binary_data_size")
    values = _flatten(item["data"])
    if len(values) != count:
        raise InferBodyError(f"{where}: {len(values)} values for shape {shape} ({count} elements)")
    try:
        if datatype == "BYTES":
            if not all(isinstance(v, str) for v in values):
                raise ValueError("BYTES data must be strings")
            return Input.from_bytes(name, values, shape), offset
        if datatype == "BOOL" and not all(isinstance(v, bool) for v in values):
            raise ValueError("BOOL data must be true or false")
        if datatype != "BOOL" and not all(isinstance(v, int | float) and not isinstance(v, bool) for v in values):
            raise ValueError(f"{datatype} data must be numbers")
        array = np.array(values, dtype=NUMPY_DTYPES[datatype]).reshape(shape)
    except (ValueError, OverflowError, TypeError) as exc:
        raise InferBodyError(f"{where}: {exc}") from None
    return Input.from_numpy(name, array), offset


def parse_infer_body(raw: bytes, header_length: str | None) -> InferCall:
    section = b""
    if header_length is not None:
        try:
            cut = int(header_length)
        except ValueError:
            cut = -1
        if not 0 <= cut <= len(raw):
            raise InferBodyError(f"{HEADER_LENGTH} must be an integer in 0..{len(raw)}, got {header_length!r}")
        raw, section = raw[:cut], raw[cut:]
    try:
        body = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise InferBodyError(f"request body is not valid JSON: {exc}") from None
    if not isinstance(body, dict):
        raise InferBodyError("request body must be a JSON object")
    items = body.get("inputs")
    if not isinstance(items, list) or not items:
        raise InferBodyError("inputs must be a non-empty list of tensors")
    inputs, offset = [], 0
    for index, item in enumerate(items):
        tensor, offset = _input(item, index, section, offset)
        inputs.append(tensor)
    if offset != len(section):
        raise InferBodyError(f"{len(section) - offset} bytes of binary data belong to no input")
    parameters = body.get("parameters") or {}
    if not isinstance(parameters, dict):
        raise InferBodyError("parameters must be an object")
    binary_default = parameters.pop("binary_data_output", False) is True
    outputs, binary = [], set()
    for index, item in enumerate(body.get("outputs") or []):
        if not isinstance(item, dict) or not isinstance(item.get("name"), str):
            raise InferBodyError(f"outputs[{index}] must be an object with a name")
        outputs.append(item["name"])
        if (item.get("parameters") or {}).get("binary_data", binary_default) is True:
            binary.add(item["name"])
    return InferCall(inputs, parameters, outputs, frozenset(binary), binary_default, str(body.get("id", "")))


def _datatype(array: np.ndarray) -> str:
    if array.dtype == np.object_:
        return "BYTES"
    return next(name for name, dtype in NUMPY_DTYPES.items() if np.dtype(dtype) == array.dtype)


def infer_response_body(call: InferCall, model: str, version: str,
                        outputs: dict[str, np.ndarray]) -> tuple[bytes, dict[str, str]]:
    """The response body and its extra headers (the binary section's header length, when there is one)."""
    header: dict[str, Any] = {"model_name": model, "model_version": version or "1", "outputs": []}
    if call.request_id:
        header["id"] = call.request_id
    section = b""
    for name in call.outputs or list(outputs):
        if name not in outputs:
            raise InferBodyError(f"output '{name}' was requested but the model did not produce it")
        array = np.asarray(outputs[name])
        datatype = _datatype(array)
        entry: dict[str, Any] = {"name": name, "datatype": datatype, "shape": list(array.shape)}
        if name in call.binary_outputs or (not call.outputs and call.binary_by_default):
            if datatype == "BYTES":
                data = b"".join(struct.pack("<I", len(v)) + bytes(v) for v in array.reshape(-1).tolist())
            else:
                data = np.ascontiguousarray(array).astype(array.dtype.newbyteorder("<")).tobytes()
            entry["parameters"] = {"binary_data_size": len(data)}
            section += data
        else:
            values = array.reshape(-1).tolist()
            entry["data"] = [v.decode("utf-8", "replace") if isinstance(v, bytes) else v for v in values]
        header["outputs"].append(entry)
    text = json.dumps(header, separators=(",", ":")).encode()
    if not section:
        return text, {}
    return text + section, {HEADER_LENGTH: str(len(text))}
