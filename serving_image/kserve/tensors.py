"""KServe v2 tensors as plain Python values, and their wire forms (gRPC protobuf and HTTP JSON).

Only the three datatypes of the LLM tensor contract (docs/architecture.md §3.3) are decoded: BYTES, BOOL and UINT32.
Anything else a client sends is reported by name, so the error says which tensor was wrong and how.
"""

from __future__ import annotations

import struct
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

SUPPORTED_DATATYPES = ("BYTES", "BOOL", "UINT32")
# The largest single BYTES element accepted (a prompt far above any context window, but bounded memory).
MAX_BYTES_ELEMENT = 4 * 1024 * 1024
MAX_ELEMENTS = 1024


class TensorError(ValueError):
    """A tensor that cannot be decoded or does not fit the model; `field` names it."""

    def __init__(self, field: str, message: str):
        super().__init__(message)
        self.field = field


@dataclass(frozen=True)
class Tensor:
    name: str
    datatype: str
    shape: tuple[int, ...]
    values: tuple[Any, ...]  # bytes for BYTES, bool for BOOL, int for UINT32


def element_count(shape: Sequence[int]) -> int:
    count = 1
    for dim in shape:
        count *= dim
    return count


def _check_shape(name: str, shape: Sequence[int]) -> tuple[int, ...]:
    shape = tuple(int(d) for d in shape)
    if any(d < 0 for d in shape):
        raise TensorError(f"input '{name}'", f"input '{name}': shape {list(shape)} has a negative dimension")
    if element_count(shape) > MAX_ELEMENTS:
        raise TensorError(f"input '{name}'", f"input '{name}': shape {list(shape)} holds more than {MAX_ELEMENTS} "
                          "elements")
    return shape


def split_raw_bytes(name: str, raw: bytes, count: int) -> tuple[bytes, ...]:
    """Triton's raw BYTES layout: each element is a 4-byte little-endian length, then the bytes."""
    out, pos = [], 0
    while pos < len(raw):
        if pos + 4 > len(raw):
            raise TensorError(f"input '{name}'", f"input '{name}': raw BYTES content is truncated in a length prefix")
        (length,) = struct.unpack_from("<I", raw, pos)
        pos += 4
        if length > MAX_BYTES_ELEMENT:
            raise TensorError(f"input '{name}'", f"input '{name}': an element of {length} bytes exceeds the limit of "
                              f"{MAX_BYTES_ELEMENT} bytes")
        if pos + length > len(raw):
            raise TensorError(f"input '{name}'", f"input '{name}': raw BYTES content is shorter than its length "
                              f"prefix ({length} bytes)")
        out.append(raw[pos:pos + length])
        pos += length
    if len(out) != count:
        raise TensorError(f"input '{name}'", f"input '{name}': raw content holds {len(out)} elements but shape "
                          f"holds {count}")
    return tuple(out)


def join_raw_bytes(values: Sequence[bytes]) -> bytes:
    return b"".join(struct.pack("<I", len(v)) + v for v in values)


def decode_raw(name: str, datatype: str, shape: tuple[int, ...], raw: bytes) -> tuple:
    """Values from raw content (gRPC raw_input_contents, or an HTTP binary-data section)."""
    count = element_count(shape)
    if datatype == "BYTES":
        return split_raw_bytes(name, raw, count)
    if datatype == "BOOL":
        if len(raw) != count:
            raise TensorError(f"input '{name}'", f"input '{name}': raw BOOL content has {len(raw)} bytes, shape "
                              f"needs {count}")
        return tuple(b != 0 for b in raw)
    if len(raw) != 4 * count:
        raise TensorError(f"input '{name}'", f"input '{name}': raw UINT32 content has {len(raw)} bytes, shape "
                          f"needs {4 * count}")
    return struct.unpack(f"<{count}I", raw)


def decode_grpc_input(tensor, raw: bytes | None) -> Tensor:
    """A `ModelInferRequest.InferInputTensor` (and its raw_input_contents entry, if any) as a Tensor."""
    name, datatype = tensor.name, tensor.datatype
    shape = _check_shape(name, tensor.shape)
    count = element_count(shape)
    if datatype not in SUPPORTED_DATATYPES:
        raise TensorError(f"input '{name}'", f"input '{name}': datatype {datatype or '(empty)'} is not one this "
                          f"model uses ({', '.join(SUPPORTED_DATATYPES)})")
    contents = tensor.contents
    if raw is not None:
        values: tuple = decode_raw(name, datatype, shape, raw)
    elif datatype == "BYTES":
        values = tuple(contents.bytes_contents)
        for v in values:
            if len(v) > MAX_BYTES_ELEMENT:
                raise TensorError(f"input '{name}'", f"input '{name}': an element of {len(v)} bytes exceeds the limit "
                                  f"of {MAX_BYTES_ELEMENT} bytes")
    elif datatype == "BOOL":
        values = tuple(contents.bool_contents)
    else:
        values = tuple(contents.uint_contents)
    if len(values) != count:
        raise TensorError(f"input '{name}'", f"input '{name}': {len(values)} {datatype} values given but shape "
                          f"{list(shape)} holds {count}")
    return Tensor(name, datatype, shape, values)


def decode_json_input(item: Mapping[str, Any], index: int, binary: bytes | None = None) -> Tensor:
    """One entry of a KServe v2 HTTP `inputs` array ({name, shape, datatype, data}); `binary` is its slice of the
    binary-data section when it declared `parameters.binary_data_size` (Triton's binary tensor extension)."""
    if not isinstance(item, Mapping):
        raise TensorError(f"inputs[{index}]", f"inputs[{index}] must be an object")
    name = item.get("name")
    if not isinstance(name, str) or not name:
        raise TensorError(f"inputs[{index}].name", f"inputs[{index}].name must be a non-empty string")
    datatype = item.get("datatype")
    shape = item.get("shape")
    if not isinstance(shape, list) or not all(isinstance(d, int) and not isinstance(d, bool) for d in shape):
        raise TensorError(f"input '{name}'", f"input '{name}': shape must be a list of integers")
    shape = _check_shape(name, shape)
    if datatype not in SUPPORTED_DATATYPES:
        raise TensorError(f"input '{name}'", f"input '{name}': datatype {datatype!r} is not one this model uses "
                          f"({', '.join(SUPPORTED_DATATYPES)})")
    if binary is not None:
        return Tensor(name, datatype, shape, decode_raw(name, datatype, shape, binary))
    data = item.get("data")
    flat: list = []

    def walk(value) -> None:
        if isinstance(value, list):
            for v in value:
                walk(v)
        else:
            flat.append(value)

    walk(data)
    values: list = []
    for v in flat:
        if datatype == "BYTES":
            if not isinstance(v, str):
                raise TensorError(f"input '{name}'", f"input '{name}': BYTES data must be strings, got {v!r:.40}")
            encoded = v.encode("utf-8")
            if len(encoded) > MAX_BYTES_ELEMENT:
                raise TensorError(f"input '{name}'", f"input '{name}': an element of {len(encoded)} bytes exceeds "
                                  f"the limit of {MAX_BYTES_ELEMENT} bytes")
            values.append(encoded)
        elif datatype == "BOOL":
            if not isinstance(v, bool):
                raise TensorError(f"input '{name}'", f"input '{name}': BOOL data must be true/false, got {v!r:.40}")
            values.append(v)
        else:
            if not isinstance(v, int) or isinstance(v, bool) or not 0 <= v < 2**32:
                raise TensorError(f"input '{name}'", f"input '{name}': UINT32 data must be integers in 0..2^32-1")
            values.append(v)
    count = element_count(shape)
    if len(values) != count:
        raise TensorError(f"input '{name}'", f"input '{name}': {len(values)} {datatype} values given but shape "
                          f"{list(shape)} holds {count}")
    return Tensor(name, datatype, shape, tuple(values))


def to_grpc_output(tensor: Tensor, output) -> bytes:
    """Fill a `ModelInferResponse.InferOutputTensor` header and return its raw content (Triton sends raw)."""
    output.name = tensor.name
    output.datatype = tensor.datatype
    output.shape.extend(tensor.shape)
    if tensor.datatype == "BYTES":
        return join_raw_bytes(tensor.values)
    if tensor.datatype == "BOOL":
        return bytes(1 if v else 0 for v in tensor.values)
    return struct.pack(f"<{len(tensor.values)}I", *tensor.values)


def to_json_output(tensor: Tensor) -> dict[str, Any]:
    data = [v.decode("utf-8", errors="replace") for v in tensor.values] if tensor.datatype == "BYTES" \
        else list(tensor.values)
    return {"name": tensor.name, "datatype": tensor.datatype, "shape": list(tensor.shape), "data": data}
